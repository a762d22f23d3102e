"""Model-state bytes per rank at 1, 2 and 4 ranks for every strategy, plotted against the ZeRO paper's formulas.

    python recipes/measure/memory_scaling.py --output_dir runs/memory_scaling                # launch, measure, plot
    python recipes/measure/memory_scaling.py --output_dir runs/memory_scaling --no_launch    # plot what is there
    python recipes/measure/memory_scaling.py --world_sizes 1 2 4 8 --plot docs/img/memory_scaling.png

Each point is one `accelerate launch --config_file accelerate_configs/<launch>.yaml --num_processes N
recipes/measure/measure_memory.py --preset=tiny ...` in fp32 (see recipes/measure/memory_table.py; more ranks than
cores is fine, only bytes are measured). Plotted per rank (the larger of the ranks), in bytes per parameter: the
measured model states (params + fp32 master + grads + Adam), the paper's formula (16, 8 + 8/N, 4 + 12/N, 16/N)
and the planner's count (recipes/plan_memory.py) for the same launch. One rank runs without a process group:
DDP is then the plain model (no bucket copies) and DeepSpeed/FSDP hold everything on the one rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from training.measure.measured import launch_command, load, paper, planned
from training.paths import ROOT
from training.plan.memory.states import bytes_by_category
from training.report.figures import save_against_ranks

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
PRECISION = "fp32"  # DDP and FSDP keep fp32 states whatever the flag; fp32 compares all five on one footing


def run_launch(cmd: list[str], what: str) -> None:
    """One measured launch, its output captured, one thread per rank; the script ends saying which failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{what} failed:\n{done.stderr[-4000:]}")


def measure(out: Path, preset: str, world_sizes: list[int]) -> None:
    for world in world_sizes:
        for config in STRATEGIES:
            run_dir = out / f"{config}_n{world}"
            print(f"measuring {config} on {world} rank(s) -> {run_dir}", flush=True)
            cmd = launch_command(config, PRECISION, preset, run_dir)
            cmd[2:2] = ["--num_processes", str(world)]  # an accelerate flag: before the script
            run_launch(cmd, f"{config} on {world} ranks")


def points(out: Path, world_sizes: list[int]) -> list[dict]:
    """Per strategy and world size: measured, paper and planner bytes of the rank holding the most."""
    rows = []
    for config in STRATEGIES:
        for world in world_sizes:
            records = load(out / f"{config}_n{world}")
            worst = max(records, key=lambda r: r["model_states"])
            worst = {**worst, "strategy": config}  # one rank is "single" to the strategy check, still DDP-wrapped
            rows.append({"launch": config, "world": world, "psi": worst["psi"], "measured": worst["model_states"],
                         "paper": paper(worst),
                         "planner": sum(bytes_by_category(planned(worst)).values())})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    formulas: dict[tuple, list[str]] = {}  # ZeRO-3 and FSDP share the paper's 16/N: one dashed line for both
    for i, config in enumerate(STRATEGIES):
        mine = [r for r in rows if r["launch"] == config]
        n = [r["world"] for r in mine]
        ax.plot(n, [r["measured"] / r["psi"] for r in mine], "o-", color=f"C{i}", label=f"{config} measured")
        formulas.setdefault(tuple((r["world"], r["paper"] / r["psi"]) for r in mine), []).append(config)
    for line, configs in formulas.items():
        color = f"C{STRATEGIES.index(configs[0])}"
        n, paper_bytes = zip(*line, strict=True)
        ax.plot(n, paper_bytes, "--", color=color, alpha=0.7, label=f"{' = '.join(configs)} paper")
    title = f"Model states per rank, fp32 Adam, Ψ = {rows[0]['psi']:,} (measured: solid, paper: dashed)"
    save_against_ranks(fig, ax, rows, "model-state bytes per parameter per rank", title, path)


def format_table(rows: list[dict]) -> str:
    lines = ["launch | N | measured B/rank | B/Ψ | paper B/Ψ | planner", "---|---|---|---|---|---"]
    for r in rows:
        plan = "=" if r["planner"] == r["measured"] else f"{r['planner']:,}"
        lines.append(f"{r['launch']} | {r['world']} | {r['measured']:,} | {r['measured'] / r['psi']:.3f} | "
                     f"{r['paper'] / r['psi']:.3f} | {plan}")  # fmt: skip
    return "\n".join(lines)


def scaling_parser(doc: str, name: str, world_sizes: list[int]) -> argparse.ArgumentParser:
    """The flags of a scaling measurement `name` (memory_scaling, comm_scaling): where its launches write, the
    ranks measured, the figure's path, and --no_launch to show earlier measurements."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default=f"runs/{name}", help="one folder per launch is written here")
    p.add_argument("--world_sizes", type=int, nargs="+", default=world_sizes)
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / f"{name}.png"))
    p.add_argument("--no_launch", action="store_true", help="only plot and print earlier measurements")
    return p


def report(rows: list[dict], plot_rows, table, path: str) -> None:
    """A scaling measurement's figure at `path` (drawn by `plot_rows`) and its `table`, printed."""
    plot_rows(rows, Path(path))
    print(table(rows))
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    p = scaling_parser(__doc__, "memory_scaling", [1, 2, 4])
    p.add_argument("--preset", default="tiny")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    if not args.no_launch:
        measure(out, args.preset, args.world_sizes)
    report(points(out, args.world_sizes), plot, format_table, args.plot)


if __name__ == "__main__":
    main()
