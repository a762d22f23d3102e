"""What a checkpoint costs, measured by real launches of recipes/train.py: the step's stall of a synchronous save
against a background one (`--save_async`), and how saving, loading and the export's gather grow with the model and
the ranks.

    python recipes/measure/checkpoint_cost.py stall --output_dir runs/checkpoint_stall
    python recipes/measure/checkpoint_cost.py growth --output_dir runs/growth --plot docs/img/checkpoint_cost.png
    python recipes/measure/checkpoint_cost.py growth --output_dir runs/growth --no_launch   # print it again

`stall`: gpt2-124m on 2 ranks per family (DDP, FSDP2, a 2-stage pipeline), checkpoints at steps 4 and 8 of 9,
saved synchronously and then with --save_async: the second save's step wait (`checkpoint_save_s`: the first
background save allocated the host copy the second writes over), the background write's seconds (its log line) and
the wait's share of the synchronous save. `growth`: per family (DDP, FSDP2, ZeRO-3), model size
(tiny to llama-1b) and ranks (1, 2, 4), a launch that trains a step and saves, then one that resumes from it: the
save's and the load's seconds and each rank's resident host peak during them (sampled in a thread: training/report/
summary.py's `HostPeak`), and rank 0's peak during the export (its parts gathered and written in turn). A launch
the memory planner refuses on this machine is reported as such, not run. Every launch is fp32 on the embedded
default data, micro batch 1 of 64 tokens; the figures are read from each launch's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from training.paths import ROOT

FAMILIES = {"ddp": [], "fsdp": [], "pipeline": ["--pipeline_parallel_degree=2", "--gradient_accumulation_steps=2"],
            "zero3": []}  # fmt: skip
CONFIG = {"ddp": "ddp", "fsdp": "fsdp", "pipeline": "ddp", "zero3": "zero3"}
COMMON = ["--per_device_train_batch_size=1", "--block_size=64", "--eval_steps=0", "--max_eval_batches=1",
          "--sample_max_new_tokens=0", "--logging_steps=1", "--warmup_steps=0", "--save_total_limit=1"]  # fmt: skip
BACKGROUND = re.compile(r"saved (checkpoint-\d+) \(([\d,.]+) MB\) .*written in the background in ([\d.]+) s")


def launch(family: str, world: int, preset: str, out: Path, flags: list[str], log: Path) -> tuple[int, str]:
    """One `accelerate launch` of recipes/train.py; its exit status and output (also kept in `log`)."""
    with socket.socket() as s:  # a free port: other jobs may be training on this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" /
           f"{CONFIG[family]}.yaml"), "--num_processes", str(world), "--main_process_port", str(port),
           str(ROOT / "recipes" / "train.py"), f"--preset={preset}", f"--output_dir={out}", *COMMON,
           *FAMILIES[family], *flags]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    print(f"  {' '.join(cmd[1:])}: exit {done.returncode} in {time.perf_counter() - started:.0f} s", flush=True)
    return done.returncode, done.stdout + done.stderr


def closing_record(out: Path) -> dict:
    """The launch's last metrics.jsonl record: where its time and host memory went."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]


def refusal(stderr: str) -> str:
    """The one-line error a launch ended with (the memory planner's refusal, say)."""
    lines = [line.split("error: ", 1)[1] for line in stderr.splitlines() if "error: " in line]
    return lines[-1] if lines else stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------- stall


def stall(root: Path, launch_runs: bool) -> list[dict]:
    rows = []
    for family in ("ddp", "fsdp", "pipeline"):
        row = {"family": family}
        for mode, flags in (("sync", []), ("async", ["--save_async"])):
            out = root / f"{family}_{mode}"
            if launch_runs:
                subprocess.run(["rm", "-rf", str(out)], check=True)
                code, _ = launch(family, 2, "gpt2-124m", out, ["--max_steps=9", "--save_steps=4", *flags],
                                 root / f"{family}_{mode}.log")  # fmt: skip
                if code:
                    sys.exit(f"{family} {mode} failed: see {root / f'{family}_{mode}.log'}")
            record = closing_record(out)
            row[f"{mode}_s"] = record["checkpoint_save_s"]
            row[f"{mode}_peak_gb"] = max(record["checkpoint_save_peak_rss_gb"])
            if mode == "async":
                found = list(BACKGROUND.finditer((root / f"{family}_{mode}.log").read_text()))
                last = found[-1]  # the second save's line
                row["background_s"], row["mb"] = float(last.group(3)), float(last.group(2).replace(",", ""))
        row["share"] = row["async_s"] / row["sync_s"]
        rows.append(row)
    print(
        "\n| family (gpt2-124m, 2 ranks) | checkpoint MB | synchronous save s | --save_async: step waits s | "
        "written in the background s | wait / synchronous | host peak sync / async GB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['family']} | {r['mb']:,.0f} | {r['sync_s']:.2f} | {r['async_s']:.2f} | {r['background_s']:.2f} | "
            f"{r['share']:.0%} | {r['sync_peak_gb']:.2f} / {r['async_peak_gb']:.2f} |"
        )
    return rows


# ---------------------------------------------------------------------- growth


def growth(root: Path, presets: list[str], worlds: list[int], families: list[str], launch_runs: bool) -> list[dict]:
    rows = []
    for preset in presets:
        for family in families:
            for world in worlds:
                cell = root / f"{preset}_{family}_n{world}"
                row = {"preset": preset, "family": family, "world": world}
                if launch_runs:
                    print(f"{preset} {family} on {world} rank(s)", flush=True)
                    subprocess.run(["rm", "-rf", str(cell)], check=True)
                    cell.mkdir(parents=True)
                    code, err = launch(family, world, preset, cell / "out", ["--max_steps=1", "--save_steps=1"],
                                       cell / "save.log")  # fmt: skip
                    if code == 0:
                        code, err = launch(family, world, preset, cell / "out",
                                           ["--max_steps=2", "--save_steps=0", "--resume_from_checkpoint=auto"],
                                           cell / "load.log")  # fmt: skip
                    (cell / "status.txt").write_text("ok" if code == 0 else refusal(err))
                if not (cell / "status.txt").is_file():
                    rows.append({**row, "refused": "not measured (launch it without --no_launch)"})
                    continue
                status = (cell / "status.txt").read_text()
                if status != "ok":
                    rows.append({**row, "refused": status})
                    continue
                logs = [json.loads(line) for line in (cell / "out" / "metrics.jsonl").read_text().splitlines()]
                saved, loaded = [r for r in logs if "wall_s" in r]  # the two launches' closing records
                files = json.loads(next((cell / "out").glob("checkpoint-*/checkpoint_complete")).read_text())["files"]
                rows.append({**row, "gb": sum(f["size"] for f in files.values()) / 1e9,
                             "save_s": saved["checkpoint_save_s"], "load_s": loaded["checkpoint_load_s"],
                             "save_peak_gb": max(saved["checkpoint_save_peak_rss_gb"]),
                             "load_peak_gb": max(loaded["checkpoint_load_peak_rss_gb"]),
                             "export_peak_gb": saved["export_peak_rss_gb"][0],
                             "export_added_gb": saved["export_added_rss_gb"][0]})  # fmt: skip
    print(
        "\n| preset | family | ranks | checkpoint GB | save s | load s | host peak per rank, save / load GB | "
        "rank 0's peak in the export, and above its start GB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "refused" in r:
            why = re.search(r"predicted not to fit: (host RAM needs [\d.]+ GiB.*?, [\d.]+ GiB free)", r["refused"])
            why = f"the memory planner: {why.group(1)}" if why else r["refused"]
            print(f"| {r['preset']} | {r['family']} | {r['world']} | not run ({why}) |||||")
            continue
        print(
            f"| {r['preset']} | {r['family']} | {r['world']} | {r['gb']:.2f} | {r['save_s']:.2f} | "
            f"{r['load_s']:.2f} | {r['save_peak_gb']:.2f} / {r['load_peak_gb']:.2f} | {r['export_peak_gb']:.2f} "
            f"(+{r['export_added_gb']:.2f}) |"
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "refused" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = ("save (s)", "load (s)", "host peak per rank during the save (GB)")
    for ax, key, label in zip(axes, ("save_s", "load_s", "save_peak_gb"), labels, strict=True):
        for colour, family in enumerate(sorted({r["family"] for r in done})):  # a colour a family, a mark a world
            for world, marker, line in zip((1, 2, 4), "o^s", ("-", "--", ":"), strict=True):
                points = sorted((r["gb"], r[key]) for r in done if r["family"] == family and r["world"] == world)
                if points:
                    ax.plot(*zip(*points, strict=True), marker=marker, linestyle=line, color=f"C{colour}",
                            label=f"{family}, {world} rank(s)")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint size (GB, all ranks)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("A checkpoint's cost against its size: tiny to llama-1b, 1 to 4 CPU ranks (fp32)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["stall", "growth"])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--no_launch", action="store_true", help="Print (and plot) what output_dir holds.")
    parser.add_argument("--presets", nargs="+", default=["tiny", "gpt2-124m", "llama-1b"])
    parser.add_argument("--world_sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--families", nargs="+", default=["ddp", "fsdp", "zero3"], choices=["ddp", "fsdp", "zero3"])
    parser.add_argument("--plot", type=Path, help="growth: where to write the figure")
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.what == "stall":
        rows = stall(args.output_dir, not args.no_launch)
    else:
        rows = growth(args.output_dir, args.presets, args.world_sizes, args.families, not args.no_launch)
        if args.plot:
            plot(rows, args.plot)
    (args.output_dir / f"{args.what}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
