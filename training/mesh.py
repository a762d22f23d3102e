"""The degrees of a launch, in one mesh order: `Mesh(pp, dp_replicate, dp_shard, cp, sp, tp)`.

Every parallel axis the project runs has a degree here and nowhere else: the pipeline (pp, torch.distributed.
pipelining), the data-parallel ranks that keep whole copies (dp_replicate: DDP, FSDP's NO_SHARD and hybrid replicas)
and those that shard one copy (dp_shard: FSDP, ZeRO), torch's ring context parallelism (cp), DeepSpeed's Ulysses
(sp) and tensor parallelism (tp, DeepSpeed AutoTP). Ranks are laid out row-major in that order, pp outermost and tp
innermost, as torchtitan's `ParallelDims` places pp and accelerate's `ParallelismConfig` places the rest
(dp_replicate, dp_shard, cp, sp, tp): the ranks of one tensor-parallel group are consecutive, then those of one
sequence, and the ranks r and r + world / pp hold neighbouring stages of one pipeline.

The mesh is plain arithmetic: it imports nothing from torch.distributed and creates no process group; the degrees
are read from the launch in one place (training/launch.py's `degrees`). `groups(axis)` lists every group of an axis,
in the order every rank must create them (`dist.new_group` is collective), for the runtimes that build their own
(the pipeline's); accelerate and DeepSpeed build the groups of the axes they run from the same degrees.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
"""The mesh's axes, outermost first."""

FLAGS = {
    "pp": "--pipeline_parallel_degree",
    "dp_replicate": "parallelism_config_dp_replicate_size",
    "dp_shard": "parallelism_config_dp_shard_size",
    "cp": "parallelism_config_cp_size",
    "sp": "sequence_parallel_size",
    "tp": "tensor_parallel.autotp_size",
}
"""Where a user sets each degree, as errors name it."""


class MeshError(ValueError):
    """Degrees that make no mesh of the launched ranks."""


@dataclass(frozen=True)
class Mesh:
    """The degrees of every parallel axis of one launch; their product is the world. Built by `Mesh.of_world`, which
    checks once that the model-parallel degrees divide the launched ranks."""

    pp: int = 1
    """Pipeline stages' ranks: the decoder's layers split over this many ranks, one micro batch after another."""
    dp_replicate: int = 1
    """Data-parallel ranks holding whole copies of the model (DDP; hybrid FSDP's replicas)."""
    dp_shard: int = 1
    """Data-parallel ranks one copy of the model is sharded over (FSDP, ZeRO)."""
    cp: int = 1
    """Ranks each sequence is split over by torch's ring context parallelism (FSDP2 on CUDA)."""
    sp: int = 1
    """Ranks each sequence is split over by DeepSpeed's Ulysses (heads exchanged for positions by all-to-all)."""
    tp: int = 1
    """Ranks each layer is split over (DeepSpeed AutoTP); they train on the same batch."""

    def __post_init__(self):
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"{FLAGS[axis]}: {degree!r} is not a degree: set a whole number of ranks, 1 or more")

    @classmethod
    def of_world(cls, world: int, *, pp: int = 1, cp: int = 1, sp: int = 1, tp: int = 1, replicas: int = 1,
                 shard: bool = True, flags: dict[str, str] = FLAGS, unit: str = "ranks") -> Mesh:  # fmt: skip
        """The mesh of `world` launched ranks with these model-parallel degrees, the rest data parallel: sharded
        (`shard`: FSDP, ZeRO) over world / (pp cp sp tp replicas) ranks in each of `replicas` copies, or replicated
        (DDP). The one check that the degrees divide the world; its error names each degree by `flags` and the world
        in `unit` (the step-time planner's: its own flags, GPUs)."""
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"the launch has {world!r} ranks: launch 1 or more")
        model_parallel = cls(pp=pp, cp=cp, sp=sp, tp=tp, dp_replicate=replicas)  # each degree checked
        if world % model_parallel.world:
            given = [a for a in AXES if getattr(model_parallel, a) > 1]
            named = " x ".join(f"{flags[a]} = {getattr(model_parallel, a)}" for a in given)
            if len(given) > 1:
                named += f" (= {model_parallel.world} {unit})"
            fix = "set it to one of" if len(given) == 1 else "make their product one of"
            fits = [d for d in range(1, world + 1) if world % d == 0]
            launched = "launched ranks" if unit == "ranks" else unit
            raise MeshError(
                f"{named} does not divide the {world} {launched}: {fix} {fits}, or launch a multiple of "
                f"{model_parallel.world} {unit}"
            )
        data = world // model_parallel.world
        if shard:
            return cls(pp=pp, dp_replicate=replicas, dp_shard=data, cp=cp, sp=sp, tp=tp)
        return cls(pp=pp, dp_replicate=replicas * data, dp_shard=1, cp=cp, sp=sp, tp=tp)

    # ------------------------------------------------------------------------------------------------ sizes

    @property
    def world(self) -> int:
        return math.prod(astuple(self))

    @property
    def shape(self) -> dict[str, int]:
        """Every axis's degree, outermost first."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def dp(self) -> int:
        """Ranks that train on different data: the global batch is micro x accumulation x this."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_split(self) -> int:
        """Ranks each sequence's positions are split over (Ulysses or ring context)."""
        return self.cp * self.sp

    # ------------------------------------------------------------------------------------------------ ranks

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along every axis (row-major: tp varies fastest)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of the mesh's {self.world}")
        coordinates, rest = {}, rank
        for axis in reversed(AXES):
            rest, coordinates[axis] = divmod(rest, getattr(self, axis))
        return {axis: coordinates[axis] for axis in AXES}

    def rank(self, **coordinates: int) -> int:
        """The rank at these coordinates (0 along the axes not named)."""
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + coordinates.get(axis, 0)
        return rank

    def dp_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` trains on (its replica's shards counted one after another)."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only along `axes` (one axis, or several flattened: ("dp_replicate",
        "dp_shard") is the data-parallel group), each in rank order; the groups in the order of their first rank.
        Every rank creates every group, in this order, where a runtime builds them with `dist.new_group`."""
        unknown = [a for a in axes if a not in AXES]
        if unknown or not axes:
            raise ValueError(f"mesh axes {unknown or '(none)'}: choose among {AXES}")
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            at = self.coordinates(rank)
            groups.setdefault(tuple(v for a, v in at.items() if a not in axes), []).append(rank)
        return list(groups.values())

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The ranks of `rank`'s group along `axes`."""
        return next(group for group in self.groups(*axes) if rank in group)
