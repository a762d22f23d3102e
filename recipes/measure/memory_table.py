"""Measure model-state memory under every strategy and print it against the ZeRO paper and the planner.

    python recipes/measure/memory_table.py --output_dir runs/memory                 # launch, measure, print
    python recipes/measure/memory_table.py --output_dir runs/memory --no_launch     # print what is there

Each row is one `accelerate launch --config_file accelerate_configs/<launch>.yaml recipes/measure/measure_memory.py`
on 2 ranks (see that script for what is counted and when). Columns, per rank (the larger of the ranks):
bytes per parameter of params, fp32 master copies, gradients and optimizer states (Adam's moments and step
counters) as measured; their total in bytes; the ZeRO paper's figure; what `recipes/plan_memory.py`
predicts (`=` when it is the measured figure to the byte); and the measured minus the paper's, term by term.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from training.measure.measured import LAUNCHES, format_table, launch_command, rows
from training.paths import ROOT


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="runs/memory", help="one folder per launch is written here")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--no_launch", action="store_true", help="only print the table of earlier measurements")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    if not args.no_launch:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for config, precision in LAUNCHES:
            run_dir = out / f"{precision}_{config}"
            print(f"measuring {config} {precision} -> {run_dir}", flush=True)
            done = subprocess.run(launch_command(config, precision, args.preset, run_dir), cwd=ROOT, env=env,
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode:
                sys.exit(f"{config} {precision} failed:\n{done.stderr[-4000:]}")
    table = rows(out)
    r = table[0]["record"]
    print(f"{r['preset']}: psi = {r['psi']:,} parameters, {r['world_size']} ranks; bytes per parameter per rank")
    print(format_table(table))


if __name__ == "__main__":
    main()
