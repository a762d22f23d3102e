"""Muon against AdamW, measured: the steps (and seconds) each needs to reach the same eval loss, and what Muon's step
costs.

    python recipes/measure/muon_speed.py loss --output_dir runs/muon_speed --plot docs/img/muon_speed.png
    python recipes/measure/muon_speed.py loss --output_dir runs/muon_speed --no_launch   # print it again
    python recipes/measure/muon_speed.py step_cost

`loss`: `tiny` on the embedded default data, 200 steps of recipes/train.py per optimizer and peak learning rate of a
small sweep (`--learning_rates`; Muon's matrices and AdamW's rest take the same one, which --muon_adjust_lr
match_rms_adamw makes comparable), one process each, evaluated every 10 steps. Two launches run side by side, one
thread each, AdamW's and Muon's at the same learning rate, so both see the same machine. The target is the eval loss
AdamW reaches in 200 steps at its best learning rate. For Muon at its best: the first evaluation at or below it
(within its own 200-step schedule: a shorter schedule, annealed sooner, would reach it in fewer) and the training
seconds to it. The step time is each run's median, Muon's compared with the AdamW launch that ran beside it.
`step_cost`: the optimizer step alone (`optimizer.step()` on fixed gradients, one process, fp32, median of 10 after 2
warm-ups) for tiny and gpt2-124m, AdamW against Muon with bfloat16 and float32 Newton-Schulz: what the
orthogonalization costs a step on this machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from training.arguments import ArgumentParser
from training.paths import ROOT

STEPS = 200
OPTIMS = ("adamw_torch", "muon")
COMMON = ["--preset=tiny", f"--max_steps={STEPS}", "--eval_steps=10", "--max_eval_batches=20", "--save_steps=0",
          "--sample_max_new_tokens=0", "--logging_steps=1", "--overwrite_output_dir"]  # fmt: skip


def launch(out: Path, optim: str, lr: float) -> subprocess.Popen:
    run = out / f"{optim}-lr{lr:g}"
    args = [sys.executable, str(ROOT / "recipes" / "train.py"), *COMMON, f"--optim={optim}", f"--learning_rate={lr}",
            f"--output_dir={run}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(out / f"{run.name}.log", "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def read(run: Path) -> dict:
    """A run's eval losses by step, its median step time and cumulative training seconds by step."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    elapsed, total = {}, 0.0
    for step in sorted(times):
        total += times[step]
        elapsed[step] = total
    return {"evals": evals, "step_time_s": statistics.median(times.values()), "elapsed_s": elapsed}


def loss(out: Path, lrs: list[float], no_launch: bool, plot: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if not no_launch:
        for lr in lrs:  # AdamW's and Muon's launch at this learning rate side by side
            t0 = time.perf_counter()
            procs = [launch(out, optim, lr) for optim in ("adamw_torch", "muon")]
            codes = [p.wait() for p in procs]
            print(f"lr {lr:g}: exit {codes}, {time.perf_counter() - t0:.0f} s", flush=True)
    runs = {(optim, lr): read(out / f"{optim}-lr{lr:g}") for optim in ("adamw_torch", "muon") for lr in lrs
            if (out / f"{optim}-lr{lr:g}" / "metrics.jsonl").is_file()}  # fmt: skip
    best = {
        o: min((r["evals"][STEPS], lr) for (oo, lr), r in runs.items() if oo == o)[1] for o in ("adamw_torch", "muon")
    }
    target = runs["adamw_torch", best["adamw_torch"]]["evals"][STEPS]
    print(f"| optimizer | learning rate | eval loss at {STEPS} | steps to {target:.4f} | seconds to it | step time s |")
    print("|---|---|---|---|---|---|")
    reached = {}
    for (optim, lr), r in sorted(runs.items()):
        step = next((s for s in sorted(r["evals"]) if r["evals"][s] <= target), None)
        reached[optim, lr] = step
        seconds = f"{r['elapsed_s'][step]:.0f}" if step else "-"
        mark = " (best)" if best[optim] == lr else ""
        print(f"| {optim} | {lr:g}{mark} | {r['evals'][STEPS]:.4f} | {step or 'not reached'} | {seconds} | "
              f"{r['step_time_s']:.3f} |")  # fmt: skip
    a, m = runs["adamw_torch", best["adamw_torch"]], runs["muon", best["muon"]]
    steps = reached["muon", best["muon"]]
    # the step time against the AdamW launch that ran beside it (the same learning rate, the same machine load)
    beside = runs.get(("adamw_torch", best["muon"]), a)
    if steps:
        print(f"Muon at its best reaches AdamW's {STEPS}-step eval loss in {steps} steps: {STEPS / steps:.2f}x fewer, "
              f"at {m['step_time_s'] / beside['step_time_s']:.3f}x the step time of the AdamW launch beside it; "
              f"{m['elapsed_s'][steps]:.0f} s of training against AdamW's {a['elapsed_s'][STEPS]:.0f} s")  # fmt: skip
    else:
        print(f"Muon at its best does not reach AdamW's {STEPS}-step eval loss within {STEPS} steps")
    if plot:
        draw(runs, best, target, plot)


def draw(runs: dict, best: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"adamw_torch": "tab:blue", "muon": "tab:red"}
    for (optim, lr), r in sorted(runs.items()):
        steps = sorted(r["evals"])
        chosen = best[optim] == lr
        ax.plot(steps, [r["evals"][s] for s in steps], color=colors[optim], alpha=1.0 if chosen else 0.3,
                lw=2 if chosen else 1, label=f"{'AdamW' if optim == 'adamw_torch' else 'Muon'} lr {lr:g}")  # fmt: skip
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"AdamW's {STEPS}-step eval loss")
    ax.set(xlabel="optimizer step", ylabel="eval loss", title="tiny on the default corpus, one process (CPU)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def step_cost(presets: list[str]) -> None:
    """The optimizer step's seconds on fixed gradients: AdamW, Muon with bfloat16 and float32 Newton-Schulz."""
    import torch

    from model import ShardGPTConfig, ShardGPTForCausalLM
    from training.config import RunConfig
    from training.loop.optim import make_optimizer

    print("| preset | parameters | Muon's matrices | AdamW step s | Muon bf16 step s | Muon fp32 step s |")
    print("|---|---|---|---|---|---|")
    for preset in presets:
        torch.manual_seed(0)
        net = ShardGPTForCausalLM(ShardGPTConfig.from_preset(preset))
        for p in net.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        seconds = {}
        for name, flags in (("adamw", {}), ("bf16", {"optim": "muon"}),
                            ("fp32", {"optim": "muon", "muon_ns_dtype": "float32"})):  # fmt: skip
            optimizer = make_optimizer(RunConfig(preset=preset, **flags), net, None, fused=False)
            times = []
            for i in range(12):
                t0 = time.perf_counter()
                optimizer.step()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            seconds[name] = statistics.median(times)
        muon = make_optimizer(RunConfig(preset=preset, optim="muon"), net, None, fused=False)
        matrices = sum(len(g["params"]) for g in muon.param_groups if g["use_muon"])
        print(f"| {preset} | {net.num_parameters():,} | {matrices} | {seconds['adamw']:.3f} | {seconds['bf16']:.3f} | "
              f"{seconds['fp32']:.3f} |")  # fmt: skip


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("loss")
    one.add_argument("--output_dir", default="runs/muon_speed")
    one.add_argument("--learning_rates", default="1e-3,2e-3,4e-3,8e-3")
    one.add_argument("--no_launch", action="store_true", help="read the runs already in --output_dir")
    one.add_argument("--plot", default=None, help="write the eval-loss figure here")
    two = sub.add_parser("step_cost")
    two.add_argument("--presets", default="tiny,gpt2-124m")
    args = parser.parse_args()
    if args.what == "loss":
        loss(Path(args.output_dir), [float(x) for x in args.learning_rates.split(",")], args.no_launch, args.plot)
    else:
        step_cost(args.presets.split(","))


if __name__ == "__main__":
    main()
