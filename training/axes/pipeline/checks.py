"""A pipeline launch's checks, before any process group: the data-parallel family that holds the stages (a
DeepSpeed engine would wrap and step the whole model; FSDP2 shards each stage, but not as FSDP1, hybrid or offloaded),
and the schedule on gloo. Imported only by a launch with pipeline stages."""

from __future__ import annotations

import torch

from training import compat
from training.axes.pipeline.schedules import ZERO_BUBBLE, check_schedule_on_gloo
from training.axes.table import composes, wrapper
from training.config import RunConfig
from training.deepspeed_config import DeepSpeedJSON, autotp_size, zero_stage
from training.strategy import Strategy


def check_pipeline_launch(cfg: RunConfig, strategy: Strategy) -> None:
    """The pipeline's stages under the launch's family, and its schedule on CPU ranks (gloo)."""
    if strategy.family == "fsdp":
        check_pipeline_with_fsdp(cfg, strategy)
    check_schedule_on_gloo(strategy.pp_schedule, not torch.cuda.is_available(), compat.pipeline_sends_to_own_rank())


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
    """Under pipeline parallelism FSDP2 shards each stage over the data-parallel ranks (runtime.py);
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
