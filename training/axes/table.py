"""Which model-parallel axis composes with which data-parallel wrapper: one table, read by the launch checks
(training/launch.py, sequence.py), the memory planner (training/plan/memory/stages.py, fit.py), the
step-time planner (training/plan/step_time.py, layouts.py), recipes/compare.py and the doctor.

A wrapper is what holds the data-parallel copies: one process (`single`), DDP, FSDP or a DeepSpeed engine by its
ZeRO stage (`zero1` ... `zero3`, offloaded or not: `wrapper`). Plain data: the configuration and the planners read it
without any runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

WRAPPERS = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3")
DEEPSPEED = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Axis:
    """One model-parallel axis of the mesh (training/mesh.py) and the wrappers it composes with."""

    name: str  # in words, as errors and reports name it
    trains_under: tuple[str, ...]  # the wrappers recipes/train.py trains it under; its launch checks refuse the rest
    published_under: tuple[str, ...] = ()  # beside those, what published runs used it under (Megatron-LM's DDP,
    # DeepSpeed's ZeRO-1 under its own pipeline): the step-time planner's `any_layout`, never launched here
    alone: bool = True  # trains with no other model-parallel axis, except as COMPOSED says


AXES = {
    # torch.distributed.pipelining's stages, with one process's optimizer, DDP's all-reduce or FSDP2 per stage
    # (training/axes/pipeline/runtime.py); a DeepSpeed engine wraps and steps the whole model.
    # DeepSpeed's own pipeline engine runs ZeRO-0/1 only, on a model rewritten as its PipelineModule.
    "pp": Axis("pipeline parallelism", ("single", "ddp", "fsdp"), published_under=("zero1",), alone=False),
    # DeepSpeed AutoTP, built by the engine (`tensor_parallel.autotp_size`), or the model's plan with torch's
    # DTensor APIs under FSDP2 (an accelerate YAML's parallelism_config_tp_size: training/axes/tensor/plan.py; a DDP
    # YAML's dp_replicate x tp is FSDP2 on a replicate-only mesh, as torch's DTensor-aware `replicate` is).
    # Megatron-LM's runs split layers under DDP.
    "tp": Axis(
        "tensor parallelism (DeepSpeed AutoTP, or DTensor under FSDP2)",
        (*DEEPSPEED, "fsdp"),
        published_under=("ddp",),
        alone=False,
    ),
    # DeepSpeed's Ulysses: the engine reduces the gradients over the sequence-parallel ranks
    # (training/axes/ulysses.py).
    "sp": Axis("sequence parallelism (Ulysses)", DEEPSPEED),
    # torch's ring attention through accelerate, over FSDP2's dp_shard x cp mesh (CUDA only).
    "cp": Axis("context parallelism (ring attention)", ("fsdp",)),
}


# Axes that train together, and the wrappers that hold them: DTensor tensor parallelism inside pipeline stages, the
# stages under one process's optimizer, DDP (torchrun's --tensor_parallel_degree) or FSDP2 (a YAML's
# parallelism_config with --pipeline_parallel_degree): training/axes/pipeline/runtime.py, tensor.py.
COMPOSED = {frozenset(("tp", "pp")): ("single", "ddp", "fsdp")}


def wrapper(family: str, zero_stage: int | None = None) -> str:
    """The wrapper of a `Strategy.family` (and its ZeRO stage under DeepSpeed): `ddp`, `fsdp`, `zero2`, ..."""
    return f"zero{zero_stage}" if family == "deepspeed" else family


def composes(axis: str, wrapper_name: str) -> bool:
    """Whether recipes/train.py trains `axis` under the data-parallel wrapper `wrapper_name` (`wrapper`)."""
    return wrapper_name in AXES[axis].trains_under


def composes_with(axis: str, other: str, wrapper_name: str) -> bool:
    """Whether recipes/train.py trains `axis` and `other` together under `wrapper_name` (COMPOSED)."""
    return wrapper_name in COMPOSED.get(frozenset((axis, other)), ())


def markdown() -> str:
    """The table as docs/strategies.md prints it ("Composing the axes"; tests/training/test_axes.py holds the two
    equal): each axis against each wrapper, "trains" where recipes/train.py trains it, "published" where only
    published runs used it (the step-time planner's `any_layout`), then the axes that train together."""
    rows = ["| axis | " + " | ".join(WRAPPERS) + " |", "|---|" + "---|" * len(WRAPPERS)]
    for key, axis in AXES.items():
        cells = ["trains" if w in axis.trains_under else "published" if w in axis.published_under else ""
                 for w in WRAPPERS]  # fmt: skip
        rows.append(f"| {axis.name} (`{key}`) | " + " | ".join(cells) + " |")
    for axes, under in COMPOSED.items():
        cells = ["trains" if w in under else "" for w in WRAPPERS]
        rows.append(
            f"| {' with '.join(AXES[a].name.split(' (')[0] for a in sorted(axes))} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)
