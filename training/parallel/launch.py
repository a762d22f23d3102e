"""The launch read before any process group: the launcher's environment (world size, precision, the accelerate
YAML's exports), the DeepSpeed JSON it names, and from them the typed `Strategy` (`requested_strategy`), with the
checks of the pipeline flags against the data-parallel wrapper.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
from accelerate.utils import DeepSpeedPlugin

from training import compat
from training.config import RunConfig
from training.parallel.axes import composes, wrapper
from training.parallel.deepspeed_config import (
    autotp_size,
    data_parallel_size,
    load_json,
    resolve_deepspeed,
    sequence_parallel_size,
    zero_stage,
)
from training.parallel.launch_checks import (
    check_fsdp1,
    check_fsdp1_checkpoints,
    check_parallelism_config_tp,
    check_tensor_parallel_flag,
)
from training.parallel.mesh import FLAGS, Mesh, block_degree, parallelism_block
from training.parallel.schedules import ZERO_BUBBLE, check_schedule_on_gloo
from training.parallel.sequence import (
    check_context_parallel,
    check_sequence_parallel,
    with_sequence_parallel,
    yaml_context_parallel_size,
    yaml_sequence_parallel_size,
)
from training.parallel.strategy import Strategy, deepspeed_strategy, fsdp_strategy, fsdp_version

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
    fsdp_env = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
    tp = yaml_tensor_parallel_size()
    check_parallelism_config_tp(tp, launched is not None, fsdp_version(fsdp_env) if use_fsdp else 0, cfg, world)
    check_tensor_parallel_flag(cfg, launched is not None, use_fsdp, tp)
    # The data-parallel wrapper, for the axes table's checks (training/parallel/axes.py).
    held_by = wrapper("deepspeed", zero_stage(launched[0])) if launched else "fsdp" if use_fsdp else "ddp"
    sp = sequence_parallel_size(launched[0]) if launched else yaml_sequence_parallel_size()
    check_sequence_parallel(cfg, cfg.model_config() if sp > 1 else None, sp, world, held_by)
    cp = yaml_context_parallel_size()
    check_context_parallel(cfg, cp, held_by, fsdp_version(fsdp_env) if use_fsdp else 0, torch.cuda.is_available())
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
        strategy = fsdp_strategy(
            fsdp_env, world, hybrid_replicas(world, cp, tp, cfg.pipeline_parallel_degree), cp=cp, tp=tp, **pipeline
        )
        check_pipeline_with_fsdp(cfg, strategy)
    elif tp > 1 and cfg.pipeline_parallel_degree == 1:
        strategy = replicated_tensor_parallel(world, tp)
    else:
        strategy = replicated_strategy(world, pipeline, max(tp, cfg.tensor_parallel_degree))
    if strategy.mesh.pp > 1:  # CPU ranks run gloo (training/parallel/accelerator.py)
        check_schedule_on_gloo(strategy.pp_schedule, not torch.cuda.is_available(), compat.pipeline_sends_to_own_rank())
    return strategy


def replicated_tensor_parallel(world: int, tp: int) -> Strategy:
    """DDP x TP: a DDP YAML's parallelism_config (dp_replicate x tp). torch's DDP reducer takes no DTensor, so the
    whole copies of the split model are held by FSDP2 on a replicate-only mesh (dp_replicate x a dp_shard of 1), which
    is what torch's own DTensor-aware DDP (`torch.distributed._composable.replicate_with_fsdp.replicate`) builds: each
    data-parallel rank keeps its slices whole, and their gradients are all-reduced across the copies, DDP's
    traffic. The strategy is that hybrid FSDP2 x TP (`fsdp-hybrid-tpN`), trained and checked as such."""
    return Strategy.of("fsdp", world, tp=tp, replicas=world // tp, fsdp_version=2, fsdp_env={"FSDP_VERSION": "2"})


def hybrid_replicas(world: int, cp: int = 1, tp: int = 1, pp: int = 1) -> int:
    """Hybrid sharding: the copies of the model an accelerate parallelism_config keeps, each sharded over its
    dp_shard x cp ranks of tp-way split layers in each of pp pipeline stages (the shards replicated over the rest);
    1 without the block or its dp_shard_size. `accelerate launch` exports every size of the block, 1 where the YAML
    has none; a block read from the YAML itself (the doctor) may lack dp_replicate_size."""
    if (parallelism_block() or {}).get("dp_replicate_size"):  # named: accelerate's own count of the copies
        return block_degree("dp_replicate_size")
    shard = block_degree("dp_shard_size", default=world)
    return math.ceil(world / (shard * cp * tp * pp))


def yaml_tensor_parallel_size() -> int:
    """The accelerate YAML's parallelism_config_tp_size (1 without it): tensor parallelism under FSDP2."""
    return block_degree("tp_size")


def pipeline_fields(cfg: RunConfig) -> dict:
    """The Strategy fields of the pipeline flags."""
    return {"pp": cfg.pipeline_parallel_degree, "pp_schedule": cfg.pipeline_parallel_schedule,
            "pp_stages_per_rank": cfg.pipeline_stages_per_rank}  # fmt: skip


def replicated_strategy(world: int, pipeline: dict, tp: int = 1) -> Strategy:
    """DDP, or one process; the ranks of a pipeline train one batch, so there is no DDP among them, nor among the
    `tp` ranks that split each of its stages' layers."""
    strategy = Strategy.of("ddp", world, tp=tp, **pipeline)
    return strategy if strategy.data_parallel_size > 1 else replace(strategy, family="single")


def check_pipeline_with_deepspeed(cfg: RunConfig, raw: dict, source: str) -> None:
    """Pipeline parallelism runs with one process's optimizer, DDP or FSDP2 across the pipelines; a DeepSpeed engine
    wraps the whole model and steps it itself (DeepSpeed's own pipeline engine needs the model rewritten as its
    `PipelineModule`, and allows ZeRO-0/1 only)."""
    if cfg.pipeline_parallel_degree == 1 or composes("pp", wrapper("deepspeed", zero_stage(raw))):
        return
    what = f"ZeRO-{zero_stage(raw)}" + (" with AutoTP" if autotp_size(raw) > 1 else "")
    raise ValueError(
        f"--pipeline_parallel_degree {cfg.pipeline_parallel_degree} with the DeepSpeed config {source} ({what}): "
        "the pipeline's stages are run by torch.distributed.pipelining, and a DeepSpeed engine would wrap and step "
        "the whole model; launch the pipeline with accelerate_configs/ddp.yaml or fsdp.yaml (FSDP2 shards each "
        "stage over the data-parallel ranks, as ZeRO-3 would), or torchrun without --deepspeed"
    )


def check_pipeline_with_fsdp(cfg: RunConfig, strategy: Strategy) -> None:
    """Under pipeline parallelism FSDP2 shards each stage over the data-parallel ranks (training/parallel/pipeline.py);
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
    launched = launched_deepspeed_config(cfg)
    tp = 1 if launched else max(yaml_tensor_parallel_size(), cfg.tensor_parallel_degree)
    return data_parallel_ranks(cfg, launched_world_size(), launched, yaml_context_parallel_size(), tp)


def data_parallel_ranks(cfg: RunConfig, world: int, launched: tuple[dict, str] | None, cp: int = 1,
                        tp: int = 1) -> int:  # fmt: skip
    """`launched_data_parallel_size` for `world` ranks, the DeepSpeed config `launched` ((JSON, how messages
    name it), or None), `cp` ring-context-parallel ranks a sequence and `tp` tensor-parallel ranks a layer (the
    YAML's, under FSDP2), as the doctor reads them from a launch's files."""
    named = "--tensor_parallel_degree" if cfg.tensor_parallel_degree > 1 else "parallelism_config_tp_size"
    flags = {**FLAGS, "tp": named}
    # refuses degrees that do not divide the world
    mesh = Mesh.of_world(world, pp=cfg.pipeline_parallel_degree, cp=cp, tp=tp, flags=flags)
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
