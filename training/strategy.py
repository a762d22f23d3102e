"""What a launch asks for, read and checked before any process group exists.

`Strategy` is the typed answer (family, ZeRO stage, offload targets, FSDP version and sharding, data-parallel, shard and
tensor-parallel degrees), holding the launch's mesh, built once per launch by its family (training/core/) as
training/launch.py resolves the launch; everything else reads its fields.
Its `name` (`zero3-offload-cpu`, `fsdp-shard-grad-op`) is how people and records spell it, and `Strategy.from_name` is
the one place a name is read back: the planner's --strategy choices, the strategy a checkpoint or a measurement
recorded. The checks that refuse a launch that could not run as asked are its family's and each axis's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from training.deepspeed_config import (
    autotp_size,
    offload_devices,
    sequence_parallel_size,
    zero_stage,
)
from training.mesh import Mesh, MeshError

Family = Literal["single", "ddp", "fsdp", "deepspeed"]
Device = Literal["none", "cpu", "nvme"]
Sharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
SHARDED = ("fsdp", "deepspeed")  # the families whose data-parallel ranks shard one copy (the mesh's dp_shard)
SHARDING_SUFFIX = {"FULL_SHARD": "", "SHARD_GRAD_OP": "-shard-grad-op", "NO_SHARD": "-no-shard"}  # in names


@dataclass(frozen=True)
class Strategy:
    """What the launch asked for, resolved before any process group exists: built once (`requested_strategy`),
    read by its fields everywhere, spelled by `name`."""

    family: Family
    """Who wraps the model: nobody (one process, "single"), DDP, torch's FSDP through accelerate, or a DeepSpeed
    engine."""
    mesh: Mesh = Mesh()
    """The degrees of every parallel axis (training/mesh.py): pipeline, data-parallel replicas and shards,
    ring context, Ulysses sequence and tensor parallelism; their product is the launched world."""
    zero_stage: int = 0
    """DeepSpeed's ZeRO stage (0 to 3); 0 outside DeepSpeed."""
    offload_param: Device = "none"
    """Where the parameters live between uses: ZeRO-3's `offload_param` device, or "cpu" under FSDP's
    `fsdp_offload_params`."""
    offload_optimizer: Device = "none"
    """Where the optimizer states live and are stepped: ZeRO's `offload_optimizer` device (DeepSpeed's CPU Adam),
    or "cpu" under FSDP's `fsdp_offload_params`."""
    fsdp_version: int = 0
    """1 (torch's FullyShardedDataParallel, flat parameters) or 2 (`fully_shard`); 0 outside FSDP."""
    fsdp_sharding: Sharding = "FULL_SHARD"
    """FSDP's sharding, in torch's names: FULL_SHARD frees a unit's gathered parameters after its forward,
    SHARD_GRAD_OP keeps them until its backward (FSDP2's `fsdp_reshard_after_forward: false`), NO_SHARD (FSDP1)
    shards nothing."""
    pp_schedule: str = "1F1B"
    """The pipeline schedule (torch.distributed.pipelining's name: GPipe, 1F1B, Interleaved1F1B, ...); unused
    without pipeline parallelism."""
    pp_stages_per_rank: int = 1
    """Stages each pipeline rank holds: 1, or more under the interleaved and V-shaped schedules."""
    deepspeed: dict | None = field(default=None, compare=False)
    """The DeepSpeed config with every "auto" resolved from the flags; None outside DeepSpeed."""
    deepspeed_source: str | None = field(default=None, compare=False)
    """Where the DeepSpeed config came from, as messages name it."""
    fsdp_env: Mapping[str, str] = field(default_factory=dict, compare=False)
    """accelerate's FSDP_* variables as launched: what only FSDP's own set-up and checks read (the wrap policy)."""

    @classmethod
    def of(cls, family: Family, world: int = 1, *, pp: int = 1, cp: int = 1, sp: int = 1, tp: int = 1,
           replicas: int = 1, **wrapper) -> Strategy:  # fmt: skip
        """The strategy `family` runs on `world` ranks with these model-parallel degrees and hybrid replicas, the
        rest of the ranks data parallel: sharded under FSDP and ZeRO, replicated under DDP (`Mesh.of_world`, where
        the degrees are checked against the world). `wrapper`: the other fields."""
        mesh = Mesh.of_world(world, pp=pp, cp=cp, sp=sp, tp=tp, replicas=replicas, shard=family in SHARDED)
        return cls(family, mesh, **wrapper)

    def with_degrees(self, world: int | None = None, **degrees) -> Strategy:
        """This strategy on `world` ranks (its own by default) with other model-parallel degrees (`Strategy.of`'s
        pp, cp, sp, tp, replicas; the others kept), the rest of the ranks data parallel."""
        m = self.mesh
        kept = {"pp": m.pp, "cp": m.cp, "sp": m.sp, "tp": m.tp, "replicas": self.replicas}
        mesh = Mesh.of_world(world or m.world, **{**kept, **degrees}, shard=self.family in SHARDED)
        return replace(self, mesh=mesh)

    def __post_init__(self):
        if self.pp_stages_per_rank < 1:
            raise ValueError(f"Strategy: {self.pp_stages_per_rank} stages per pipeline rank; at least 1")
        if self.replicas > 1 and self.fsdp_version != 2:
            raise ValueError("Strategy: replicas of a sharded model (hybrid sharding) are FSDP2's")
        sharded = self.family in SHARDED
        if (self.family == "deepspeed" and self.mesh.dp_replicate > 1) or (not sharded and self.mesh.dp_shard > 1):
            raise ValueError(
                f"Strategy: {self.family} does not run on the mesh {self.mesh.shape} (ZeRO shards every "
                "data-parallel rank, DDP replicates)"
            )
        if self.family == "fsdp" and self.tp_size > 1 and self.fsdp_version != 2:
            raise ValueError("Strategy: tensor parallelism under FSDP is FSDP2's (fully_shard of DTensor slices)")
        for name, kind in (("family", Family), ("offload_param", Device), ("offload_optimizer", Device),
                           ("fsdp_sharding", Sharding)):  # fmt: skip
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"Strategy.{name} = {getattr(self, name)!r}: choose one of {get_args(kind)}")
        if self.zero_stage not in (0, 1, 2, 3) or self.fsdp_version not in (0, 1, 2):
            raise ValueError(f"Strategy: ZeRO stage {self.zero_stage} or FSDP version {self.fsdp_version} is unknown")

    @property
    def name(self) -> str:
        """How people and records spell the strategy: single[-tpN], ddp[-tpN], fsdp[-hybrid][-shard-grad-op]
        [-offload][-tpN], fsdp1[-shard-grad-op|-no-shard][-offload], zero{0-3}[-offload-cpu|-offload-nvme][-autotp]
        [-spN], each with -ppN under pipeline parallelism."""
        pipeline = f"-pp{self.pp_size}" if self.pp_size > 1 else ""
        if self.family == "deepspeed":
            offload = f"-offload-{self.offload_device}" if self.offloads else ""
            sequence = f"-sp{self.sp_size}" if self.sp_size > 1 else ""
            return f"zero{self.zero_stage}{offload}" + ("-autotp" if self.tp_size > 1 else "") + sequence + pipeline
        if self.family == "fsdp":
            version = "1" if self.fsdp_version == 1 else ""
            hybrid = "-hybrid" if self.replicas > 1 else ""
            offload = "-offload" if self.offloads else ""
            context = f"-cp{self.cp_size}" if self.cp_size > 1 else ""
            tensor = f"-tp{self.tp_size}" if self.tp_size > 1 else ""
            return f"fsdp{version}{hybrid}{SHARDING_SUFFIX[self.fsdp_sharding]}{offload}{context}{tensor}{pipeline}"
        return self.family + (f"-tp{self.tp_size}" if self.tp_size > 1 else "") + pipeline

    @classmethod
    def from_name(cls, name: str, world_size: int = 1) -> Strategy:
        """The strategy `name` spells, on `world_size` ranks: the inverse of `name`, for the planner's --strategy
        choices and the names runs recorded (a checkpoint's trainer state, strategy.json, memory_rank*.json). An
        offload may leave out its device, CPU (`zero2-offload`, the planner's earlier spelling). A name does not
        spell every degree: -hybrid reads as two replicas, -autotp as two tensor-parallel ranks
        (ds_configs/autotp.json's), and a ZeRO-3 offload as the parameters' and the optimizer's (as ds_configs/
        offloads them); a caller that has the launch's DeepSpeed JSON builds from it instead (`deepspeed_strategy`)."""
        match = NAME.fullmatch(name)
        try:
            strategy = spelled(match, world_size) if match else None
        except MeshError:  # degrees the name spells that do not divide the ranks: that error says which
            raise
        except ValueError:  # parts that make no strategy: fsdp1-hybrid, -hybrid on one rank
            strategy = None
        if strategy is None or strategy.name not in (name, name.replace("-offload", "-offload-cpu")):
            raise ValueError(
                f"strategy {name!r} is unknown: a strategy is spelled single, ddp, fsdp[-hybrid][-shard-grad-op]"
                "[-offload], fsdp1[-shard-grad-op|-no-shard][-offload] or zero{0-3}[-offload-cpu|-offload-nvme]"
                "[-autotp][-spN], fsdp[...][-cpN][-tpN], with -ppN for a pipeline"
            )
        return strategy

    @property
    def offloads(self) -> bool:
        """Whether states live off the accelerator (DeepSpeed's CPU Adam or FSDP's CPU policy steps them there)."""
        return self.offload_param != "none" or self.offload_optimizer != "none"

    @property
    def offload_device(self) -> Device:
        """The device the name spells: the parameters' if they are offloaded, else the optimizer's."""
        return self.offload_param if self.offload_param != "none" else self.offload_optimizer

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the model is sharded over under FSDP: the world, a replica's ranks under hybrid
        sharding, 1 under NO_SHARD; 1 outside FSDP."""
        if self.family != "fsdp" or self.fsdp_sharding == "NO_SHARD":
            return 1
        return self.mesh.dp_shard * self.mesh.cp  # ring context: over dp_shard x cp

    @property
    def replicas(self) -> int:
        """Hybrid FSDP: the copies of the model, each sharded over shard_size ranks; 1 otherwise."""
        return self.mesh.dp_replicate if self.family == "fsdp" else 1

    # The mesh's degrees and sizes under the names the runtimes and records use.
    world_size = property(lambda self: self.mesh.world, doc="Ranks the launcher started.")
    pp_size = property(lambda self: self.mesh.pp, doc="Pipeline ranks: the decoder's layers split over them.")
    cp_size = property(lambda self: self.mesh.cp, doc="Ranks each sequence is split over by ring attention.")
    sp_size = property(lambda self: self.mesh.sp, doc="Ranks each sequence is split over by Ulysses.")
    tp_size = property(lambda self: self.mesh.tp, doc="Ranks each layer is split over (AutoTP; the plan under FSDP2).")
    data_parallel_size = property(lambda self: self.mesh.dp, doc="Ranks that train on different data.")

    @property
    def gradient_divisor(self) -> int:
        """What the gradient reduction divides each summed gradient by: the data-parallel count, or with sp (Ulysses)
        or cp (ring context) ranks a sequence, dp groups of them. DeepSpeed 0.19.8 under Ulysses: ZeRO-3's
        reduce-scatter (`reduce_scatter`, true by default) by every rank of the sequence-and-data-parallel group
        (runtime/comm/coalesced_collectives.py: `reduce_scatter_coalesced` pre-divides by the group's size); ZeRO-1 and
        2, and ZeRO-3 without reduce_scatter, by that count over sp (runtime/zero/stage_1_and_2.py `average_tensor`,
        stage3.py `__avg_scatter_contiguous_grads`: `world_size / sequence_parallel_size`). FSDP2 under ring context
        parallelism reduce-scatters over accelerate's flattened dp_shard x cp mesh, averaging over all of its ranks.
        The step multiplies each rank's loss by it (training/loop/step.py), so that the update is one process's."""
        m, zero = self.mesh, (self.deepspeed or {}).get("zero_optimization") or {}
        if m.cp > 1:
            return m.dp * m.cp
        if m.sp > 1 and self.zero_stage == 3 and zero.get("reduce_scatter", True):
            return m.dp * m.sp
        return m.dp

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` trains on."""
        return self.mesh.dp_rank(rank)

    def sequence_parallel_rank(self, rank: int) -> int:
        """Which slice of each sequence `rank` holds: positions [r T / sp, (r + 1) T / sp); 0 without sequence
        parallelism."""
        return self.mesh.coordinates(rank)["sp"]

    def pipeline_rank(self, rank: int) -> int:
        """Which of the pipeline's ranks `rank` is (0 holds the first stage); 0 without pipeline parallelism."""
        return self.mesh.coordinates(rank)["pp"]


# A name as `Strategy.name` spells it; `from_name` builds from its parts and checks that the name reads back.
NAME = re.compile(
    r"(?P<family>single|ddp|fsdp|zero)(?P<number>[0-3])?(?P<hybrid>-hybrid)?(?P<sharding>-shard-grad-op|-no-shard)?"
    r"(?P<offload>-offload(?:-(?P<device>cpu|nvme))?)?(?P<autotp>-autotp)?(?:-sp(?P<sp>[2-9]|[1-9][0-9]+))?"
    r"(?:-cp(?P<cp>[2-9]|[1-9][0-9]+))?(?:-tp(?P<tp>[2-9]|[1-9][0-9]+))?"
    r"(?:-pp(?P<pp>[2-9]|[1-9][0-9]+))?"
)


def spelled(match: re.Match, world: int) -> Strategy:
    """The strategy of a `NAME` match on `world` ranks."""
    part = match.groupdict()
    device = part["device"] or ("cpu" if part["offload"] else "none")
    pp = int(part["pp"] or 1)
    if part["family"] == "zero":
        stage = int(part["number"] or 0)
        return Strategy.of("deepspeed", world, zero_stage=stage, offload_param=device if stage == 3 else "none",
                           offload_optimizer=device, tp=2 if part["autotp"] else 1, pp=pp,
                           sp=int(part["sp"] or 1))  # fmt: skip
    if part["sp"] or (part["tp"] and part["family"] == "zero"):
        # Ulysses runs under DeepSpeed only, DTensor tensor parallelism under FSDP2 (a -cpN the spelled strategy has
        # not fails the read-back)
        return None
    if part["family"] == "fsdp":
        return Strategy.of(
            "fsdp", world, offload_param=device, offload_optimizer=device, fsdp_version=int(part["number"] or 2),
            fsdp_sharding=next(s for s, suffix in SHARDING_SUFFIX.items() if suffix == (part["sharding"] or "")),
            replicas=2 if part["hybrid"] else 1, pp=pp, cp=int(part["cp"] or 1), tp=int(part["tp"] or 1),
        )  # fmt: skip
    return Strategy.of(part["family"], world, pp=pp, tp=int(part["tp"] or 1))


def deepspeed_strategy(ds: dict, world: int, source: str | None = None) -> Strategy:
    """The strategy a resolved DeepSpeed config runs on `world` ranks: its stage, offload devices, AutoTP size and
    sequence-parallel size."""
    devices = offload_devices(ds)
    return Strategy.of(
        "deepspeed", world, zero_stage=zero_stage(ds), offload_param=devices["offload_param"],
        offload_optimizer=devices["offload_optimizer"], tp=autotp_size(ds), sp=sequence_parallel_size(ds),
        deepspeed=ds, deepspeed_source=source,
    )  # fmt: skip
