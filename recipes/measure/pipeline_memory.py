"""The model's own pipeline stages: their bubble as the micro batches grow, and the bytes each holds for its backward
under GPipe and 1F1B, measured beside the memory planner's prediction.

    python recipes/measure/pipeline_memory.py                 # tiny, P = 2, M in {2, 4, 8}: table and plot
    python recipes/measure/pipeline_memory.py --pp 2 4 --micro_batches 4 8 16 --json rows.json
    python recipes/measure/pipeline_memory.py --rows rows.json  # table and plot of an earlier run's --json

One process per stage (gloo, one thread each), training/axes/pipeline/'s stages of the model run by torch's schedules
(`measure_model`, training/measure/bubble.py). Per stage: the step (the fastest of --steps), the share of it the stage
computed (its forward and backward, the training's busy clock) against M / (M + P - 1), and the most bytes it held for
its backward at once (autograd's saved tensors and the stage's kept outputs, counted live), against the planner's
`held_for_backward` (training/plan/memory/stages.stage_held). fp32. More stages than cores slows every stage: the bytes
stay exact, the times do not.
"""

from __future__ import annotations

from model import PRESETS, ShardGPTConfig
from training.arguments import ArgumentParser
from training.measure.bubble import ModelCase, add_run_flags, measure_model, run_recipe, save_against_micro_batches
from training.paths import ROOT
from training.plan.memory.planner import predict
from training.strategy import Strategy

MiB = 2**20


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="recipes/measure/pipeline_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=tuple(PRESETS), help="The model (a preset).")
    p.add_argument("--num_hidden_layers", type=int, default=None, help="Override the preset's layer count.")
    p.add_argument("--vocab_size", type=int, default=None, help="Override the preset's vocabulary (the head's size).")
    p.add_argument("--micro_batch", type=int, default=2, help="Sequences per micro batch.")
    p.add_argument("--seq_len", type=int, default=128, help="Tokens per sequence.")
    add_run_flags(p, pp=[2], figure=ROOT / "docs" / "img" / "pipeline_memory.png")
    args = p.parse_args(argv)
    if min(args.pp) < 2 or min(args.micro_batches) < 1 or args.micro_batch < 1 or args.seq_len < 1:
        p.error(f"--pp {args.pp} needs 2 or more stages; --micro_batches {args.micro_batches}, --micro_batch "
                f"{args.micro_batch} and --seq_len {args.seq_len} 1 or more")  # fmt: skip
    return args


def predicted(case: ModelCase, schedule: str, pp: int, micro_batches: int) -> list[int]:
    """The planner's bytes held for the backward, per stage."""
    config = ShardGPTConfig.from_preset(case.preset, **case.overrides)
    strategy = Strategy.of("single", pp, pp=pp, pp_schedule=schedule)
    stages = predict(config, strategy, "fp32", case.micro_batch, case.seq_len, micro_batches=micro_batches)
    return [stage["held_for_backward"] for stage in stages["stages"]]


def table(rows: list[dict]) -> str:
    """One line per (schedule, P, M); the per-stage figures stage 0 first, separated by slashes."""
    lines = [
        "| schedule | P | M | step (s) | busy share per stage | M/(M+P-1) | MiB held for the backward per stage | "
        "planner (MiB) | measured - planner (bytes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cases = sorted({(r["schedule"], r["pp"], r["micro_batches"]) for r in rows}, key=lambda c: (c[0] != "GPipe", c))
    for schedule, pp, m in cases:
        stages = sorted((r for r in rows if (r["schedule"], r["pp"], r["micro_batches"]) == (schedule, pp, m)),
                        key=lambda r: r["stage"])  # fmt: skip
        busy = " / ".join(f"{r['busy_seconds'] / r['step_seconds']:.2f}" for r in stages)
        held = " / ".join(f"{r['peak_held_bytes'] / MiB:.2f}" for r in stages)
        planned = " / ".join(f"{r['predicted_bytes'] / MiB:.2f}" for r in stages)
        error = " / ".join(str(r["peak_held_bytes"] - r["predicted_bytes"]) for r in stages)
        step = max(r["step_seconds"] for r in stages)
        lines.append(f"| {schedule} | {pp} | {m} | {step:.3f} | {busy} | {m / (m + pp - 1):.2f} | {held} | {planned} | "
                     f"{error} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (busy, held) = plt.subplots(1, 2, figsize=(10, 4))
    ms = sorted({r["micro_batches"] for r in rows})
    for pp in sorted({r["pp"] for r in rows}):
        busy.plot(ms, [m / (m + pp - 1) for m in ms], "k:", label=f"P={pp}: M/(M+P-1)")
        for stage in range(pp):
            for schedule, style in (("GPipe", "o-"), ("1F1B", "s--")):
                points = sorted((r for r in rows if (r["pp"], r["stage"], r["schedule"]) == (pp, stage, schedule)),
                                key=lambda r: r["micro_batches"])  # fmt: skip
                m = [r["micro_batches"] for r in points]
                label = f"{schedule}, P={pp}, stage {stage}"
                (line,) = held.plot(m, [r["peak_held_bytes"] / MiB for r in points], style, label=label)
                held.plot(m, [r["predicted_bytes"] / MiB for r in points], "x", color=line.get_color(), ms=9)
                busy.plot(m, [r["busy_seconds"] / r["step_seconds"] for r in points], style, color=line.get_color(),
                          label=label)  # fmt: skip
    busy.set(xlabel="micro batches M", ylabel="share of the step the stage computed", ylim=(0, 1),
             title="The model's stages: busy share against M")  # fmt: skip
    held.set(xlabel="micro batches M", ylabel="MiB held for the backward (peak)",
             title="Measured (lines) and planned (x)")  # fmt: skip
    save_against_micro_batches(fig, (busy, held), ms, path, legend_size=7)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("num_hidden_layers", "vocab_size") if getattr(args, k) is not None}
    case = ModelCase(args.preset, overrides, args.micro_batch, args.seq_len)

    def measure_pp(pp: int, cases: list[tuple[str, int]]) -> list[dict]:
        rows = measure_model(pp, cases, case, args.steps)
        for r in rows:
            r["predicted_bytes"] = predicted(case, r["schedule"], pp, r["micro_batches"])[r["stage"]]
        return rows

    run_recipe(args, measure_pp, table, plot)


if __name__ == "__main__":
    main()
