"""Tensor parallelism: the bytes each decoder layer saves for its backward per rank as tp grows, with and without
Megatron's sequence parallelism, against the planner and Korthikanti et al. 2022.

    python recipes/measure/tensor_memory.py                    # tiny preset, tp 1, 2, 4, bf16; table and plot
    python recipes/measure/tensor_memory.py --dtype float32 --json runs/tensor_memory.json

Each case runs tp processes (gloo) that split the model by its plan as training does and take one training forward
of the same micro batch (training/measure/tensor_memory.py): the bytes the last decoder layer's forward saved (the first
also holds rotary's cos and sin), and the most bytes any rank held for its backward, beside the planner's figures and
Korthikanti et al.'s for their GPT layer at this hidden size. Model states are not in it (docs/memory.md has them).
"""

from __future__ import annotations

import json
from pathlib import Path

from training.arguments import ArgumentParser
from training.measure.tensor_memory import measure
from training.paths import ROOT
from training.report.figures import save_against_ranks

MiB = 2**20


def parse_args(argv: list[str] | None = None):
    p = ArgumentParser(prog="recipes/measure/tensor_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="A preset whose heads, key-value heads and MLP divide every --tp.")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="Tensor-parallel degrees (ranks each).")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="The weights' and activations' dtype (bfloat16: Korthikanti et al.'s 2-byte accounting).",
    )
    p.add_argument("--json", default=None, help="Also write the rows here.")
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "tensor_memory.png"), help="The figure's path.")
    args = p.parse_args(argv)
    if min(args.tp) < 1 or any(args.block_size % t for t in args.tp):
        p.error(f"--block_size {args.block_size} must be divisible by every --tp {args.tp} (sequence parallelism)")
    return args


def table(rows: list[dict]) -> str:
    lines = [
        "| tp | sequence parallel | per layer, measured (bytes/token) | planner | measured / planned - 1 | "
        "torch's styles (inputs gathered) | Korthikanti et al., GPT layer | held at peak, measured (MiB) | "
        "planner (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["tp"], r["sequence_parallel"])):
        lines.append(
            f"| {r['tp']} | {'yes' if r['sequence_parallel'] else 'no'} | {r['per_token']:,.0f} | "
            f"{r['planned_per_token']:,} | {r['per_token'] / r['planned_per_token'] - 1:+.1e} | "
            f"{r['gathered_per_token']:,} | {r['korthikanti_per_token']:,.0f} | {r['peak_bytes'] / MiB:.2f} | "
            f"{r['planned_peak_bytes'] / MiB:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.figure import Figure  # drawn to a file: no pyplot

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for sequence, label in ((False, "tensor parallel"), (True, "+ sequence parallel")):
        # tp 1 splits nothing: both series start from one process
        points = sorted((r for r in rows if r["sequence_parallel"] == sequence or r["tp"] == 1), key=lambda r: r["tp"])
        if not points:
            continue
        tp = [r["tp"] for r in points]
        (line,) = ax.plot(tp, [r["per_token"] for r in points], "o", label=f"{label}: measured")
        ax.plot(tp, [r["planned_per_token"] for r in points], "-", color=line.get_color(), label=f"{label}: planner")
        ax.plot(tp, [r["korthikanti_per_token"] for r in points], ":", color=line.get_color(),
                label=f"{label}: Korthikanti et al. (GPT layer)")  # fmt: skip
        if sequence:
            ax.plot(tp, [r["gathered_per_token"] for r in points], "--", color=line.get_color(),
                    label=f"{label}: torch's styles (gathered inputs kept)")  # fmt: skip
    title = f"Activations a decoder layer saves per token and rank ({rows[0]['preset']}, {rows[0]['dtype']})"
    save_against_ranks(fig, ax, rows, "bytes per token", title, Path(path), legend_columns=1, key="tp",
                       xlabel="tensor-parallel ranks tp")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for tp in args.tp:
        for sequence in (False, True) if tp > 1 else (False,):
            print(f"measuring tp {tp}{', sequence parallel' if sequence else ''}", flush=True)
            rows.append(measure(tp, sequence, args.preset, args.micro_batch, args.block_size, args.dtype))
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    plot(rows, args.plot)
    print(f"figure: {args.plot}")


if __name__ == "__main__":
    main()
