"""The pipeline bubble and the activations held, measured on stages of fixed cost against the papers' formulas.

    python recipes/measure/pipeline_bubble.py                         # P in {2, 4}, M in {2, 4, 8}: table and plot
    python recipes/measure/pipeline_bubble.py --pp 2 4 8 --micro_batches 4 8 16 32 --plot /tmp/bubble.png
    python recipes/measure/pipeline_bubble.py --rows rows.json       # table and plot of an earlier run's --json

Each stage is one process (gloo) whose forward sleeps --seconds and backward twice that (training/bubble.py), run by
torch.distributed.pipelining's GPipe and 1F1B. The bubble is the share of a step no stage works: 1 - M x 3 seconds /
step, beside (P - 1) / (M + P - 1); the activations held are the most micro batches any stage held at once (GPipe:
all M; 1F1B: at most P). More processes than cores is fine: the stages sleep.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.arguments import ArgumentParser
from training.bubble import measure, summarize
from training.paths import ROOT

SCHEDULES = ("GPipe", "1F1B")


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="recipes/measure/pipeline_bubble.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="Pipeline stages (one process each).")
    p.add_argument("--micro_batches", type=int, nargs="+", default=[2, 4, 8], help="Micro batches per step.")
    p.add_argument("--seconds", type=float, default=0.1, help="A stage's forward time; its backward takes twice.")
    p.add_argument("--steps", type=int, default=3, help="Timed steps per case (the fastest is kept).")
    p.add_argument("--json", default=None, help="Also write the rows here.")
    p.add_argument(
        "--rows", default=None, help="Measure nothing: the table and plot of these rows (an earlier --json)."
    )
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "pipeline_bubble.png"), help="The figure's path.")
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
    for ax in (bubble, held):
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({r["micro_batches"] for r in rows}), [str(m) for m in sorted({r["micro_batches"] for r in rows})]
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = json.loads(Path(args.rows).read_text()) if args.rows else []
    for pp in [] if args.rows else args.pp:
        # 1F1B needs at least one micro batch per stage (torch's Schedule1F1B)
        cases = [(s, m) for s in SCHEDULES for m in args.micro_batches if s == "GPipe" or m >= pp]
        print(f"measuring P={pp}: {len(cases)} cases", flush=True)
        rows += summarize(measure(pp, cases, args.seconds, args.steps))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    plot(rows, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
