"""The pipeline bubble and the activations a schedule holds, measured on stages of fixed cost and on the model's own.

Each stage's forward takes `seconds` and its backward twice that (a sleep: the measurement needs no compute, so
more ranks than cores is fine), and counts the micro batches whose activations it holds: one more at each
forward, one fewer at each backward. A step of M micro batches over P stages keeps every stage busy for
M x 3 `seconds`; the rest of the step is the bubble. GPipe's (Huang et al. 2019) and 1F1B's (PipeDream-Flush,
Narayanan et al. 2021) bubble is (P - 1) / (M + P - 1) of the step; GPipe holds all M micro batches' activations at
its peak, 1F1B at most P (stage s: P - s).

The model's own stages (`measure_model`: the pipeline runtime's `build_pipeline`, one stage per rank) are timed
with the training's busy clock and counted in bytes: the peak of what a stage holds for its backward, autograd's
saved tensors and the outputs the stage keeps (training/measure/saved.py), which the planner predicts
(training/plan/memory/stages.stage_held).

The ranks run torch.distributed.pipelining's own schedules over gloo (collective: the point-to-point sends of
activations and gradients between neighbouring stages, and the barriers that time a step).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue as queue_module
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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

    def __init__(self, seconds: float, held: InFlight | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.seconds = seconds
        self.held = held if held is not None else InFlight()  # shared by the stages of one rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FixedCost.apply(x * self.weight, self.seconds, self.held)


def theory(pp: int, micro_batches: int) -> float:
    """The bubble's share of a GPipe or 1F1B step: (P - 1) / (M + P - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


SCHEDULES = ("GPipe", "1F1B")  # the papers' two, whose bubble is the same and whose activations are not


def schedule_cases(pp: int, micro_batches: list[int]) -> list[tuple[str, int]]:
    """Every (schedule, M) torch runs on `pp` stages: 1F1B needs at least one micro batch per stage."""
    return [(s, m) for s in SCHEDULES for m in micro_batches if s != "1F1B" or m >= pp]


def add_run_flags(p, pp: list[int], figure: Path) -> None:
    """The flags both measurement scripts take: the stages and micro batches measured, the timed steps, where the
    rows and the figure go, or an earlier run's rows to show instead."""
    p.add_argument("--pp", type=int, nargs="+", default=pp, help="Pipeline stages (one process each).")
    p.add_argument("--micro_batches", type=int, nargs="+", default=[2, 4, 8], help="Micro batches per step.")
    p.add_argument("--steps", type=int, default=3, help="Timed steps per case (the fastest is kept).")
    p.add_argument("--json", default=None, help="Also write the rows here.")
    p.add_argument(
        "--rows", default=None, help="Measure nothing: the table and plot of these rows (an earlier --json)."
    )
    p.add_argument("--plot", default=str(figure), help="The figure's path.")


def run_recipe(args, measure_pp, table, plot) -> None:
    """A measurement script's body: the rows of `args.rows` (an earlier --json), or each P of `args.pp` measured
    over `args.micro_batches` by `measure_pp(pp, cases)`; then their `table` printed, --json and the plot written."""
    rows = json.loads(Path(args.rows).read_text()) if args.rows else []
    for pp in [] if args.rows else args.pp:
        cases = schedule_cases(pp, args.micro_batches)
        print(f"measuring P={pp}: {len(cases)} cases", flush=True)
        rows += measure_pp(pp, cases)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    plot(rows, args.plot)
    print(f"figure: {args.plot}")


def save_against_micro_batches(fig, axes, micro_batches: list[int], path: str, legend_size: int = 8) -> None:
    """`fig`, whose `axes` plot against M: a log-2 axis with a tick at each of `micro_batches`, a grid and legends;
    written to `path`."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(micro_batches, [str(m) for m in micro_batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _rank(rank: int, pp: int, store: str, cases: list[tuple[str, int]], seconds: float, steps: int, queue) -> None:
    from training.axes.pipeline.schedules import stage_ranks, stages_per_rank

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=pp)
    for schedule, m in cases:
        per_rank = stages_per_rank(schedule, None)  # a multi-stage schedule's 2 stages a rank, placed as torch does
        owners = stage_ranks(schedule, pp, per_rank)
        held = InFlight()  # what the rank's stages hold together: a micro batch in a stage of it at each forward
        stages = [PipelineStage(FixedCostStage(seconds, held), s, len(owners), torch.device("cpu"))
                  for s, owner in enumerate(owners) if owner == rank]  # fmt: skip
        run = get_schedule_class(schedule)(stages if per_rank > 1 else stages[0], n_microbatches=m,
                                           loss_fn=lambda out, _: out.sum())  # fmt: skip
        x = torch.ones(m, WIDTH)
        times = []
        for i in range(steps + 1):  # the first step infers shapes: not timed
            dist.barrier()  # collective: every stage starts the step together
            t0 = time.perf_counter()
            run.step(*((x,) if owners[0] == rank else ()), target=x if owners[-1] == rank else None)
            dist.barrier()  # collective: the step ends when its last stage is done
            if i:
                times.append(time.perf_counter() - t0)
            else:  # the shape inference's forward holds nothing for a backward
                held.now = held.peak = 0
        step = min(times)  # the least disturbed step: the others only add noise from this machine
        queue.put({"schedule": schedule, "pp": pp, "micro_batches": m, "stage": rank, "step_seconds": step,
                   "busy_seconds": m * 3 * seconds * per_rank, "peak_micro_batches_held": held.peak})  # fmt: skip
    dist.destroy_process_group()


def measure(pp: int, cases: list[tuple[str, int]], seconds: float = 0.05, steps: int = 3) -> list[dict]:
    """Each (schedule, micro batches) of `cases` on `pp` ranks of fixed-cost stages, one process per rank (two stages
    a rank under a multi-stage schedule): per rank, the step time (the fastest of `steps`), its busy fraction and the
    most micro batches its stages held at once (a micro batch in two of its stages counts twice)."""
    return _run_ranks(_rank, pp, len(cases), (cases, seconds, steps))


def _run_ranks(target, pp: int, records: int, args: tuple, timeout: float = 600) -> list[dict]:
    """`target(rank, pp, store, *args, queue)` in `pp` spawned processes; the `records` each process puts, sorted.
    A rank that fails or outlives `timeout` seconds fails the measurement, its peers stopped."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        processes = [ctx.Process(target=target, args=(r, pp, store, *args, queue)) for r in range(pp)]
        for p in processes:
            p.start()
        got, deadline = [], time.monotonic() + timeout
        while len(got) < pp * records and time.monotonic() < deadline:
            if any(p.exitcode for p in processes):  # a rank failed: its peers would wait for it forever
                break
            with contextlib.suppress(queue_module.Empty):
                got.append(queue.get(timeout=1))
        for p in processes:
            p.join(timeout=60 if len(got) == pp * records else 0)
            if p.is_alive():
                p.kill()
                p.join()
    if len(got) < pp * records or any(p.exitcode for p in processes):
        raise RuntimeError(f"a stage's process failed or hung: exit codes {[p.exitcode for p in processes]}")
    return sorted(got, key=lambda r: (r["schedule"], r["micro_batches"], r["stage"], r.get("rank", 0)))


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


# ---------------------------------------------------------------------------------------------- the model's stages


@dataclass
class ModelCase:
    """The model whose stages are measured, and the micro batch each stage runs."""

    preset: str = "debug"
    overrides: dict = field(default_factory=dict)  # config fields over the preset's (num_hidden_layers=...)
    micro_batch: int = 1  # sequences per micro batch
    seq_len: int = 64


def _model_rank(rank: int, world: int, store: str, cases: list[tuple[str, int]], model: ModelCase, steps: int,
                tp: int, queue) -> None:  # fmt: skip
    from model import ShardGPTConfig, ShardGPTForCausalLM
    from training.axes.pipeline.runtime import build_pipeline
    from training.measure.saved import HeldBytes
    from training.strategy import Strategy

    torch.set_num_threads(1)  # one core per rank: P = 2 ranks on 2 cores time honestly
    pp = world // tp
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = ShardGPTConfig.from_preset(model.preset, **model.overrides)
    for schedule, m in cases:
        torch.manual_seed(0)  # every rank builds one process's model, then keeps its stage
        net = ShardGPTForCausalLM(config).train()
        # one stage per tp ranks (its layers split over them), no data parallelism
        strategy = Strategy.of("single", world, pp=pp, tp=tp, pp_schedule=schedule)
        pipeline = build_pipeline(net, strategy, rank, m, torch.device("cpu"), None)  # collective
        ids = torch.randint(0, config.vocab_size, (m * model.micro_batch, model.seq_len))  # (M * micro, T)
        pipeline.loss_scale = 1 / ids.numel()
        held = HeldBytes(net.parameters())
        stage = pipeline.pp_rank
        if stage < pp - 1:  # the stage keeps its output for the micro batch's backward
            pipeline.stages[0].register_forward_hook(functools.partial(_keep_output, held))
        runs = []
        for i in range(steps + 1):  # the first step infers shapes and allocates the stage's buffers: not kept
            dist.barrier()  # collective: every stage starts the step together
            held.reset()
            t0 = time.perf_counter()
            with held.saving():  # collective: the schedule's point-to-point sends (and the stages' tp collectives)
                pipeline.schedule.step(*((ids,) if stage == 0 else ()), target=ids, losses=[], shift_labels=ids)
            t1 = time.perf_counter()
            dist.barrier()  # collective: the step ends when its last stage is done
            busy = pipeline.clock.busy_fraction(t0, t1) * (t1 - t0)
            net.zero_grad(set_to_none=True)
            if i:
                runs.append((time.perf_counter() - t0, busy, held.peak, held.now))
        step, busy, peak, left = min(runs)  # the least disturbed step: the others only add noise from this machine
        queue.put({"schedule": schedule, "pp": pp, "tp": tp, "micro_batches": m, "stage": stage, "rank": rank,
                   "step_seconds": step, "busy_seconds": busy, "peak_held_bytes": peak,
                   "held_after_step": left})  # fmt: skip
    dist.destroy_process_group()


def _keep_output(held, _module: nn.Module, _args, output: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # a forward with a backward to come (not the schedule's shape inference)
        held.keep_until_freed(output)


def measure_model(pp: int, cases: list[tuple[str, int]], model: ModelCase, steps: int = 3, timeout: float = 600,
                  tp: int = 1) -> list[dict]:  # fmt: skip
    """Each (schedule, micro batches) of `cases` on `pp` stages of `model`, one process per stage, or `tp` whose
    stage's layers the model's plan splits (with sequence parallelism): per rank, the step time (the fastest of
    `steps`), the time its stage computed in that step (forward and backward), and the most bytes it held for its
    backward at once (and what it still held after the step: nothing)."""
    return _run_ranks(_model_rank, pp * tp, len(cases), (cases, model, steps, tp), timeout)
