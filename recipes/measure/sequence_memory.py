"""Ulysses sequence parallelism: the bytes a rank holds for its backward as sp grows, against the planner.

    python recipes/measure/sequence_memory.py                          # debug preset, sp 1, 2, 4; table and plot
    python recipes/measure/sequence_memory.py --preset tiny --block_sizes 1024 4096 --budget_mb 512

Each case runs sp processes (gloo) that register DeepSpeed's Ulysses attention as training does and take one
training forward of the same micro batch, each on its slice of the positions (training/measure/ulysses.py): the most
bytes any rank held for its backward, beside what the planner plans for a rank of seq_len / sp positions. Then the
longest block (doubling from the smallest) whose measured bytes fit --budget_mb, at sp 1 and sp 2. Model states do
not depend on sp (ZeRO partitions over every rank): this is the part of a rank's memory that sp divides.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.arguments import ArgumentParser
from training.measure.ulysses import measure
from training.paths import ROOT

MiB = 2**20


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="recipes/measure/sequence_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="Sequence-parallel degrees (ranks each).")
    p.add_argument("--block_sizes", type=int, nargs="+", default=[1024, 4096], help="Sequence lengths measured.")
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--budget_mb", type=float, default=64.0, help="The bytes held for the backward that must fit.")
    p.add_argument("--json", default=None, help="Also write the rows here.")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "sequence_memory.png"), help="The figure's path.")
    args = p.parse_args(argv)
    if min(args.sp) < 1 or min(args.block_sizes) < 1 or any(b % s for b in args.block_sizes for s in args.sp):
        p.error(f"--block_sizes {args.block_sizes} must be divisible by every --sp {args.sp}")
    return args


def longest_block(sp: int, args) -> tuple[int, list[dict]]:
    """The longest block, doubling from the smallest measured, whose bytes held fit the budget on each rank."""
    block, rows, fits = min(args.block_sizes), [], 0
    while True:
        row = measure(sp, args.preset, args.micro_batch, block)
        rows.append(row)
        if row["held_bytes"] > args.budget_mb * MiB:
            return fits, rows
        fits, block = block, 2 * block


def table(rows: list[dict]) -> str:
    lines = [
        "| block | sp | held per rank (MiB) | planner (MiB) | measured / planned - 1 | vs sp 1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["block_size"], r["sp"])):
        base = next((x["held_bytes"] for x in rows if x["block_size"] == r["block_size"] and x["sp"] == 1), None)
        ratio = f"{r['held_bytes'] / base:.3f}" if base else "-"
        lines.append(
            f"| {r['block_size']} | {r['sp']} | {r['held_bytes'] / MiB:.2f} | {r['planned_bytes'] / MiB:.2f} | "
            f"{r['error']:+.1e} | {ratio} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for block in sorted({r["block_size"] for r in rows}):
        points = sorted((r for r in rows if r["block_size"] == block), key=lambda r: r["sp"])
        sp = [r["sp"] for r in points]
        (line,) = ax.plot(sp, [r["held_bytes"] / MiB for r in points], "o", label=f"T={block}: measured")
        ax.plot(
            sp, [r["planned_bytes"] / MiB for r in points], "--", color=line.get_color(), label=f"T={block}: planner"
        )
    ax.set(xscale="log", yscale="log", xlabel="sequence-parallel ranks sp",
           ylabel="bytes held for the backward per rank (MiB)",
           title="Ulysses: a rank holds 1/sp of a sequence's activations")  # fmt: skip
    ax.set_xticks(sorted({r["sp"] for r in rows}), [str(s) for s in sorted({r["sp"] for r in rows})])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for block in args.block_sizes:
        for sp in args.sp:
            print(f"measuring block {block}, sp {sp}", flush=True)
            rows.append(measure(sp, args.preset, args.micro_batch, block))
    print(table(rows))
    longest = {}
    for sp in (1, 2):
        longest[sp], _ = longest_block(sp, args)
        print(f"longest block held within {args.budget_mb:g} MiB per rank at sp {sp}: {longest[sp]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "longest": longest}, indent=1))
    plot(rows, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
