"""Launched by test_strategies.py under ZeRO-3 with NVMe offload: are the weights that come back from the
NVMe drive the weights that went in? The vocabulary is large enough that the embedding's partition passes
DeepSpeed's minimum swap size (1 MiB per rank) and really goes through the swap buffers."""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
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

VOCAB = 16384  # x hidden 64 = 1,048,576 embedding elements: half per rank, 2 MiB in fp32


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once
    cfg = launch.cfg
    config = shardgpt.ShardGPTConfig.from_preset(cfg.preset, vocab_size=VOCAB)
    strategy = launch.strategy
    accelerator = make_accelerator(cfg, strategy, launch.environment)  # collective
    set_seed(cfg.seed)
    net = shardgpt.ShardGPTForCausalLM(config)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    net.eval()  # the loss of the logits path, as after `prepare` below (training computes it chunked)
    with torch.no_grad():
        reference = net(ids, labels=ids).loss.item()
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused=False)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    verify_strategy(accelerator, net, strategy)
    unwrapped = accelerator.unwrap_model(net)
    swapped, changed = [], {}
    for name, p in unwrapped.named_parameters():
        if p.nvme_swapper.swappable_tensor(numel=p.ds_tensor.ds_numel):  # went to the drive at partitioning
            swapped.append(name)
        with deepspeed.zero.GatheredParameters([p]):  # collective: every rank gathers every parameter
            error = (p.detach() - before[name]).abs().max().item()
        if error > 0:
            changed[name] = error
    net.eval()
    with torch.no_grad():
        loss = net(ids, labels=ids).loss.item()  # collective: ZeRO-3 gathers inside
    if accelerator.is_main_process:  # rank 0 only: file writes
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"swapped": swapped, "changed": changed, "loss": loss, "reference": reference}
        (out / "nvme.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()  # collective
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
