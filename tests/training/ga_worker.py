"""Drives `training/loop/step.py::train_step`, the training script's own step, on crafted global batches whose
sequences count very different numbers of targets (-100 elsewhere, as padding would), under whatever strategy
the launcher's config asks for. Writes the per-step losses and the final (gathered) weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import HfArgumentParser

import model as shardgpt
from training.config import RunConfig
from training.core.accelerator import make_accelerator
from training.core.inspection import verify_strategy
from training.core.ranks import run_rank
from training.launch import resolve_launch
from training.loop.optim import make_optimizer, make_scheduler
from training.loop.step import train_step

STEPS, SEQ = 6, 32


def global_batches(global_size: int, vocab: int, seed: int = 1234):
    """Each sample keeps its first k targets (k uniform in 1..SEQ) and ignores the rest."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (global_size, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        keep = torch.randint(1, SEQ + 1, (global_size, 1), generator=g)
        labels[torch.arange(SEQ)[None] >= keep] = -100
        yield ids[:, :-1], labels


def rank_micro_batches(ids, labels, micro: int, accumulation: int, world: int, rank: int) -> list[dict]:
    """The loader's layout: micro-step a on rank r takes rows [a*micro*world + r*micro, ... + micro)."""
    count = (labels != -100).sum()  # targets in the whole global batch
    starts = [a * micro * world + rank * micro for a in range(accumulation)]
    return [{"input_ids": ids[s : s + micro], "shift_labels": labels[s : s + micro], "num_items_in_batch": count}
            for s in starts]  # fmt: skip


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once
    cfg, world = launch.cfg, launch.world
    config = shardgpt.ShardGPTConfig.from_preset(cfg.preset)
    strategy = launch.strategy
    accelerator = make_accelerator(cfg, strategy, launch.environment)  # collective
    set_seed(cfg.seed)
    net = shardgpt.ShardGPTForCausalLM(config)
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused=False)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    verify_strategy(accelerator, net, strategy)
    net.train()
    losses, counts = [], []
    for step, (ids, labels) in enumerate(global_batches(cfg.global_batch(world), config.vocab_size), 1):
        micro = rank_micro_batches(ids, labels, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                                   world, accelerator.process_index)  # fmt: skip
        counts.append([int((m["shift_labels"] != -100).sum()) for m in micro])
        result = train_step(accelerator, net, optimizer, scheduler, micro, world * cfg.gradient_accumulation_steps,
                            cfg.max_grad_norm, step)  # fmt: skip  # collectives inside
        losses.append(result.loss)
    state = accelerator.get_state_dict(net)  # collective: gathers ZeRO/FSDP shards
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:  # rank 0 only: file writes
        out.mkdir(parents=True, exist_ok=True)
        (out / "ga.json").write_text(json.dumps({"losses": losses, "micro_counts": counts}))
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / "final.pt")
    accelerator.wait_for_everyone()  # collective
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
