"""Launched by tests/training/test_pipeline.py with torchrun: a few AdamW steps of a 4-layer `debug` model under each
pipeline schedule asked for (training/axes/pipeline/), and, on rank 0, the same steps in one process on the whole
model; rank 0 writes both runs' losses and gradient norms to OUT/<spec>.json.

    torchrun --nproc_per_node 4 tests/training/pipeline_worker.py PP SCHEDULE[:STAGES_PER_RANK[:DATA_PARALLEL]] ... \
        --output_dir OUT

DATA_PARALLEL, over the world / PP pipelines: ddp (the default: an all-reduce of whole copies) or fsdp (FSDP2
shards each stage over the data-parallel ranks); or tp: the world / PP ranks of a stage split its layers by the
model's plan with sequence parallelism (training/axes/tensor/plan.split_stage), one pipeline; or fsdp-tp: pairs of
ranks split each stage's layers so, and FSDP2 shards the slices over the world / (2 PP) pairs (FSDP2 x TP x PP).

Every rank also writes OUT/<spec>-states-rank<R>.json: the bytes of the parameters, gradients and Adam's states its
stages hold as the optimizer steps at step 2 (training/measure/ledger.py's walk), which the memory planner
predicts per stage; under FSDP2 also OUT/<spec>-gathered-rank<R>.json: what its stages hold gathered, and their
gradients accumulated whole, as step 2's last backward ends.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.adamw import param_groups
from training.axes.pipeline.runtime import build_pipeline, fsdp2_stages
from training.core.gradnorm import clip_, grad_norm
from training.core.ranks import run_rank
from training.loop.step import pipelined_step
from training.measure.ledger import Ledger, walk_fsdp, walk_fsdp_gathered
from training.strategy import Strategy

STEPS, MICRO, BLOCK, LAYERS = 3, 2, 32, 4
MEASURED_STEP = 2  # Adam's moments exist from the first update on
MAX_GRAD_NORM = 0.5  # below the step-1 norm: clipping is active


def model() -> ShardGPTForCausalLM:
    torch.manual_seed(0)
    config = ShardGPTConfig.from_preset("debug", num_hidden_layers=LAYERS, vocab_size=256)
    return ShardGPTForCausalLM(config)


def adamw(net: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(net, 0.1, False), lr=1e-2, betas=(0.9, 0.95))


def global_batches(micro_batches: int, data_parallel: int) -> list[torch.Tensor]:
    """Each step's global batch, (M * dp * micro, BLOCK + 1) tokens, with a few ignored targets."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (micro_batches * data_parallel * MICRO, BLOCK + 1), generator=g)
        tokens[:, -3:] = -100  # targets only; the inputs are the first BLOCK tokens
        batches.append(tokens)
    return batches


def micro_batches_of(tokens: torch.Tensor, micro_batches: int, data_parallel: int, dp_rank: int) -> list[dict]:
    """The loader's split (data/loader.py): micro batch m of data-parallel rank d is rows [m, d] of the batch."""
    inputs, labels = tokens[:, :-1].clamp(min=0), tokens[:, 1:]
    count = (labels != -100).sum()
    inputs, labels = (t.reshape(micro_batches, data_parallel, MICRO, -1)[:, dp_rank] for t in (inputs, labels))
    pairs = zip(inputs, labels, strict=True)
    return [{"input_ids": i, "shift_labels": lab, "num_items_in_batch": count} for i, lab in pairs]


def one_process(micro_batches: int, data_parallel: int) -> dict:
    """The reference: the whole model in one process, token-weighted accumulation, clipped, AdamW."""
    net = model().train()
    optimizer = adamw(net)
    losses, norms = [], []
    for tokens in global_batches(micro_batches, data_parallel):
        total = 0.0
        for micro in micro_batches_of(tokens, micro_batches * data_parallel, 1, 0):
            loss = net(**micro).loss
            loss.backward()
            total += loss.item()
        norm = grad_norm(
            list(net.parameters()), torch.device("cpu")
        )  # one process's: float64 (training/core/gradnorm.py)
        clip_(list(net.parameters()), MAX_GRAD_NORM, norm)
        norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "grad_norms": norms, "weights": {k: v.clone() for k, v in net.state_dict().items()}}


def snapshot_states(pipeline, optimizer, path: Path, step: list[int]) -> None:
    """At MEASURED_STEP, as the optimizer is about to step (the gradients reduced, clipped and whole), write what this
    rank's stages hold to `path`: every rank its own file."""

    def hook(*_):
        if step[0] != MEASURED_STEP:
            return
        ledger = Ledger()
        walk_fsdp(ledger, pipeline.model, optimizer)
        record = {**ledger.report(), "stages": pipeline.local_stages, "rank": dist.get_rank()}
        path.write_text(json.dumps(record, indent=1))

    optimizer.register_step_pre_hook(hook)


def snapshot_whole_gradients(pipeline, path: Path, step: list[int]) -> None:
    """At MEASURED_STEP, as the schedule ends and before the split parameters' gradients are laid out as their
    parameters (`Pipeline.settle_split_gradients`, without FSDP2), write to `path` the bytes this rank's gradients
    hold beyond its slices: what comes back whole from torch's backward (the embedding's rows)."""
    settle = pipeline.settle_split_gradients

    def hook():
        if step[0] == MEASURED_STEP:
            beyond = sum((p.grad.to_local().numel() - p.to_local().numel()) * p.grad.element_size()
                         for p in pipeline.model.parameters()
                         if isinstance(p.grad, DTensor) and p.grad.placements != p.placements)  # fmt: skip
            path.write_text(json.dumps({"beyond_slices": beyond}))
        settle()

    pipeline.settle_split_gradients = hook


def snapshot_gathered(pipeline, path: Path, step: list[int]) -> None:
    """At MEASURED_STEP, as torch's pipelining turns FSDP2's gradient sync back on after the step's last backward
    (`PipelineStage.perform_reduce_grad`, before the reduce-scatters), write the bytes of each of this rank's stages'
    units still gathered and of their gradients accumulated whole to `path`: what the memory planner counts at a
    stage's peak."""
    stages: dict[int, dict] = {}
    for index, stage in zip(pipeline.local_stages, pipeline.stages, strict=True):
        turn_on = stage.set_requires_gradient_sync  # FSDP2's public setter, shadowed on this module only

        def hook(requires, *args, _index=index, _stage=stage, _turn_on=turn_on, **kwargs):
            if requires and step[0] == MEASURED_STEP:
                ledger = Ledger()
                walk_fsdp_gathered(ledger, _stage)
                stages[_index] = ledger.report()["detail"]
                path.write_text(json.dumps(stages, indent=1))
            return _turn_on(requires, *args, **kwargs)

        stage.set_requires_gradient_sync = hook


def degrees(data_parallel: str, world: int, pp: int) -> tuple[str, int, int]:
    """The strategy family, the tensor-parallel and the data-parallel degree of a DATA_PARALLEL mode."""
    tp = {"tp": world // pp, "fsdp-tp": 2}.get(data_parallel, 1)
    family = {"fsdp": "fsdp", "fsdp-tp": "fsdp", "tp": "single"}.get(data_parallel, "ddp")
    return family, tp, world // pp // tp


def pipelined(schedule: str, per_rank: int, pp: int, data_parallel: str, micro_batches: int,
              states: Path) -> dict:  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    family, tp, dp = degrees(data_parallel, world, pp)
    net = model().train()
    shard = fsdp2_stages(MixedPrecisionPolicy(), True, "cpu") if family == "fsdp" else None
    strategy = Strategy.of(family, world, pp=pp, tp=tp, pp_schedule=schedule, pp_stages_per_rank=per_rank,
                           **({"fsdp_version": 2} if family == "fsdp" else {}))  # fmt: skip
    pipeline = build_pipeline(net, strategy, rank, micro_batches, torch.device("cpu"), shard)
    optimizer = adamw(net)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    losses, norms, at = [], [], [0]
    snapshot_states(pipeline, optimizer, states, at)
    if shard is not None:
        snapshot_gathered(pipeline, states.with_name(states.name.replace("-states-", "-gathered-")), at)
    elif tp > 1:
        snapshot_whole_gradients(pipeline, states.with_name(states.name.replace("-states-", "-whole-")), at)
    for step, tokens in enumerate(global_batches(micro_batches, dp), 1):
        at[0] = step
        micro = micro_batches_of(tokens, micro_batches, dp, strategy.data_parallel_rank(rank))
        result = pipelined_step(pipeline, micro, optimizer, scheduler, MAX_GRAD_NORM, step, nullcontext)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    weights = pipeline.full_state_dict()
    return {"losses": losses, "grad_norms": norms, "weights": weights, "pipeline": pipeline}


def main() -> list:
    pp, *schedules, flag, out = sys.argv[1:]
    assert flag == "--output_dir", sys.argv
    pp = int(pp)
    Path(out).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    kept = []  # every pipeline, alive until the process ends: freeing DDP's reducer tears the group down (run_rank)
    for spec in schedules:
        schedule, per_rank, data_parallel = (spec.split(":") + ["1", "ddp"][spec.count(":") :])[:3]
        per_rank = int(per_rank)
        micro_batches = 2 * pp * per_rank  # enough for every schedule's rule
        dp = degrees(data_parallel, dist.get_world_size(), pp)[2]
        try:
            states = Path(out, f"{spec.replace(':', '-')}-states-rank{dist.get_rank()}.json")
            run = pipelined(schedule, per_rank, pp, data_parallel, micro_batches, states)
            kept.append(run["pipeline"])
            error = None
        except Exception as e:  # recorded: the test names the schedule that fails and why
            run, error = None, f"{type(e).__name__}: {e} {e.__cause__!r}"
        if dist.get_rank() == 0:
            ref = one_process(micro_batches, dp)
            record = {"error": error, "reference": {k: ref[k] for k in ("losses", "grad_norms")}}
            if run is not None:
                record["pipeline"] = {k: run[k] for k in ("losses", "grad_norms")}
                diffs = [(run["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items()
                         if k != "lm_head.weight"]  # fmt: skip
                record["max_weight_difference"] = max(diffs)
                record["missing_weights"] = sorted(set(ref["weights"]) - set(run["weights"]) - {"lm_head.weight"})
            Path(out, f"{spec.replace(':', '-')}.json").write_text(json.dumps(record, indent=1))
        if error is not None and os.environ.get("PIPELINE_WORKER_RAISE"):
            raise RuntimeError(error)
        dist.barrier()
    dist.destroy_process_group()
    return kept


if __name__ == "__main__":
    run_rank(main)  # ends the process without finalization, where gloo's threads have aborted a finished rank
