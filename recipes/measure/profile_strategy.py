"""Profile a few training steps under any strategy: where a step's time goes, per rank, with torch.profiler.

Launched exactly like `recipes/train.py` (the launcher's config picks the strategy), on random tokens through
the real loader (the setup of `recipes/measure/measure_memory.py`):

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/measure/profile_strategy.py \\
        --preset tiny --per_device_train_batch_size 4 --block_size 256 --output_dir runs/profile/zero3
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/measure/profile_strategy.py \\
        --preset tiny --per_device_train_batch_size 4 --block_size 256 --output_dir runs/profile/ddp

--max_steps steps are run (default here: 2 warm-up steps, then the profiled ones); each rank writes
`trace_rank{R}.json` (open it in https://ui.perfetto.dev or chrome://tracing) and `profile_rank{R}.txt`, the
operators and Python functions by total time, and rank 0 prints the step times and the top of its table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from training.core.ranks import run_rank
from training.measure.synthetic import synthetic_run

WARMUP = 2  # the first steps create Adam's state and fill DeepSpeed's and FSDP's buffers


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--max_steps") for a in argv):
        argv.append("--max_steps=5")
    run = synthetic_run(argv)
    rank = run.accelerator.process_index
    steps = run.cfg.max_steps
    for step in range(1, WARMUP + 1):
        run.step(step)
    times = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=False, record_shapes=False) as prof:
        for step in range(WARMUP + 1, WARMUP + steps + 1):
            start = time.perf_counter()
            with record_function(f"train_step {step}"):
                run.step(step)
            times.append(time.perf_counter() - start)
    out = Path(run.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Every rank writes its own trace (the only per-rank action; the steps above are collectives on every rank).
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    (out / f"profile_rank{rank}.txt").write_text(f"step times (s): {times}\n{table}\n")
    if rank == 0:
        print(f"{run.strategy.name}: step times (s) {[round(t, 3) for t in times]}, min {min(times):.3f}")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    run.accelerator.wait_for_everyone()  # collective: nobody tears the group down while another still steps
    run.accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
