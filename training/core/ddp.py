"""One process and DDP: every rank holds the whole model, accelerate's `prepare` wraps it in torch's
DistributedDataParallel, whose reducer all-reduces the gradients in buckets during the backward.

What the project adds around that call is little: the strategy read from the launch (one process, DDP, or the
ranks of a pipeline, which train one batch and so have no DDP among them), gloo on CPU ranks, a check that the
prepared model is DDP, and the family's defaults (training/core/family.py) for the rest: the model built whole from
the seed, the gradient norm summed in float64 on each rank (every gradient is whole there), the export of the
model inside DDP, and checkpoints as accelerate writes them (`model.safetensors`, `optimizer.bin`).
"""

from __future__ import annotations

from dataclasses import replace

from training.config import RunConfig
from training.core.family import Family
from training.deepspeed_config import DeepSpeedJSON
from training.environment import Environment
from training.strategy import Strategy


class Replicated(Family):
    """One process, or whole copies under DDP."""

    def strategy(self, cfg: RunConfig, env: Environment, degrees: dict, ds: DeepSpeedJSON | None) -> Strategy:
        """DDP on the launched ranks, or one process; a DDP YAML's parallelism_config of dp_replicate x tp is DDP x
        TP (`replicated_tensor_parallel`). The ranks of a pipeline train one batch, so there is no DDP among them,
        nor among the `tp` ranks that split each of its stages' layers."""
        yaml_tp = env.block_degree("tp_size")
        if yaml_tp > 1 and degrees["pp"] == 1:
            return replicated_tensor_parallel(env.world, yaml_tp)
        return replicated_strategy(env.world, pipeline_fields(cfg), degrees["tp"])


def replicated_strategy(world: int, pipeline: dict, tp: int = 1) -> Strategy:
    """DDP on `world` ranks with the pipeline's fields and `tp` ranks splitting each stage's layers; "single" where
    no two ranks train on different data."""
    strategy = Strategy.of("ddp", world, tp=tp, **pipeline)
    return strategy if strategy.data_parallel_size > 1 else replace(strategy, family="single")


def replicated_tensor_parallel(world: int, tp: int) -> Strategy:
    """DDP x TP: a DDP YAML's parallelism_config (dp_replicate x tp). torch's DDP reducer takes no DTensor, so the
    whole copies of the split model are held by FSDP2 on a replicate-only mesh (dp_replicate x a dp_shard of 1), which
    is what torch's own DTensor-aware DDP (`torch.distributed._composable.replicate_with_fsdp.replicate`) builds: each
    data-parallel rank keeps its slices whole, and their gradients are all-reduced across the copies, DDP's
    traffic. The strategy is that hybrid FSDP2 x TP (`fsdp-hybrid-tpN`), trained and checked as such."""
    return Strategy.of("fsdp", world, tp=tp, replicas=world // tp, fsdp_version=2, fsdp_env={"FSDP_VERSION": "2"})


def pipeline_fields(cfg: RunConfig) -> dict:
    """The Strategy fields of the pipeline flags."""
    return {"pp": cfg.pipeline_parallel_degree, "pp_schedule": cfg.pipeline_parallel_schedule,
            "pp_stages_per_rank": cfg.pipeline_stages_per_rank}  # fmt: skip


FAMILY = Replicated()
