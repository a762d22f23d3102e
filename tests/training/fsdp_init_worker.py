"""Launched by test_sharded_construction.py under accelerate's FSDP2 config: `build_model` with the launch's
Accelerator builds on the meta device and returns the model sharded, then `prepare` binds AdamW to its shards.
Rank 0 writes, per rank, whether the model held no storage when construction ended, the share of the weights it
holds after `prepare`, whether the gathered weights and the RNG afterwards equal a one-process build's with the same
seed, and whether those weights saved as a checkpoint folder read back the same under FSDP2 (--model_name_or_path),
to fsdp_init.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.distributed.tensor import DTensor
from transformers import HfArgumentParser

import training.core.build
from model import ShardGPTForCausalLM
from training.config import RunConfig
from training.core.accelerator import make_accelerator
from training.core.build import build_model
from training.core.ranks import run_rank
from training.launch import resolve_launch
from training.loop.optim import make_optimizer, make_scheduler
from training.measure.synthetic import StandInTokenizer
from training.pretrained import start_config


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once
    cfg = launch.cfg
    config = cfg.model_config()
    accelerator = make_accelerator(cfg, launch.strategy, launch.environment)  # collective
    set_seed(cfg.seed)
    on_meta = []  # whether every parameter was still on meta when construction ended, before the sharding
    shard = training.core.fsdp.shard_on_meta

    def spy(accelerator, net):
        on_meta.append(all(p.is_meta for p in net.parameters()))
        return shard(accelerator, net)

    training.core.fsdp.shard_on_meta = spy
    net = build_model(config, StandInTokenizer(config.vocab_size), accelerator=accelerator)  # collective
    after = torch.rand(4)  # the global RNG after construction: a plain build's on every rank
    optimizer = make_optimizer(cfg, net, None, fused=False)
    scheduler = make_scheduler(cfg, optimizer, None)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in net.parameters())
    whole = sum(p.numel() for p in net.parameters())
    bound = {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in net.parameters()}
    # collective: every rank gathers every tensor
    built = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in net.state_dict().items()}
    set_seed(cfg.seed)
    plain = build_model(config, StandInTokenizer(config.vocab_size)).state_dict()  # one process's build
    same_rng = torch.equal(after, torch.rand(4))
    same = sorted(plain) == sorted(built) and all(torch.equal(plain[k], built[k].cpu()) for k in plain)
    # The same weights as a checkpoint folder, read back under FSDP2: each rank reads its rows of every tensor.
    folder = Path(cfg.output_dir) / "plain"
    if accelerator.is_main_process:  # rank 0 only: the file
        ShardGPTForCausalLM(config).save_pretrained(folder, state_dict=dict(plain))  # it empties the dict
    accelerator.wait_for_everyone()  # collective: the others read it once written
    loaded = build_model(start_config(str(folder)), StandInTokenizer(config.vocab_size), False, str(folder),
                         accelerator)  # fmt: skip  # collective: the device mesh
    read = {k: v.full_tensor() for k, v in loaded.state_dict().items()}  # collective: every rank gathers
    same_read = sorted(plain) == sorted(read) and all(torch.equal(plain[k], read[k].cpu()) for k in plain)
    row = [on_meta == [True, True], held / whole, bound, same, same_rng, same_read]
    mine = torch.tensor([row], dtype=torch.float64)
    every = accelerator.gather(mine).tolist()  # collective: one row per rank
    if accelerator.is_main_process:  # rank 0 only: the file
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        keys = ("built_on_meta", "held_fraction", "optimizer_on_shards", "same_weights", "same_rng_after", "same_read")
        (out / "fsdp_init.json").write_text(json.dumps([dict(zip(keys, row, strict=True)) for row in every]))
    accelerator.wait_for_everyone()  # collective
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
