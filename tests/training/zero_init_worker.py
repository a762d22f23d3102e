"""Launched by test_modeling.py under accelerate's ZeRO-3 config: `build_model` with the launch's Accelerator
(transformers' HfDeepSpeedConfig set) builds inside zero.Init. Rank 0 writes what each rank held right after
construction and whether the gathered weights equal a plain build's with the same seed, to zero_init.json."""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import torch
from accelerate.utils import set_seed
from transformers import HfArgumentParser
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from training.config import RunConfig
from training.core.accelerator import make_accelerator
from training.core.build import build_model
from training.core.ranks import run_rank
from training.launch import resolve_launch
from training.measure.synthetic import StandInTokenizer


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once
    cfg = launch.cfg
    config = cfg.model_config()
    accelerator = make_accelerator(cfg, launch.strategy, launch.environment)  # collective
    set_seed(cfg.seed)
    net = build_model(config, StandInTokenizer(config.vocab_size))  # collective: zero.Init
    held = sum(p.numel() + getattr(p, "ds_tensor", torch.empty(0)).numel() for p in net.parameters())
    whole = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())
    after = torch.rand(4)  # the global RNG after construction: a plain build's on every rank
    with deepspeed.zero.GatheredParameters(list(net.parameters())):  # collective
        built = {k: v.clone() for k, v in net.state_dict().items()}
    unset_hf_deepspeed_config()  # the same build, plain
    set_seed(cfg.seed)
    plain = build_model(config, StandInTokenizer(config.vocab_size)).state_dict()
    same_rng = torch.equal(after, torch.rand(4))
    same = sorted(plain) == sorted(built) and all(torch.equal(plain[k], built[k]) for k in plain)
    mine = torch.tensor([[held / whole, same, same_rng]], dtype=torch.float64)
    every = accelerator.gather(mine).tolist()  # collective: one row per rank
    if accelerator.is_main_process:  # rank 0 only: the file
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        keys = ("held_fraction", "same_weights", "same_rng_after")
        (out / "zero_init.json").write_text(json.dumps([dict(zip(keys, row, strict=True)) for row in every]))
    accelerator.wait_for_everyone()  # collective
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
