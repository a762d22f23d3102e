"""The pipeline bubble and the activations a schedule holds, measured on stages of fixed cost.

Each stage's forward takes `seconds` and its backward twice that (a sleep: the measurement needs no compute, so
more ranks than cores is fine), and counts the micro batches whose activations it holds: one more at each
forward, one fewer at each backward. A step of M micro batches over P stages keeps every stage busy for
M x 3 `seconds`; the rest of the step is the bubble. GPipe's (Huang et al. 2019) and 1F1B's (PipeDream-Flush,
Narayanan et al. 2021) bubble is (P - 1) / (M + P - 1) of the step; GPipe holds all M micro batches' activations at
its peak, 1F1B at most P (stage s: P - s).

The ranks run torch.distributed.pipelining's own schedules over gloo (collective: the point-to-point sends of
activations and gradients between neighbouring stages, and the barriers that time a step).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

WIDTH = 16  # the activation's size: small, so that sending it costs next to nothing beside `seconds`


@dataclass
class InFlight:
    """The micro batches whose activations a stage holds, now and at most."""

    now: int = 0
    peak: int = 0


class _FixedCost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float, held: InFlight) -> torch.Tensor:
        time.sleep(seconds)
        held.now += 1
        held.peak = max(held.peak, held.now)
        ctx.seconds, ctx.held = seconds, held
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)
        ctx.held.now -= 1
        return grad, None, None


class FixedCostStage(nn.Module):
    """A stage whose forward takes `seconds` and backward 2 x `seconds`, whatever its input."""

    def __init__(self, seconds: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.seconds = seconds
        self.held = InFlight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FixedCost.apply(x * self.weight, self.seconds, self.held)


def theory(pp: int, micro_batches: int) -> float:
    """The bubble's share of a GPipe or 1F1B step: (P - 1) / (M + P - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def _rank(rank: int, pp: int, store: str, cases: list[tuple[str, int]], seconds: float, steps: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=pp)
    for schedule, m in cases:
        stage = FixedCostStage(seconds)
        pipeline = PipelineStage(stage, rank, pp, torch.device("cpu"))
        run = get_schedule_class(schedule)(pipeline, n_microbatches=m, loss_fn=lambda out, _: out.sum())
        x = torch.ones(m, WIDTH)
        times = []
        for i in range(steps + 1):  # the first step infers shapes: not timed
            dist.barrier()  # collective: every stage starts the step together
            t0 = time.perf_counter()
            run.step(*((x,) if rank == 0 else ()), target=x if rank == pp - 1 else None)
            dist.barrier()  # collective: the step ends when its last stage is done
            if i:
                times.append(time.perf_counter() - t0)
            else:  # the shape inference's forward holds nothing for a backward
                stage.held.now = stage.held.peak = 0
        step = min(times)  # the least disturbed step: the others only add noise from this machine
        queue.put({"schedule": schedule, "pp": pp, "micro_batches": m, "stage": rank, "step_seconds": step,
                   "busy_seconds": m * 3 * seconds, "peak_micro_batches_held": stage.held.peak})  # fmt: skip
    dist.destroy_process_group()


def measure(pp: int, cases: list[tuple[str, int]], seconds: float = 0.05, steps: int = 3) -> list[dict]:
    """Each (schedule, micro batches) of `cases` on `pp` fixed-cost stages, one process per stage: per stage, the
    step time (the fastest of `steps`), its busy fraction and the most micro batches it held at once."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        processes = [
            ctx.Process(target=_rank, args=(r, pp, os.path.join(tmp, "store"), cases, seconds, steps, queue))
            for r in range(pp)
        ]
        for p in processes:
            p.start()
        records = [queue.get(timeout=600) for _ in range(pp * len(cases))]
        for p in processes:
            p.join(timeout=60)
    if any(p.exitcode for p in processes):
        raise RuntimeError(f"a stage's process failed: exit codes {[p.exitcode for p in processes]}")
    return sorted(records, key=lambda r: (r["schedule"], r["micro_batches"], r["stage"]))


def summarize(records: list[dict]) -> list[dict]:
    """One row per (schedule, pp, micro batches): the measured bubble, 1 - busy / step (the step of the slowest
    stage), beside the theory's, and the most micro batches any stage held at once (stage 0's, in both schedules)."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["schedule"], r["pp"], r["micro_batches"])
        row = rows.setdefault(key, {"schedule": key[0], "pp": key[1], "micro_batches": key[2], "step_seconds": 0.0,
                                    "busy_seconds": r["busy_seconds"], "peak_micro_batches_held": 0})  # fmt: skip
        row["step_seconds"] = max(row["step_seconds"], r["step_seconds"])
        row["peak_micro_batches_held"] = max(row["peak_micro_batches_held"], r["peak_micro_batches_held"])
    for row in rows.values():
        row["bubble"] = 1 - row["busy_seconds"] / row["step_seconds"]
        row["bubble_theory"] = theory(row["pp"], row["micro_batches"])
    return list(rows.values())
