"""AdamW with weight decay on matrices only (or, with --optim muon, Muon for the decoder's matrices:
training/muon.py), and warm-up followed by a cosine (or linear) decay to a floor.

When a DeepSpeed JSON defines its own `optimizer` or `scheduler`, DeepSpeed builds them (for example its
CPU Adam for offload) and accelerate's `DummyOptim`/`DummyScheduler` stand in for them here; the
parameter groups are the same either way.
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import DummyOptim, DummyScheduler

from training.adamw import param_groups
from training.config import RunConfig


def lr_lambda(cfg: RunConfig):
    """Multiplier of the peak lr at optimizer step `s` (0-based): linear warm-up to 1 over the warm-up steps,
    then cosine (or linear) decay to `min_lr_ratio` at max_steps, or constant."""

    def f(s: int) -> float:
        warmup = cfg.num_warmup_steps
        if s < warmup:
            return (s + 1) / warmup
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, cfg.max_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_scheduler_type == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return f


def make_optimizer(cfg: RunConfig, model: torch.nn.Module, ds_config: dict | None, fused: bool, zero=None):
    """`fused`: use the fused CUDA kernel (parameters on a GPU, not offloaded); otherwise torch's foreach
    implementation. --optim muon: training/muon.py's Muon (`zero`: ZeRO's partition layout, from the family)."""
    if cfg.optim == "muon":
        from training.muon import make_muon

        return make_muon(cfg, model, zero)
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
    if ds_config is not None and "optimizer" in ds_config:
        return DummyOptim(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused or None,
    )


def make_scheduler(cfg: RunConfig, optimizer, ds_config: dict | None):
    ds_config = ds_config or {}
    if "scheduler" in ds_config:  # DeepSpeed builds the JSON's scheduler
        return DummyScheduler(optimizer, total_num_steps=cfg.max_steps, warmup_num_steps=cfg.num_warmup_steps)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))

    if "optimizer" in ds_config:  # our schedule, built by DeepSpeed around the optimizer it creates
        return DummyScheduler(optimizer, lr_scheduler_callable=schedule)
    return schedule(optimizer)
