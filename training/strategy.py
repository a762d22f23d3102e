"""What a launch asks for, read and checked before any process group exists.

`Strategy` is the typed answer (family, ZeRO stage, offload targets, FSDP version and sharding, data-parallel,
shard and tensor-parallel degrees), built once per launch by `requested_strategy` from the launcher's environment
and the DeepSpeed JSON; everything else reads its fields. Its `name` (`zero3-offload-cpu`, `fsdp-shard-grad-op`)
is how people and records spell it, and `Strategy.from_name` is the one place a name is read back: the planner's
--strategy choices, the strategy a checkpoint or a measurement recorded. The checks here refuse a launch that could
not run as asked (FSDP wrap classes, DeepSpeed ops, FSDP1 on CPU ranks, accelerate's tensor parallelism).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
from accelerate.utils import (
    DeepSpeedPlugin,
)

from training.config import RunConfig
from training.deepspeed_config import (
    autotp_size,
    data_parallel_size,
    load_json,
    offload_devices,
    resolve_deepspeed,
    sequence_parallel_size,
    zero_stage,
)
from training.ops import check_op_cache, launch_ops
from training.parallel.mesh import Mesh, MeshError, block_degree, parallelism_block
from training.parallel.schedules import ZERO_BUBBLE
from training.sequence import (
    check_context_parallel,
    check_sequence_parallel,
    with_sequence_parallel,
    yaml_context_parallel_size,
    yaml_sequence_parallel_size,
)

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
    """The degrees of every parallel axis (training/parallel/mesh.py): pipeline, data-parallel replicas and shards,
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
        for name, kind in (("family", Family), ("offload_param", Device), ("offload_optimizer", Device),
                           ("fsdp_sharding", Sharding)):  # fmt: skip
            if getattr(self, name) not in get_args(kind):
                raise ValueError(f"Strategy.{name} = {getattr(self, name)!r}: choose one of {get_args(kind)}")
        if self.zero_stage not in (0, 1, 2, 3) or self.fsdp_version not in (0, 1, 2):
            raise ValueError(f"Strategy: ZeRO stage {self.zero_stage} or FSDP version {self.fsdp_version} is unknown")

    @property
    def name(self) -> str:
        """How people and records spell the strategy: single, ddp, fsdp[-hybrid][-shard-grad-op][-offload],
        fsdp1[-shard-grad-op|-no-shard][-offload], zero{0-3}[-offload-cpu|-offload-nvme][-autotp][-spN], each with
        -ppN under pipeline parallelism."""
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
            return f"fsdp{version}{hybrid}{SHARDING_SUFFIX[self.fsdp_sharding]}{offload}{context}{pipeline}"
        return self.family + pipeline

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
                "[-autotp][-spN], fsdp[...][-cpN], with -ppN for a pipeline"
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
    tp_size = property(lambda self: self.mesh.tp, doc="Ranks each layer is split over (AutoTP).")
    data_parallel_size = property(lambda self: self.mesh.dp, doc="Ranks that train on different data.")

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
    r"(?:-cp(?P<cp>[2-9]|[1-9][0-9]+))?"
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
    if part["sp"]:
        return None  # Ulysses runs under DeepSpeed only (a -cpN the spelled strategy has not fails the read-back)
    if part["family"] == "fsdp":
        return Strategy.of(
            "fsdp", world, offload_param=device, offload_optimizer=device, fsdp_version=int(part["number"] or 2),
            fsdp_sharding=next(s for s, suffix in SHARDING_SUFFIX.items() if suffix == (part["sharding"] or "")),
            replicas=2 if part["hybrid"] else 1, pp=pp, cp=int(part["cp"] or 1),
        )  # fmt: skip
    return Strategy.of(part["family"], world, pp=pp)


def deepspeed_strategy(ds: dict, world: int, source: str | None = None) -> Strategy:
    """The strategy a resolved DeepSpeed config runs on `world` ranks: its stage, offload devices, AutoTP size and
    sequence-parallel size."""
    devices = offload_devices(ds)
    return Strategy.of(
        "deepspeed", world, zero_stage=zero_stage(ds), offload_param=devices["offload_param"],
        offload_optimizer=devices["offload_optimizer"], tp=autotp_size(ds), sp=sequence_parallel_size(ds),
        deepspeed=ds, deepspeed_source=source,
    )  # fmt: skip


# torch's ShardingStrategy, by the name or number accelerate accepts in fsdp_sharding_strategy.
FSDP1_SHARDING = {
    "1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2",
}  # fmt: skip


def fsdp_strategy(fsdp_env: Mapping[str, str], world: int, replicas: int = 1, **degrees) -> Strategy:
    """The strategy accelerate's FSDP_* variables (as `accelerate launch` exports them from the YAML's fsdp_config)
    run on `world` ranks: one copy of the model sharded over the data-parallel ranks of each of `replicas` copies
    (more than 1: hybrid), with the model-parallel `degrees` (`Strategy.of`'s pp, cp, and the pipeline's fields)."""
    offload = "cpu" if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true" else "none"
    if fsdp_version(fsdp_env) == 1:
        sharding = fsdp1_sharding(fsdp_env)
        if sharding not in get_args(Sharding):
            raise ValueError(
                f"fsdp_sharding_strategy: {sharding} is not one of torch's: set FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                "HYBRID_SHARD or HYBRID_SHARD_ZERO2"
            )
        return Strategy.of("fsdp", world, offload_param=offload, offload_optimizer=offload, fsdp_version=1,
                           fsdp_sharding=sharding, fsdp_env=fsdp_env, **degrees)  # fmt: skip
    reshard = fsdp_env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "shard_grad_op")
    keep_gathered = fsdp_env.get("FSDP_SHARDING_STRATEGY") == "SHARD_GRAD_OP" or not reshard
    return Strategy.of(
        "fsdp", world, offload_param=offload, offload_optimizer=offload, fsdp_version=2,
        fsdp_sharding="SHARD_GRAD_OP" if keep_gathered else "FULL_SHARD", replicas=replicas, fsdp_env=fsdp_env,
        **degrees,
    )  # fmt: skip


def fsdp_version(fsdp_env: Mapping[str, str]) -> int:
    """`accelerate launch` exports FSDP_VERSION from the YAML's fsdp_version; a YAML without it is FSDP1."""
    return int(fsdp_env.get("FSDP_VERSION", "1"))


def fsdp1_sharding(fsdp_env: Mapping[str, str]) -> str:
    """FSDP1's sharding strategy, by torch's name."""
    sharding = fsdp_env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    return FSDP1_SHARDING.get(sharding, sharding)


# ---------------------------------------------------------------------------------------------- the launch


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_world_size() -> int:
    """Ranks the launcher started (torchrun, accelerate and deepspeed all export WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_precision() -> str:
    """The accelerate config's mixed_precision, as `accelerate launch` exports it ("no" without one); the run's
    config takes it in `RunConfig.resolve`."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def requested_strategy(cfg: RunConfig, hidden_size: int) -> Strategy:
    """The strategy of this launch, built once from the launcher's environment and the DeepSpeed JSON (its "auto"
    values resolved from `cfg`, the run's final config), after the checks that refuse what could not run. No
    process group is created."""
    world = launched_world_size()
    launched = launched_deepspeed_config(cfg)
    use_fsdp = env_flag("ACCELERATE_USE_FSDP")
    if launched is not None and use_fsdp:
        raise ValueError(
            "both DeepSpeed and FSDP are requested (--deepspeed or a DeepSpeed accelerate config, and an FSDP "
            "accelerate config): launch with one of them"
        )
    check_parallelism_config_tp()
    sp = sequence_parallel_size(launched[0]) if launched else yaml_sequence_parallel_size()
    check_sequence_parallel(cfg, cfg.model_config() if sp > 1 else None, sp, world, launched is not None)
    cp = yaml_context_parallel_size()
    fsdp_env = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
    check_context_parallel(cfg, cp, fsdp_version(fsdp_env) if use_fsdp else 0, torch.cuda.is_available())
    if launched is not None:
        raw, source = launched
        check_pipeline_with_deepspeed(cfg, raw, source)
        ds = resolve_deepspeed(raw, cfg, world, hidden_size, source, cpu_ranks=not torch.cuda.is_available())
        return deepspeed_strategy(ds, world, source)
    pipeline = pipeline_fields(cfg)
    if use_fsdp:
        if fsdp_version(fsdp_env) == 1:
            check_fsdp1_checkpoints(cfg, fsdp_env)
            check_fsdp1(fsdp_env)
        strategy = fsdp_strategy(fsdp_env, world, hybrid_replicas(world, cp), cp=cp, **pipeline)
        check_pipeline_with_fsdp(cfg, strategy)
        return strategy
    return replicated_strategy(world, pipeline)


def hybrid_replicas(world: int, cp: int = 1) -> int:
    """Hybrid sharding: the copies of the model an accelerate parallelism_config keeps, each sharded over its
    dp_shard x cp ranks (the shards replicated over the rest); 1 without the block or its dp_shard_size."""
    shard = block_degree("dp_shard_size", default=world)
    return math.ceil(world / (shard * cp))


def pipeline_fields(cfg: RunConfig) -> dict:
    """The Strategy fields of the pipeline flags."""
    return {"pp": cfg.pipeline_parallel_degree, "pp_schedule": cfg.pipeline_parallel_schedule,
            "pp_stages_per_rank": cfg.pipeline_stages_per_rank}  # fmt: skip


def replicated_strategy(world: int, pipeline: dict) -> Strategy:
    """DDP, or one process; the ranks of a pipeline train one batch, so there is no DDP among them."""
    strategy = Strategy.of("ddp", world, **pipeline)
    return strategy if strategy.data_parallel_size > 1 else replace(strategy, family="single")


def check_pipeline_with_deepspeed(cfg: RunConfig, raw: dict, source: str) -> None:
    """Pipeline parallelism runs with one process's optimizer, DDP or FSDP2 across the pipelines; a DeepSpeed engine
    wraps the whole model and steps it itself (DeepSpeed's own pipeline engine needs the model rewritten as its
    `PipelineModule`, and allows ZeRO-0/1 only)."""
    if cfg.pipeline_parallel_degree == 1:
        return
    what = f"ZeRO-{zero_stage(raw)}" + (" with AutoTP" if autotp_size(raw) > 1 else "")
    raise ValueError(
        f"--pipeline_parallel_degree {cfg.pipeline_parallel_degree} with the DeepSpeed config {source} ({what}): "
        "the pipeline's stages are run by torch.distributed.pipelining, and a DeepSpeed engine would wrap and step "
        "the whole model; launch the pipeline with accelerate_configs/ddp.yaml or fsdp.yaml (FSDP2 shards each "
        "stage over the data-parallel ranks, as ZeRO-3 would), or torchrun without --deepspeed"
    )


def check_pipeline_with_fsdp(cfg: RunConfig, strategy: Strategy) -> None:
    """Under pipeline parallelism FSDP2 shards each stage over the data-parallel ranks (training/pipeline.py);
    FSDP1's flat parameters, hybrid replicas and CPU offload are not built there."""
    if cfg.pipeline_parallel_degree == 1:
        return
    if cfg.pipeline_parallel_schedule in ZERO_BUBBLE:
        # InterleavedZeroBubble's split backward failed inside FSDP2 ("Can't detach views in-place", torch 2.13);
        # ZBVZeroBubble puts the first and last stage on rank 0, where FSDP2 sharded the one tied tensor twice and
        # the copies took different steps (losses off from step 2 on).
        raise ValueError(
            f"--pipeline_parallel_schedule {cfg.pipeline_parallel_schedule} with FSDP2: the zero-bubble schedules "
            "do not train under FSDP2 here (torch 2.13: InterleavedZeroBubble's split backward fails on FSDP2's "
            "gradients, ZBVZeroBubble shards the tied embedding twice on rank 0); use Interleaved1F1B, 1F1B or "
            "LoopedBFS with FSDP2, or a zero-bubble schedule with DDP (accelerate_configs/ddp.yaml)"
        )
    unsupported = (
        "fsdp_version: 1" if strategy.fsdp_version == 1
        else "a parallelism_config with replicas (hybrid sharding)" if strategy.replicas > 1
        else "fsdp_offload_params: true" if strategy.offloads
        else None
    )  # fmt: skip
    if unsupported:
        raise ValueError(
            f"--pipeline_parallel_degree {cfg.pipeline_parallel_degree} with {unsupported} in the FSDP config: the "
            "pipeline's stages are sharded with FSDP2 over all data-parallel ranks, in memory; launch with "
            "accelerate_configs/fsdp.yaml (or fsdp_shard_grad_op.yaml)"
        )


def launched_deepspeed_config(cfg: RunConfig) -> tuple[dict, str] | None:
    """The DeepSpeed config this launch names, as written ("auto" unresolved), and how messages name it:
    --deepspeed's JSON, the accelerate config's deepspeed_config_file, or its inline deepspeed_config fields; None
    outside DeepSpeed."""
    ds_file = cfg.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if ds_file:
        launched = load_json(ds_file), repr(ds_file)
    elif env_flag("ACCELERATE_USE_DEEPSPEED"):  # inline fields: the JSON accelerate would build from them
        launched = inline_deepspeed_config(), "from the accelerate config's deepspeed_config"
    else:
        return None
    # The accelerate YAML's sequence-parallel degree joins the JSON, where DeepSpeed and the batch arithmetic read it.
    return with_sequence_parallel(*launched), launched[1]


def launched_data_parallel_size(cfg: RunConfig) -> int:
    """Ranks of this launch that train on different data: the world over the pipeline degree
    (--pipeline_parallel_degree) and the tensor-parallel degree (DeepSpeed AutoTP's `tensor_parallel.autotp_size`),
    read before `RunConfig.resolve`, which fixes the accumulation that
    --global_batch_size gives from it (the DeepSpeed JSON's "auto" values are resolved afterwards, from the resolved
    config). The same count as `Strategy.data_parallel_size`, which the loader, DeepSpeed and the resume check use."""
    return data_parallel_ranks(cfg, launched_world_size(), launched_deepspeed_config(cfg), yaml_context_parallel_size())


def data_parallel_ranks(cfg: RunConfig, world: int, launched: tuple[dict, str] | None, cp: int = 1) -> int:
    """`launched_data_parallel_size` for `world` ranks, the DeepSpeed config `launched` ((JSON, how messages
    name it), or None) and `cp` ring-context-parallel ranks a sequence, as the doctor reads them from a launch's
    files."""
    mesh = Mesh.of_world(world, pp=cfg.pipeline_parallel_degree, cp=cp)  # refuses degrees that do not divide
    if launched is None:
        return mesh.dp
    raw, source = launched
    check_pipeline_with_deepspeed(cfg, raw, source)
    return data_parallel_size(raw, world, source)  # refuses an autotp_size that does not divide the world


def inline_deepspeed_config() -> dict:
    """The DeepSpeed JSON that accelerate's `DeepSpeedPlugin` builds from an accelerate YAML's inline
    `deepspeed_config` fields (zero_stage, offload devices and NVMe paths, gradient_accumulation_steps,
    gradient_clipping), which `accelerate launch` exports as ACCELERATE_* variables. Built by the plugin itself,
    so it is exactly accelerate's reading; it then goes through `resolve_deepspeed` like any JSON."""
    ds = DeepSpeedPlugin().deepspeed_config
    ds.pop("steps_per_print", None)  # the plugin's float("inf"), which is not JSON; the resolved config sets none
    return ds


def check_fsdp1(fsdp_env: Mapping[str, str]) -> None:
    """FSDP1 (torch's FullyShardedDataParallel, flat parameters): on CPU ranks two of its options cannot run, and one
    breaks weight decay everywhere; refused here rather than inside `prepare`."""
    sharding = fsdp1_sharding(fsdp_env)
    if not torch.cuda.is_available():
        if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            # torch 2.13 torch/distributed/fsdp/_flat_param.py:1260, FlatParamHandle.init_flat_param_attributes:
            # `flat_param._local_shard = flat_param._local_shard.pin_memory()`, unconditionally under CPU offload;
            # pinning needs an accelerator ("Cannot access accelerator device when none is available").
            raise ValueError(
                "fsdp_offload_params: true with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 pins the "
                "offloaded shards in page-locked memory, which needs a GPU): set fsdp_offload_params: false, or use "
                "fsdp_version: 2 (its CPUOffloadPolicy runs on CPU)"
            )
        if sharding.startswith("HYBRID"):
            raise ValueError(
                f"fsdp_sharding_strategy: {sharding} with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 "
                "builds its intra-node groups from the GPU count): use fsdp_version: 2 with a parallelism_config "
                "(dp_replicate_size x dp_shard_size), which runs hybrid sharding on CPU"
            )
    if fsdp_env.get("FSDP_USE_ORIG_PARAMS", "true").lower() != "true":
        raise ValueError(
            "fsdp_use_orig_params: false with fsdp_version: 1 flattens each wrapped module's parameters into one, so "
            "AdamW's weight decay could not skip norms and biases, and accelerate would leave the optimizer holding "
            "the replaced parameters (nothing trains): set fsdp_use_orig_params: true"
        )


def check_fsdp1_checkpoints(cfg: RunConfig, fsdp_env: dict) -> None:
    """FSDP1 trains on CPU ranks, but two of its checkpoint paths fail there (torch 2.13, accelerate 1.15, measured
    on the `debug` preset): saving a FULL_STATE_DICT checkpoint ended the run at its first save, and a run resumed
    from a SHARDED_STATE_DICT checkpoint at step 2 logged the straight run's loss at step 3 but not at step 4
    (5.3806 against 5.3906: Adam's restored state differs). FSDP2's checkpoints resume exactly
    (tests/recipes/test_resume.py)."""
    if torch.cuda.is_available():
        return
    if cfg.resume_from_checkpoint:
        raise ValueError(
            f"--resume_from_checkpoint {cfg.resume_from_checkpoint} with fsdp_version: 1 on CPU ranks: FSDP1 does not "
            "restore Adam's state exactly here; start afresh without it, or train with fsdp_version: 2, whose "
            "checkpoints resume exactly"
        )
    if cfg.save_steps and fsdp_env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT").upper() == "FULL_STATE_DICT":
        raise ValueError(
            f"--save_steps {cfg.save_steps} with fsdp_version: 1 and fsdp_state_dict_type: FULL_STATE_DICT on CPU "
            "ranks: the first save ends the run here; set fsdp_state_dict_type: SHARDED_STATE_DICT, or pass "
            "--save_steps 0 (the trained model is still exported at the end)"
        )


def check_parallelism_config_tp() -> None:
    """Tensor parallelism from an accelerate config's parallelism_config (`tp_size`, with or without FSDP2) is
    refused before the process group. accelerate 1.15 applies it in `Accelerator._prepare_tp`, which skips a
    model without DTensor parameters (accelerate/accelerator.py:1598-1603, a warning only: FSDP2 alone would then
    shard it, and each tensor-parallel pair would hold the same shards), so the model must arrive already split
    (DTensors on the mesh's `tp` dimension); then its FSDP2 branch (accelerate/accelerator.py:1618) runs
    `from transformers.integrations.tensor_parallel import ReplicateParallel` for the parameters the plan leaves
    whole (the norms), and transformers 5.23 has no such class (`accelerate_tp_importable`): the ImportError would
    end every rank inside `prepare`, on GPUs as on CPUs. Without FSDP (`tp_size` = the world) it is refused too:
    this script has no data-parallel gradient reduction for it. DeepSpeed AutoTP splits the same plan and trains;
    torch's own FSDP2 x TP of this model's plan trains like one process (tests/model/test_tensor_parallel.py)."""
    tp = block_degree("tp_size")
    if tp > 1:
        blocker = (
            "accelerate/accelerator.py:1618 imports transformers' removed ReplicateParallel"
            if not accelerate_tp_importable()
            else "this script builds no DTensor model for accelerate's tensor-parallel preparation"
        )
        raise ValueError(
            f"the accelerate config's parallelism_config sets tp_size: {tp}, which accelerate 1.15 cannot prepare with "
            f"transformers 5.23 ({blocker}): for tensor parallelism launch accelerate_configs/autotp.yaml or "
            "--deepspeed ds_configs/autotp.json (DeepSpeed AutoTP), or remove parallelism_config_tp_size"
        )


def accelerate_tp_importable() -> bool:
    """Whether the class accelerate's FSDP2 x TP preparation imports exists in the installed transformers."""
    from transformers.integrations import tensor_parallel

    return hasattr(tensor_parallel, "ReplicateParallel")


def parallelism_config() -> bool:
    """Whether the accelerate config has a `parallelism_config` block (`accelerate launch` exports it)."""
    return parallelism_block() is not None


def check_fsdp_wrap(strategy: Strategy, model: torch.nn.Module) -> None:
    """An FSDP config's wrap policy must be one the model can be wrapped with, checked on the model's module tree
    before any process group: accelerate would otherwise fail deep inside `prepare`."""
    policy = strategy.fsdp_env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    min_num_params = int(strategy.fsdp_env.get("FSDP_MIN_NUM_PARAMS", "0"))
    if policy == "SIZE_BASED_WRAP" and strategy.fsdp_version == 2:
        check_fsdp2_size_wrap(min_num_params, model)
    if policy == "SIZE_BASED_WRAP" and strategy.fsdp_version == 1:
        check_fsdp1_size_wrap(min_num_params, model)
    if policy != "TRANSFORMER_BASED_WRAP":
        return  # accelerate reads fsdp_transformer_layer_cls_to_wrap only under TRANSFORMER_BASED_WRAP
    names = strategy.fsdp_env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if not names:
        return  # accelerate takes the model's _no_split_modules (ShardGPTDecoderLayer)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names.split(",") if n.strip() and n.strip() not in present]
    if missing:
        raise ValueError(
            f"the FSDP config's fsdp_transformer_layer_cls_to_wrap names {missing}, which this model does not have; "
            f"set it to {sorted(model._no_split_modules)} or remove it (the model's _no_split_modules are used)"
        )


def check_fsdp2_size_wrap(min_num_params: int, model: torch.nn.Module) -> None:
    """accelerate's FSDP2 version of SIZE_BASED_WRAP (`fsdp2_prepare_auto_wrap_policy`, accelerate 1.15) wraps
    every module above fsdp_min_num_params, containers included, unlike torch's FSDP1 policy, which skips them;
    `fully_shard` then refuses the decoder's ModuleList ("does not support containers that do not implement
    forward"). A threshold of 0 means no wrapping (accelerate drops the policy), which runs."""
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    too_big = [
        (name, n)
        for name, m in model.named_modules()
        if isinstance(m, containers) and (n := sum(p.numel() for p in m.parameters())) > min_num_params
    ]
    if min_num_params > 0 and too_big:
        name, n = too_big[0]
        raise ValueError(
            f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP with fsdp_version: 2 and fsdp_min_num_params: {min_num_params} "
            f"would wrap the container {name!r} ({n} parameters), which FSDP2's fully_shard refuses: use "
            f"fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, or fsdp_min_num_params of {n} or more"
        )


def check_fsdp1_size_wrap(min_num_params: int, model: torch.nn.Module) -> None:
    """torch's size-based policy wraps the embedding and the output layer each on its own once the threshold is
    at most their size; with tied embeddings FSDP1 then flattens the one shared matrix into two flat parameters,
    and the tie is gone (seen: a parameter count larger by one embedding)."""
    embedding = model.get_input_embeddings().weight.numel()
    if getattr(model.config, "tie_word_embeddings", False) and 0 < min_num_params <= embedding:
        raise ValueError(
            f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP with fsdp_version: 1 and fsdp_min_num_params: {min_num_params} "
            f"would wrap the tied input and output embeddings ({embedding} parameters) apart, untying them: set "
            f"fsdp_min_num_params above {embedding}, or use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"
        )


def check_deepspeed_ops(strategy: Strategy) -> None:
    """Before any process group: refuse a launch whose ranks would wait forever on a lock left by a killed
    build of a DeepSpeed op, and say which ops this launch compiles (minutes, otherwise silent)."""
    if strategy.deepspeed is None:
        return
    to_build = check_op_cache(launch_ops(strategy.deepspeed, torch.cuda.is_available()))
    if to_build and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
        ops = f"{', '.join(to_build)} op{'s' if len(to_build) > 1 else ''}"
        print(
            f"DeepSpeed compiles its {ops} now, on first use here: minutes with no output, cached for later "
            "launches (`python recipes/doctor.py --build-ops` compiles ahead)",
            file=sys.stderr,
            flush=True,
        )
