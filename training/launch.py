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

import logging
import math
from dataclasses import dataclass, field, replace

import torch

from training.axes.table import wrapper
from training.config import RunConfig
from training.core.family import family_named
from training.deepspeed_config import (
    DeepSpeedJSON,
    autotp_size,
    data_parallel_size,
    load_json,
    sequence_parallel_size,
    zero_stage,
)
from training.environment import Environment
from training.mesh import FLAGS, Mesh
from training.strategy import Strategy

logger = logging.getLogger("shardgpt")


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
            if cfg.pipeline_parallel_degree > 1:
                from training.axes.pipeline.checks import check_pipeline_with_deepspeed

                check_pipeline_with_deepspeed(cfg, ds)  # a DeepSpeed engine steps the whole model
            return data_parallel_size(ds.raw, world, ds.source)  # refuses degrees that do not divide the world
        d = self.degrees(cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree)
        named = "--tensor_parallel_degree" if cfg.tensor_parallel_degree > 1 else "parallelism_config_tp_size"
        # refuses degrees that do not divide the world
        return Mesh.of_world(world, pp=d["pp"], cp=d["cp"], tp=d["tp"], flags={**FLAGS, "tp": named}).dp


def resolve_launch(parsed: RunConfig, environment: Environment | None = None) -> Launch:
    """The launch of `parsed` (the flags as parsed) under `environment` (this process's by default)."""
    env = Environment.read() if environment is None else environment
    if env.restart and parsed.resume_from_checkpoint is None:  # a restarted generation continues the run
        logger.info("restart %d of the launcher's workers: resuming from the newest intact checkpoint", env.restart)
        parsed = replace(parsed, resume_from_checkpoint="auto")
    launched = Launched.read(parsed.deepspeed, env)
    data_parallel = launched.data_parallel_ranks(parsed)
    if env.restart:
        parsed = keep_global_batch(parsed, data_parallel)
    cfg = parsed.resolve(data_parallel, env.precision)
    return Launch(cfg, requested_strategy(cfg, launched), env)


def keep_global_batch(parsed: RunConfig, data_parallel: int) -> RunConfig:
    """A restarted generation keeps the global batch of the checkpoint it resumes from: under an elastic range
    (`torchrun --nnodes 1:2`) it may have re-formed on fewer ranks, whose accumulation then grows. Refused in one line,
    before any process group, when the ranks left cannot make that batch; --global_batch_size, when given, rules."""
    from training.checkpoints.checkpoint import resume_candidate  # imported by a restarted generation only

    path, state = resume_candidate(parsed.resume_from_checkpoint, parsed.output_dir)
    if state is None or parsed.global_batch_size is not None:
        return parsed
    was, micro = state["loader"]["global_batch_size"], parsed.per_device_train_batch_size
    if was % (micro * data_parallel):
        raise ValueError(
            f"restarted on {data_parallel} data-parallel ranks, the run cannot keep the global batch of {was} that "
            f"{path.name} trained with: micro {micro} x {data_parallel} ranks does not divide it; pass a "
            f"--per_device_train_batch_size that does, or give the elastic range (--nnodes) only node counts that do"
        )
    if was != micro * parsed.gradient_accumulation_steps * data_parallel:
        logger.info("keeping %s's global batch of %d on %d data-parallel ranks: accumulation %d", path.name, was,
                    data_parallel, was // (micro * data_parallel))  # fmt: skip
    return replace(parsed, global_batch_size=was, gradient_accumulation_steps=1)


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
    """The strategy of this launch, from the resolved flags `cfg` and what was `launched`, built by its family
    (training/core/: the DeepSpeed JSON's "auto" values resolved from `cfg`, FSDP's variables read), after the
    checks of each model-parallel axis whose degree is above 1 (training/axes/, imported only then). No process group
    is created."""
    env, ds = launched.environment, launched.deepspeed
    if ds is not None and env.fsdp:
        raise ValueError(
            "both DeepSpeed and FSDP are requested (--deepspeed or a DeepSpeed accelerate config, and an FSDP "
            "accelerate config): launch with one of them"
        )
    d = launched.degrees(cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree)
    yaml_tp = env.block_degree("tp_size")
    if yaml_tp > 1 or cfg.tensor_parallel_degree > 1:  # tensor parallelism of the YAML's block, or the flag's
        from training.axes.tensor.checks import check_parallelism_config_tp, check_tensor_parallel_flag

        check_parallelism_config_tp(yaml_tp, ds is not None, env.fsdp_version, cfg, env)
        check_tensor_parallel_flag(cfg, ds is not None, env.fsdp, yaml_tp)
    if d["sp"] > 1:  # Ulysses
        from training.axes.ulysses import check_sequence_parallel

        check_sequence_parallel(cfg, cfg.model_config(), d["sp"], env.world, launched.wrapper, env)
    if d["cp"] > 1:  # ring context parallelism
        from training.axes.context import check_context_parallel

        check_context_parallel(cfg, d["cp"], launched.wrapper, env.fsdp_version, torch.cuda.is_available())
    check_block_covers_the_world(env, d["pp"])
    family = family_named("deepspeed" if ds is not None else "fsdp" if env.fsdp else "ddp", env.fsdp_version)
    strategy = family.strategy(cfg, env, d, ds)  # training/core/ddp.py, fsdp.py, fsdp1.py or zero.py
    if cfg.save_async and strategy.pp_size == 1 and (why := family.async_refusal(strategy)):
        raise ValueError(why)
    if cfg.optim == "muon" and (why := muon_refusal(family, strategy)):
        raise ValueError(why)
    if strategy.pp_size > 1:  # the stages under the family, the schedule on gloo
        from training.axes.pipeline.checks import check_pipeline_launch

        check_pipeline_launch(cfg, strategy)
    return strategy


def muon_refusal(family, strategy: Strategy) -> str | None:
    """Why --optim muon cannot run under `strategy`: an axis that splits matrices (tensor parallelism) or holds a
    layout Muon's gather is not proven on (ring context, Ulysses), an offloaded optimizer, or its family's reason."""
    for name, degree in (("tensor", strategy.tp_size), ("sequence (Ulysses)", strategy.sp_size),
                         ("ring context", strategy.cp_size)):  # fmt: skip
        if degree > 1:
            return (
                f"--optim muon with {name} parallelism of degree {degree}: Muon orthogonalizes each matrix "
                "whole and is proven here on DDP, FSDP2, ZeRO-1/2/3 and pipelines only; drop the "
                f"{name} degree, or --optim adamw_torch"
            )
    if strategy.offloads:  # DeepSpeed steps offloaded states with its CPU Adam, FSDP2 on CPU shards
        return (
            f"--optim muon under {strategy.name}: an offloaded optimizer is stepped on CPU by DeepSpeed's CPU Adam or "
            "FSDP's offloaded shards, which Muon's gather does not reach; use a launch config without offload "
            "(ds_configs/zero3.json, accelerate_configs/fsdp.yaml), or --optim adamw_torch"
        )
    return family.muon_refusal(strategy)


def check_block_covers_the_world(env: Environment, pp: int) -> None:
    """The YAML's parallelism_config degrees times the pipeline's must be the launched ranks, as accelerate itself
    requires of a block (which under FSDP2 x TP and on CPU ranks it is not shown: training/core/fsdp.py). Read as
    `accelerate launch` exports it (1 where the YAML gives no size); a block without its dp_shard_size is not
    checked (accelerate fills it in)."""
    block = env.block or {}
    if not block.get("dp_shard_size"):
        return
    sizes = {key: env.block_degree(f"{key}_size") for key in ("dp_replicate", "dp_shard", "cp", "sp", "tp")}
    ranks = math.prod(sizes.values()) * pp
    if ranks == env.world:
        return
    product = " x ".join(f"{key}_size {n}" for key, n in sizes.items() if n > 1 or key.startswith("dp"))
    product += f" x --pipeline_parallel_degree {pp}" if pp > 1 else ""
    others = ranks // sizes["dp_shard"]
    fits = env.world // others if env.world % others == 0 else None
    fix = f"set parallelism_config_dp_shard_size: {fits}" if fits else f"launch {ranks} ranks"
    raise ValueError(
        f"the accelerate config's parallelism_config gives {product} = {ranks} ranks, but {env.world} were launched: "
        f"{fix} (accelerate requires the block's degrees to multiply to the launched ranks)"
    )
