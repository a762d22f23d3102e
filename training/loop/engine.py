"""What the training loop drives: the model, its optimizer and schedule, prepared for the launch's strategy, with
one `step`, `evaluate` and `full_state_dict` whichever axes are on.

`prepare` builds it from the typed strategy: the whole model on every rank, wrapped by accelerate (DDP, FSDP or a
DeepSpeed engine: `Replicated`), its family's module (training/core/) doing what differs; or this rank's pipeline
stages, run by torch.distributed.pipelining's schedules with DDP's all-reduce or FSDP2 across the pipelines
(`Pipelined`, training/axes/pipeline/). An axis's module is imported only where its degree is above 1. The loop does
not ask which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from model import ShardGPTConfig
from training.checkpoints.background import BackgroundSaves, finish_saves
from training.checkpoints.checkpoint import save_checkpoint
from training.config import RunConfig
from training.core.build import build_model
from training.core.family import Family, family_of
from training.core.inspection import StateShares, observe_strategy, refusal, verify_strategy
from training.core.wrapped import uncompiled, unwrap
from training.loop.evaluate import evaluate
from training.loop.optim import make_optimizer, make_scheduler
from training.loop.step import StepResult, accumulated_loss_scale, pipelined_step, train_step
from training.strategy import Strategy

if TYPE_CHECKING:
    from training.axes.pipeline.runtime import Pipeline


@dataclass
class Engine:
    """The prepared model, optimizer and schedule, and what the loop calls on them."""

    accelerator: Accelerator
    strategy: Strategy
    cfg: RunConfig
    net: torch.nn.Module
    optimizer: object
    scheduler: object
    shares: StateShares = field(init=False)
    saves: BackgroundSaves = field(init=False)

    def __post_init__(self):
        self.shares = StateShares(self.optimizer)  # gradient and optimizer-state shares, read after the first step
        self.saves = BackgroundSaves(self.accelerator.process_index, self.accelerator.num_processes)

    @property
    def family(self) -> Family:
        return family_of(self.strategy)

    def unwrapped(self) -> torch.nn.Module:
        """The model as transformers sees it (its config, `save_pretrained`)."""
        return unwrap(self.accelerator, uncompiled(self.net))

    def save(self, output_dir: str, step: int, state: dict, limit: int | None) -> Path:
        """A resumable checkpoint (collective: every rank saves its share); with --save_async the step waits only
        for the copy of its state, the files written in the background by its family's `save_async`."""
        return save_checkpoint(self.accelerator, output_dir, step, state, limit, self.write_state, self.saves,
                               self.copy_state if self.cfg.save_async else None)  # fmt: skip

    write_state = None  # accelerate's save_state writes the checkpoint

    def copy_state(self, path: Path) -> list:
        """--save_async: this rank's share copied, the small files written; the writes left for the background."""
        return self.family.save_async(self.accelerator, self.net, self.optimizer, self.scheduler, path,
                                      self.saves.staged)  # fmt: skip

    def finish_saves(self) -> None:
        """Wait for the checkpoint written in the background, if any (collective: its failure raised on every
        rank)."""
        finish_saves(self.accelerator, self.saves, self.cfg.output_dir)


@dataclass
class Replicated(Engine):
    """The whole model on every rank, as accelerate's `prepare` wrapped it: DDP, FSDP or a DeepSpeed engine."""

    def in_force(self) -> dict:
        seen = verify_in_force(self.accelerator, self.net, self.strategy)  # refuses a run not sharded as asked
        return seen | observe_strategy(self.net, self.optimizer, self.strategy)  # engine, optimizer, offload, ...

    def step(self, micro_batches: list[dict], step: int) -> StepResult:
        # Token-weighted accumulation across micro batches and data-parallel ranks (see training/loop/step.py); under
        # sequence parallelism DeepSpeed's own divisor, which depends on the ZeRO stage (`Strategy.gradient_divisor`).
        s = self.strategy
        loss_scale = accumulated_loss_scale(s, self.cfg.gradient_accumulation_steps)
        context = None
        if s.cp_size > 1:  # CUDA only: ring attention shards each micro batch's positions
            from training.axes.context import context_parallel

            context = context_parallel(self.accelerator)
        shards = self.family.norm_group(self.net, s)  # FSDP1's gradients' ranks, for the norm
        return train_step(self.accelerator, self.net, self.optimizer, self.scheduler, micro_batches, loss_scale,
                          self.cfg.max_grad_norm, step, s.tp_size, context, shards)  # fmt: skip

    def evaluate(self, blocks, dp: int, dp_rank: int) -> float | None:
        return evaluate(self.accelerator, self.net, blocks, self.cfg, dp, dp_rank)  # collective: reduced sums

    def export_parts(self):
        """The whole model's weights in parts, for rank 0 to write one by one (collectives: every rank iterates)."""
        return self.family.export_parts(self.accelerator, uncompiled(self.net))  # FSDP2, ZeRO-3: gathered in turn


@dataclass
class Pipelined(Engine):
    """This rank's pipeline stages (training/axes/pipeline/runtime.py), with DDP's all-reduce or FSDP2 across the
    pipelines."""

    pipeline: Pipeline | None = None

    def in_force(self) -> dict:
        from training.axes.pipeline.runtime import verify_pipeline

        seen = verify_pipeline(self.accelerator, self.pipeline.in_force(), self.strategy)  # refuses another layout
        seen |= observe_strategy(self.net, self.optimizer, self.strategy)
        seen["autocast"] = self.accelerator.mixed_precision != "no"  # the schedule runs inside accelerate's autocast
        return seen

    def step(self, micro_batches: list[dict], step: int) -> StepResult:
        # collectives inside: the stages' sends, the tied gradient, the data-parallel reduction, the norm, the loss
        return pipelined_step(self.pipeline, micro_batches, self.optimizer, self.scheduler, self.cfg.max_grad_norm,
                              step, self.accelerator.autocast, self.accelerator)  # fmt: skip

    def evaluate(self, blocks, dp: int, dp_rank: int) -> float | None:
        sums = partial(self.pipeline.eval_sums, autocast=self.accelerator.autocast)  # the stages' sends inside
        return evaluate(self.accelerator, self.net, blocks, self.cfg, dp, dp_rank, sums)  # collective: reduced sums

    def export_parts(self):
        yield self.pipeline.full_state_dict()  # collective: the stages' weights gathered on every rank, one part

    def unwrapped(self) -> torch.nn.Module:
        return uncompiled(self.net)  # the model with this rank's stages; its config is the whole model's

    def copy_state(self, path: Path) -> list:
        """--save_async: the stages' state dicts (as `write_state` takes them) by torch.distributed.checkpoint's
        `async_save`, copied now, written in the background."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from training.core.staging import dcp_async_save

        weights, optimizer = get_state_dict(self.net, self.optimizer)  # FSDP2: this rank's shards
        return dcp_async_save(self.accelerator, self.scheduler, path, weights, optimizer, self.saves.staged)

    def write_state(self, path: Path) -> None:
        """The stages' weights and AdamW's states as torch.distributed.checkpoint folders laid out as FSDP2's
        (`pytorch_model_fsdp_0`, `optimizer_0`): each rank writes its stages' tensors under their HF names, the
        data-parallel copies once, so any strategy reads them back through the neutral form
        (training/checkpoints/portable.py). Beside them accelerate's files: every rank's RNG states, and rank 0's
        scheduler."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.accelerator.save_state(str(path))  # collective: the RNG states (no model is registered with accelerate)
        weights, optimizer = get_state_dict(self.net, self.optimizer)  # FSDP2: this rank's shards
        dcp.save({"model": weights}, checkpoint_id=path / "pytorch_model_fsdp_0")  # collective: every rank's part
        dcp.save({"optimizer": optimizer}, checkpoint_id=path / "optimizer_0")  # collective
        if self.accelerator.is_main_process:  # rank 0 only: the schedule is the same on every rank
            torch.save(self.scheduler.state_dict(), path / "scheduler.bin")


def verify_in_force(accelerator: Accelerator, net: torch.nn.Module, strategy: Strategy) -> dict:
    """Refuse to train unless the prepared model is what the launch asked for: wrapped and sharded by its family
    (training/core/inspection.py), its layers split as the tensor-parallel plan says, its attention Ulysses'; each
    axis verified by its own module, imported only where its degree is above 1. Returns what was seen."""
    seen = verify_strategy(accelerator, net, strategy)
    refuse = refusal(strategy, seen)
    model = uncompiled(net)
    if strategy.tp_size > 1:
        from training.axes.tensor.checks import verify_tensor_parallel

        seen["tensor_parallel"] = verify_tensor_parallel(model, unwrap(accelerator, model), strategy, refuse)
    if strategy.sp_size > 1:
        from training.axes.ulysses import verify_ulysses

        seen["sequence_parallel"] = verify_ulysses(model, unwrap(accelerator, model), strategy, refuse)
    return seen


def build_net(cfg: RunConfig, strategy: Strategy, accelerator: Accelerator, config: ShardGPTConfig,
              tokenizer) -> torch.nn.Module:  # fmt: skip
    """The model as `prepare` builds it, before a pipeline keeps its stages and before `accelerator.prepare`: under
    FSDP2 x TP already split and sharded (collective: the device mesh)."""
    pipelined = strategy.pp_size > 1
    # a pipeline splits its stages itself; DeepSpeed's engine builds AutoTP
    tensor_parallel = strategy.family == "fsdp" and strategy.tp_size > 1 and not pipelined
    net = build_model(config, tokenizer, cfg.gradient_checkpointing, cfg.model_name_or_path,
                      None if pipelined or tensor_parallel else accelerator, cfg.torch_compile)  # fmt: skip
    if tensor_parallel:  # collective: the device mesh; the plan's slices over tp, FSDP2 over the data-parallel ranks
        from training.axes.tensor.plan import shard_tensor_parallel
        from training.core.fsdp import fsdp_precision

        # accelerate's plugin finds the YAML's wrap classes by name in the model, which FSDP2 renames
        # (FSDPShardGPTDecoderLayer): resolved before sharding, as accelerate's own FSDP2 preparation does.
        accelerator.state.fsdp_plugin.set_auto_wrap_policy(net)
        policy = fsdp_precision(cfg) if cfg.mixed_precision != "no" else None
        net = shard_tensor_parallel(net, strategy, accelerator.device, policy)
    return net


def prepare(cfg: RunConfig, strategy: Strategy, accelerator: Accelerator, config: ShardGPTConfig,
            tokenizer) -> Engine:  # fmt: skip
    """The model (fresh from the seed, or --model_name_or_path's weights), AdamW and the schedule, prepared for
    `strategy`. Collective: under FSDP2 and ZeRO-3 the model is built into each rank's shards; `prepare` shards or
    broadcasts; a pipeline creates its process groups and shards its stages."""
    # Fresh (vocabulary padded to a multiple of 128) or --model_name_or_path's weights; special ids from the
    # tokenizer (training/core/build.py). Under ZeRO-3 the model is built, or the checkpoint loaded, straight into
    # each rank's partitions inside zero.Init (collective: each module is gathered to initialise or load it). Under
    # FSDP2 it is built on the meta device and sharded, then initialised module by module into each rank's shards. A
    # pipeline rank builds the whole model, as one process would, and keeps its stages. Every path draws the same
    # weights for a seed. --torch_compile compiles each decoder layer, after checkpointing, before any sharding.
    # Under tensor parallelism (FSDP2 x TP) every rank builds the whole model, as one process would, and keeps its
    # slices and shards of it (training/axes/tensor/plan.py).
    net = build_net(cfg, strategy, accelerator, config, tokenizer)
    pipeline = None
    if strategy.pp_size > 1:  # this rank's stages, FSDP2-sharded over the data-parallel ranks under an FSDP config
        from training.axes.pipeline.runtime import build_pipeline

        shard = stage_sharder(cfg, strategy, accelerator.device) if strategy.family == "fsdp" else None
        pipeline = build_pipeline(
            net, strategy, accelerator.process_index, cfg.gradient_accumulation_steps, accelerator.device, shard
        )  # collective: the groups
    fused = accelerator.device.type == "cuda" and not strategy.offloads  # DeepSpeed's CPU Adam, FSDP's CPU step
    # --optim muon: ZeRO hands the optimizer flat partitions, whose layout the family knows
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused, family_of(strategy).muon_layout(strategy))
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    if pipeline is not None:
        return Pipelined(accelerator, strategy, cfg, net, optimizer, scheduler, pipeline=pipeline)
    # Wraps the model in DDP, FSDP2 or a DeepSpeedEngine as the launch asked (collective: shards/broadcasts).
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    family_of(strategy).after_prepare(net, cfg)  # FSDP2 on torch < 2.13: the grouped tail unit casts its inputs
    return Replicated(accelerator, strategy, cfg, net, optimizer, scheduler)


def stage_sharder(cfg: RunConfig, strategy: Strategy, device: torch.device):
    """FSDP2 for pipeline stages, with the project's mixed precision and the FSDP config's resharding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from training.axes.pipeline.runtime import fsdp2_stages
    from training.core.fsdp import fsdp_precision

    policy = fsdp_precision(cfg) if cfg.mixed_precision != "no" else MixedPrecisionPolicy()
    return fsdp2_stages(policy, strategy.fsdp_sharding == "FULL_SHARD", device.type)
