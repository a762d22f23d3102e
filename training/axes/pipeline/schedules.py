"""The pipeline schedules' facts: which of torch's schedules this project trains with, how a schedule places its
stages on the pipeline ranks and the layers in each stage, and what each schedule requires of a launch. Plain
Python: the configuration, the launch checks and the planners read them without the pipeline runtime
(training/axes/pipeline/runtime.py) or torch.distributed.
"""

from __future__ import annotations

# The schedules that train like one process on CPU ranks (tests/training/test_pipeline.py), by torch's names, and
# those among them that hold several stages per rank (looped: stage s on rank s mod pp; V-shaped: rank r holds r
# and 2 pp - 1 - r).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
# torch's other training schedule: DualPipeV never finished a step on 2 gloo ranks (torch 2.13; stopped after 300 s).
ALL_SCHEDULES = (*SCHEDULES, "DualPipeV")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble",)
MULTI_STAGE = LOOPED + V_SHAPED
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")  # refused with FSDP2 (training/strategy.py)


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Stages each pipeline rank holds: the requested count, else 2 under a multi-stage schedule and 1 otherwise."""
    if requested is not None:
        return requested
    return 2 if schedule in MULTI_STAGE else 1


def stage_ranks(schedule: str, pp: int, per_rank: int) -> list[int]:
    """The pipeline rank of each stage: looped (s mod pp) or V-shaped (0 .. pp-1, then back)."""
    stages = range(pp * per_rank)
    if schedule in V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in stages]
    return [s % pp for s in stages]


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The decoder layers of `stage`: an equal share, in order."""
    per_stage = num_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def check_pipeline(schedule: str, pp: int, per_rank: int, micro_batches: int, num_layers: int) -> None:
    """What torch's schedules require, checked before any process group; each error names the flag and the fix."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"--pipeline_parallel_schedule {schedule} does not train on this project's CPU-tested path (torch "
            f"2.13's DualPipeV never finished a step on 2 gloo ranks): choose one of {', '.join(SCHEDULES)}"
        )
    if schedule not in MULTI_STAGE and per_rank != 1:
        raise ValueError(
            f"--pipeline_parallel_virtual_stages {per_rank} with --pipeline_parallel_schedule {schedule}, which runs "
            f"one stage per rank: pass 1, or a multi-stage schedule ({', '.join(MULTI_STAGE)})"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise ValueError(
            f"--pipeline_parallel_virtual_stages {per_rank} with --pipeline_parallel_schedule {schedule}: a V-shaped "
            "schedule holds exactly 2 stages per rank; pass 2"
        )
    stages = pp * per_rank
    if stages > num_layers or num_layers % stages:
        raise ValueError(
            f"{num_layers} decoder layers do not split into {stages} equal stages (--pipeline_parallel_degree {pp} x "
            f"{per_rank} stages per rank): choose degrees whose product divides {num_layers}, or another "
            "num_hidden_layers (--config_overrides)"
        )
    if schedule == "1F1B" and micro_batches < pp:
        raise ValueError(
            f"--gradient_accumulation_steps {micro_batches} is fewer micro batches than the {pp} stages of "
            f"1F1B (torch's Schedule1F1B needs at least one per stage): pass --gradient_accumulation_steps {pp} or more"
        )
    rounds = max(1, micro_batches // pp)
    if schedule in LOOPED and micro_batches % rounds:
        raise ValueError(
            f"--gradient_accumulation_steps {micro_batches} with {schedule} on {pp} pipeline ranks: torch's schedule "
            f"splits the micro batches into {rounds} rounds ({micro_batches} // {pp}) and needs a multiple of that; "
            f"pass a multiple of {pp}"
        )
    if schedule in V_SHAPED and micro_batches < stages:
        raise ValueError(
            f"--gradient_accumulation_steps {micro_batches} with {schedule}: the schedule needs at least one micro "
            f"batch per stage ({stages}); pass --gradient_accumulation_steps {stages} or more"
        )


def check_schedule_on_gloo(schedule: str, gloo: bool, sending_torch: str | None) -> None:
    """A V-shaped schedule on gloo ranks under a torch whose schedules open each stage's links with a send to the
    same-rank neighbour too (`sending_torch`: its version, from training/compat.pipeline_sends_to_own_rank): gloo has
    no link from a rank to itself, so the ranks holding the middle stages fail and the rest wait for them for ever.
    Checked before any process group (NCCL sends to its own rank: GPUs are not refused)."""
    if schedule in V_SHAPED and gloo and sending_torch is not None:
        raise ValueError(
            f"--pipeline_parallel_schedule {schedule} on CPU ranks (gloo) with torch {sending_torch}: this torch opens "
            "the link between a rank's two V-shaped stages with a send to its own rank, which gloo cannot make, and "
            "the pipeline hangs; use Interleaved1F1B (two stages a rank, looped), or torch >= 2.13 "
            "(pip install 'torch>=2.13')"
        )
