"""The pipeline bubble and the activations held, measured on stages of fixed cost against the papers' formulas.

    python recipes/measure/pipeline_bubble.py                         # P in {2, 4}, M in {2, 4, 8}: table and plot
    python recipes/measure/pipeline_bubble.py --pp 2 4 8 --micro_batches 4 8 16 32 --plot /tmp/bubble.png
    python recipes/measure/pipeline_bubble.py --rows rows.json       # table and plot of an earlier run's --json

Each stage is one process (gloo) whose forward sleeps --seconds and backward twice that (training/measure/bubble.py),
run by torch.distributed.pipelining's GPipe and 1F1B. The bubble is the share of a step no stage works: 1 - M x 3
seconds / step, beside (P - 1) / (M + P - 1); the activations held are the most micro batches any stage held at once
(GPipe: all M; 1F1B: at most P). More processes than cores is fine: the stages sleep.
"""

from __future__ import annotations

from training.arguments import ArgumentParser
from training.measure.bubble import add_run_flags, measure, run_recipe, save_against_micro_batches, summarize
from training.paths import ROOT


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="recipes/measure/pipeline_bubble.py", description=__doc__.split("\n\n")[0])
    add_run_flags(p, pp=[2, 4], figure=ROOT / "docs" / "img" / "pipeline_bubble.png")
    p.add_argument("--seconds", type=float, default=0.1, help="A stage's forward time; its backward takes twice.")
    args = p.parse_args(argv)
    if min(args.pp) < 2 or min(args.micro_batches) < 1 or args.seconds <= 0:
        p.error(f"--pp {args.pp} needs 2 or more stages, --micro_batches {args.micro_batches} 1 or more, --seconds > 0")
    return args


def table(rows: list[dict]) -> str:
    lines = [
        "| schedule | P | M | step (s) | bubble measured | (P-1)/(M+P-1) | error | micro batches held (peak) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["schedule"] != "GPipe", r["pp"], r["micro_batches"])):
        error = r["bubble"] / r["bubble_theory"] - 1
        lines.append(
            f"| {r['schedule']} | {r['pp']} | {r['micro_batches']} | {r['step_seconds']:.3f} | {r['bubble']:.3f} | "
            f"{r['bubble_theory']:.3f} | {error:+.1%} | {r['peak_micro_batches_held']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bubble, held) = plt.subplots(1, 2, figsize=(10, 4))
    for pp in sorted({r["pp"] for r in rows}):
        gpipe = sorted(
            (r for r in rows if r["pp"] == pp and r["schedule"] == "GPipe"), key=lambda r: r["micro_batches"]
        )
        m = [r["micro_batches"] for r in gpipe]
        (line,) = bubble.plot(m, [r["bubble_theory"] for r in gpipe], label=f"P={pp}: (P-1)/(M+P-1)")
        bubble.plot(m, [r["bubble"] for r in gpipe], "o", color=line.get_color(), label=f"P={pp}: measured (GPipe)")
        for schedule, style in (("GPipe", "o-"), ("1F1B", "s--")):
            points = sorted((r for r in rows if r["pp"] == pp and r["schedule"] == schedule),
                            key=lambda r: r["micro_batches"])  # fmt: skip
            held.plot([r["micro_batches"] for r in points], [r["peak_micro_batches_held"] for r in points], style,
                      color=line.get_color(), label=f"{schedule}, P={pp}")  # fmt: skip
    bubble.set(xlabel="micro batches M", ylabel="bubble (share of the step)", title="GPipe's bubble shrinks with M")
    held.set(xlabel="micro batches M", ylabel="micro batches' activations held (peak)",
             title="GPipe holds M, 1F1B at most P")  # fmt: skip
    save_against_micro_batches(fig, (bubble, held), sorted({r["micro_batches"] for r in rows}), path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_recipe(args, lambda pp, cases: summarize(measure(pp, cases, args.seconds, args.steps)), table, plot)


if __name__ == "__main__":
    main()
