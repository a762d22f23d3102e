"""A launch, resolved once before any process group: `resolve_launch` reads what was launched (the launcher's
`Environment`, the DeepSpeed JSON it names, opened once, and the flags) into one frozen `Launch`: the run's final
config, the typed `Strategy` with its mesh and resolved DeepSpeed config, and the environment it came from.
`recipes/train.py`, `recipes/trainer.py`, the doctor, `recipes/compare.py` and `recipes/plan_memory.py` take it;
nothing reads the environment, the YAML or the JSON again.

In order: the degrees of every axis, read here and nowhere else (`degrees`); the data-parallel ranks they leave,
from the one divisibility check (`Mesh.of_world`); the flags resolved against them (`RunConfig.resolve`: the
accumulation --global_batch_size gives, the accelerate config's precision); the DeepSpeed JSON's "auto" values from
the resolved flags; the strategy; then the checks of what could not run as asked, each in the module that owns it:
the family's (training/core/), and each axis's whose degree is above 1 (training/axes/), imported only then.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from training.axes.table import composes, wrapper
from training.config import RunConfig
from training.deepspeed_config import (
    autotp_size,
    data_parallel_size,
    load_json,
    resolve_deepspeed,
    sequence_parallel_size,
    zero_stage,
)
from training.environment import Environment
from training.mesh import FLAGS, Mesh
from training.strategy import Strategy, deepspeed_strategy, fsdp_strategy


@dataclass(frozen=True)
class Launch:
    """What was launched, resolved: read by every script and tool, never re-read."""

    cfg: RunConfig
    """The run's final config (every flag checked; accumulation and precision settled)."""
    strategy: Strategy
    """The data-parallel family, its mesh of every axis's degree, and the resolved DeepSpeed config."""
    environment: Environment = field(default_factory=Environment)
    """The launcher's variables it was resolved from."""

    @property
    def world(self) -> int:
        return self.strategy.world_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different data."""
        return self.strategy.data_parallel_size

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro x accumulation x data-parallel ranks."""
        return self.cfg.global_batch(self.strategy.data_parallel_size)


@dataclass(frozen=True)
class DeepSpeedJSON:
    """The DeepSpeed config a launch names, as written ("auto" unresolved), with the YAML's sequence-parallel degree
    joined in, and how messages name it."""

    raw: dict
    source: str


@dataclass(frozen=True)
class Launched:
    """What was launched, read but not yet resolved: the launcher's environment and the DeepSpeed JSON it names
    (None outside DeepSpeed), each read once; the degrees and the data-parallel wrapper follow from them."""

    environment: Environment
    deepspeed: DeepSpeedJSON | None = None

    @classmethod
    def read(cls, deepspeed_flag: str | None, env: Environment) -> Launched:
        """--deepspeed's JSON, the accelerate config's deepspeed_config_file, or the JSON accelerate builds from its
        inline deepspeed_config fields; opened here once per rank."""
        ds_file = deepspeed_flag or env.deepspeed_config_file
        if ds_file:
            raw, source = load_json(ds_file), repr(ds_file)
        elif env.deepspeed:
            raw, source = inline_deepspeed_config(env), "from the accelerate config's deepspeed_config"
        else:
            return cls(env)
        # The YAML's sequence-parallel degree joins the JSON, where DeepSpeed and the batch arithmetic read it.
        return cls(env, DeepSpeedJSON(with_sequence_parallel(raw, source, env.block_degree("sp_size")), source))

    def degrees(self, pipeline: int = 1, tensor_flag: int = 1) -> dict[str, int]:
        """Every model-parallel degree of the launch, read in this one place: the pipeline's from its flag
        (`pipeline`); tensor parallelism from the DeepSpeed JSON (AutoTP), the YAML's block (FSDP2, DDP) or the flag
        beside a pipeline (`tensor_flag`); Ulysses from the JSON (the YAML's joined in) or the block; ring context
        parallelism from the block."""
        env, ds = self.environment, self.deepspeed
        if ds is not None:
            tp, sp = autotp_size(ds.raw), sequence_parallel_size(ds.raw)
        else:
            tp, sp = max(env.block_degree("tp_size"), tensor_flag), env.block_degree("sp_size")
        return {"pp": pipeline, "cp": env.block_degree("cp_size"), "sp": sp, "tp": tp}

    @property
    def wrapper(self) -> str:
        """What holds the data-parallel copies (training/axes/table.py's `wrapper`): zeroN, fsdp, or ddp."""
        if self.deepspeed is not None:
            return wrapper("deepspeed", zero_stage(self.deepspeed.raw))
        return "fsdp" if self.environment.fsdp else "ddp"

    def data_parallel_ranks(self, cfg: RunConfig) -> int:
        """Ranks that train on different data: the world over the model-parallel degrees, read before
        `RunConfig.resolve`, which fixes the accumulation --global_batch_size gives from it. The same count as
        `Strategy.data_parallel_size`, which the loader, DeepSpeed and the resume check use."""
        world, ds = self.environment.world, self.deepspeed
        if ds is not None:
            check_pipeline_with_deepspeed(cfg, ds)
            return data_parallel_size(ds.raw, world, ds.source)  # refuses degrees that do not divide the world
        d = self.degrees(cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree)
        named = "--tensor_parallel_degree" if cfg.tensor_parallel_degree > 1 else "parallelism_config_tp_size"
        # refuses degrees that do not divide the world
        return Mesh.of_world(world, pp=d["pp"], cp=d["cp"], tp=d["tp"], flags={**FLAGS, "tp": named}).dp


def resolve_launch(parsed: RunConfig, environment: Environment | None = None) -> Launch:
    """The launch of `parsed` (the flags as parsed) under `environment` (this process's by default)."""
    env = Environment.read() if environment is None else environment
    launched = Launched.read(parsed.deepspeed, env)
    cfg = parsed.resolve(launched.data_parallel_ranks(parsed), env.precision)
    return Launch(cfg, requested_strategy(cfg, launched), env)


def inline_deepspeed_config(env: Environment) -> dict:
    """The DeepSpeed JSON that accelerate's `DeepSpeedPlugin` builds from an accelerate YAML's inline
    `deepspeed_config` fields (zero_stage, offload devices and NVMe paths, gradient_accumulation_steps,
    gradient_clipping), which `accelerate launch` exports as ACCELERATE_* variables. Built by the plugin itself,
    under those variables, so it is exactly accelerate's reading; it then goes through `resolve_deepspeed` like any
    JSON."""
    from accelerate.utils import DeepSpeedPlugin, patch_environment

    with patch_environment(**env.variables):
        ds = DeepSpeedPlugin().deepspeed_config
    ds.pop("steps_per_print", None)  # the plugin's float("inf"), which is not JSON; the resolved config sets none
    return ds


def with_sequence_parallel(ds: dict, source: str, from_yaml: int) -> dict:
    """The DeepSpeed JSON `ds` with the launch's sequence-parallel degree in it: the accelerate YAML's
    `parallelism_config_sp_size` (`from_yaml`) or the JSON's own `sequence_parallel_size`; the two must agree where
    both are given."""
    from_json = int(ds.get("sequence_parallel_size", 1) or 1)
    if from_yaml > 1 and from_json > 1 and from_yaml != from_json:
        raise ValueError(
            f"the accelerate config's parallelism_config_sp_size is {from_yaml} but the DeepSpeed config {source} "
            f"sets sequence_parallel_size: {from_json}; give the degree in one of them, or the same in both"
        )
    sp = max(from_yaml, from_json)
    return {**ds, "sequence_parallel_size": sp} if sp > 1 else ds


# ---------------------------------------------------------------------------------------------- the strategy


def requested_strategy(cfg: RunConfig, launched: Launched) -> Strategy:
    """The strategy of this launch, from the resolved flags `cfg` and what was `launched` (the DeepSpeed JSON's
    "auto" values resolved from `cfg`), after the checks that refuse what could not run. No process group is
    created."""
    from training.axes.sequence import check_context_parallel, check_sequence_parallel
    from training.core.launch_checks import (
        check_fsdp1,
        check_fsdp1_checkpoints,
        check_parallelism_config_tp,
        check_tensor_parallel_flag,
    )

    env, ds, world = launched.environment, launched.deepspeed, launched.environment.world
    if ds is not None and env.fsdp:
        raise ValueError(
            "both DeepSpeed and FSDP are requested (--deepspeed or a DeepSpeed accelerate config, and an FSDP "
            "accelerate config): launch with one of them"
        )
    d = launched.degrees(cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree)
    yaml_tp = env.block_degree("tp_size")
    check_parallelism_config_tp(yaml_tp, ds is not None, env.fsdp_version, cfg, env, world)
    check_tensor_parallel_flag(cfg, ds is not None, env.fsdp, yaml_tp)
    held_by = launched.wrapper  # for the axes table's checks (training/axes/table.py)
    check_sequence_parallel(cfg, cfg.model_config() if d["sp"] > 1 else None, d["sp"], world, held_by, env)
    check_context_parallel(cfg, d["cp"], held_by, env.fsdp_version, torch.cuda.is_available())
    if ds is not None:
        check_pipeline_with_deepspeed(cfg, ds)
        resolved = resolve_deepspeed(ds.raw, cfg, world, cfg.model_config().hidden_size, ds.source,
                                     cpu_ranks=not torch.cuda.is_available())  # fmt: skip
        return deepspeed_strategy(resolved, world, ds.source)
    pipeline = pipeline_fields(cfg)
    if env.fsdp:
        if env.fsdp_version == 1:
            check_fsdp1_checkpoints(cfg, env.fsdp_env)
            check_fsdp1(env.fsdp_env)
        replicas = hybrid_replicas(env, world, d["cp"], yaml_tp, d["pp"])
        strategy = fsdp_strategy(env.fsdp_env, world, replicas, cp=d["cp"], tp=yaml_tp, **pipeline)
        check_pipeline_with_fsdp(cfg, strategy)
    elif yaml_tp > 1 and d["pp"] == 1:
        strategy = replicated_tensor_parallel(world, yaml_tp)
    else:
        strategy = replicated_strategy(world, pipeline, d["tp"])
    if strategy.mesh.pp > 1:  # CPU ranks run gloo (training/core/accelerator.py)
        from training import compat
        from training.axes.schedules import check_schedule_on_gloo

        check_schedule_on_gloo(strategy.pp_schedule, not torch.cuda.is_available(), compat.pipeline_sends_to_own_rank())
    return strategy


def replicated_tensor_parallel(world: int, tp: int) -> Strategy:
    """DDP x TP: a DDP YAML's parallelism_config (dp_replicate x tp). torch's DDP reducer takes no DTensor, so the
    whole copies of the split model are held by FSDP2 on a replicate-only mesh (dp_replicate x a dp_shard of 1), which
    is what torch's own DTensor-aware DDP (`torch.distributed._composable.replicate_with_fsdp.replicate`) builds: each
    data-parallel rank keeps its slices whole, and their gradients are all-reduced across the copies, DDP's
    traffic. The strategy is that hybrid FSDP2 x TP (`fsdp-hybrid-tpN`), trained and checked as such."""
    return Strategy.of("fsdp", world, tp=tp, replicas=world // tp, fsdp_version=2, fsdp_env={"FSDP_VERSION": "2"})


def hybrid_replicas(env: Environment, world: int, cp: int = 1, tp: int = 1, pp: int = 1) -> int:
    """Hybrid sharding: the copies of the model an accelerate parallelism_config keeps, each sharded over its
    dp_shard x cp ranks of tp-way split layers in each of pp pipeline stages (the shards replicated over the rest);
    1 without the block or its dp_shard_size. `accelerate launch` exports every size of the block, 1 where the YAML
    has none."""
    if (env.block or {}).get("dp_replicate_size"):  # named: accelerate's own count of the copies
        return env.block_degree("dp_replicate_size")
    shard = env.block_degree("dp_shard_size", default=world)
    return -(-world // (shard * cp * tp * pp))


def pipeline_fields(cfg: RunConfig) -> dict:
    """The Strategy fields of the pipeline flags."""
    return {"pp": cfg.pipeline_parallel_degree, "pp_schedule": cfg.pipeline_parallel_schedule,
            "pp_stages_per_rank": cfg.pipeline_stages_per_rank}  # fmt: skip


def replicated_strategy(world: int, pipeline: dict, tp: int = 1) -> Strategy:
    """DDP, or one process; the ranks of a pipeline train one batch, so there is no DDP among them, nor among the
    `tp` ranks that split each of its stages' layers."""
    strategy = Strategy.of("ddp", world, tp=tp, **pipeline)
    return strategy if strategy.data_parallel_size > 1 else replace(strategy, family="single")


def check_pipeline_with_deepspeed(cfg: RunConfig, ds: DeepSpeedJSON) -> None:
    """Pipeline parallelism runs with one process's optimizer, DDP or FSDP2 across the pipelines; a DeepSpeed engine
    wraps the whole model and steps it itself (DeepSpeed's own pipeline engine needs the model rewritten as its
    `PipelineModule`, and allows ZeRO-0/1 only)."""
    if cfg.pipeline_parallel_degree == 1 or composes("pp", wrapper("deepspeed", zero_stage(ds.raw))):
        return
    what = f"ZeRO-{zero_stage(ds.raw)}" + (" with AutoTP" if autotp_size(ds.raw) > 1 else "")
    raise ValueError(
        f"--pipeline_parallel_degree {cfg.pipeline_parallel_degree} with the DeepSpeed config {ds.source} ({what}): "
        "the pipeline's stages are run by torch.distributed.pipelining, and a DeepSpeed engine would wrap and step "
        "the whole model; launch the pipeline with accelerate_configs/ddp.yaml or fsdp.yaml (FSDP2 shards each "
        "stage over the data-parallel ranks, as ZeRO-3 would), or torchrun without --deepspeed"
    )


def check_pipeline_with_fsdp(cfg: RunConfig, strategy: Strategy) -> None:
    """Under pipeline parallelism FSDP2 shards each stage over the data-parallel ranks (training/axes/pipeline.py);
    FSDP1's flat parameters, hybrid replicas and CPU offload are not built there."""
    from training.axes.schedules import ZERO_BUBBLE

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
