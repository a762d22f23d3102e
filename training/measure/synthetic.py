"""The training setup of `recipes/train.py` on random tokens, for the tools that measure it
(memory, start-up memory, profiles): flags checked, strategy, Accelerator, model, AdamW, schedule,
`prepare`, and a synthetic global batch through the real loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from data import ShardedLoader
from model import ShardGPTConfig
from training.arguments import parse_run_config
from training.config import RunConfig
from training.core.accelerator import make_accelerator
from training.core.build import build_model
from training.core.family import family_of
from training.launch import resolve_launch
from training.loop.engine import build_net, verify_in_force
from training.loop.optim import make_optimizer, make_scheduler
from training.loop.step import accumulated_loss_scale, train_step
from training.strategy import Strategy


class StandInTokenizer:
    """What `build_model` reads from a tokenizer: the size the default BPE of --tokenizer_vocab_size has."""

    eos_token_id = bos_token_id = 0

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


def set_up(argv: list[str] | None):
    """The start of `recipes/train.py`: flags parsed and checked, the strategy read, the Accelerator made
    (collective: initialises the process group), the seed set. Returns (cfg, world, config, strategy, accelerator)."""
    launch = resolve_launch(parse_run_config(argv))  # the flags, the environment and the JSON, read once
    cfg, world, strategy = launch.cfg, launch.world, launch.strategy
    config = cfg.model_config()
    family_of(strategy).check_start(strategy)  # DeepSpeed: a stale op-build lock would hang every rank
    accelerator = make_accelerator(cfg, strategy, launch.environment)  # collective: initialises the process group
    set_seed(cfg.seed)
    return cfg, world, config, strategy, accelerator


@dataclass
class SyntheticRun:
    """The training setup of `recipes/train.py` on random tokens: what `synthetic_run` returns."""

    cfg: RunConfig
    config: ShardGPTConfig
    strategy: Strategy
    accelerator: Accelerator
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    seen: dict
    blocks: torch.Tensor
    loader: Iterator
    psi: int
    tensors: int

    def step(self, step: int) -> None:
        """One `train_step` on this rank's next micro batches (collectives on every rank)."""
        loss_scale = accumulated_loss_scale(self.strategy, self.cfg.gradient_accumulation_steps)
        batch = next(self.loader)
        s = self.strategy
        shards = family_of(s).norm_group(self.net, s)  # FSDP1's gradients' ranks, for the norm
        train_step(self.accelerator, self.net, self.optimizer, self.scheduler, batch, loss_scale,
                   self.cfg.max_grad_norm, step, s.tp_size, None, shards)  # fmt: skip


def synthetic_run(argv: list[str] | None = None) -> SyntheticRun:
    """Parse train.py's flags, check them, pick the strategy, build and `prepare` model, AdamW and schedule,
    and feed a synthetic global batch (random tokens, the same on every rank) through the real loader."""
    cfg, world, config, strategy, accelerator = set_up(argv)
    if strategy.pp_size > 1:
        raise ValueError("the synthetic run measures one model per rank: launch it without a pipeline")
    tokenizer = StandInTokenizer(cfg.tokenizer_vocab_size)
    if strategy.tp_size > 1 and strategy.family == "fsdp":  # FSDP2 x TP: split and sharded as recipes/train.py does
        net = build_net(cfg, strategy, accelerator, config, tokenizer)
    else:  # built whole on every rank; `prepare` wraps, shards or partitions it
        net = build_model(config, tokenizer, cfg.gradient_checkpointing)
    # ds_numel: a zero.Init partition's whole size; a DTensor's numel is its whole size too
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())
    tensors = sum(1 for _ in net.parameters())
    fused = accelerator.device.type == "cuda" and not strategy.offloads
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    seen = verify_in_force(accelerator, net, strategy)

    # Random tokens, the same on every rank, through the real loader (this rank's micro batches; the ranks of a
    # tensor-parallel group share theirs).
    dp, dp_rank = strategy.data_parallel_size, strategy.data_parallel_rank(accelerator.process_index)
    global_batch = cfg.global_batch(dp)
    generator = torch.Generator().manual_seed(cfg.seed)
    blocks = torch.randint(0, config.vocab_size, (global_batch, cfg.block_size + 1), generator=generator)
    loader = iter(ShardedLoader(blocks, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, dp,
                                dp_rank, cfg.seed))  # fmt: skip
    net.train()
    return SyntheticRun(cfg, config, strategy, accelerator, net, optimizer, scheduler, seen, blocks, loader, psi,
                        tensors)  # fmt: skip
