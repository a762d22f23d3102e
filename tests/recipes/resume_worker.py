"""Launched by test_convert.py: prepares a run as recipes/train.py does, resumes it from a checkpoint (converted when
another strategy or number of ranks wrote it), and gathers what was loaded. Rank 0 writes the neutral form of the
loaded weights and Adam state to loaded.pt in the output directory."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import HfArgumentParser

from training.accelerator import make_accelerator
from training.build import build_model
from training.checkpoint import check_resume, load_checkpoint, resolve_resume_once
from training.config import RunConfig
from training.optim import make_optimizer, make_scheduler
from training.portable import gather_neutral
from training.ranks import run_rank
from training.strategy import launch_precision, launched_data_parallel_size, requested_strategy
from training.synthetic import StandInTokenizer


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    cfg = cfg.resolve(launched_data_parallel_size(cfg), launch_precision())
    config = cfg.model_config()
    strategy = requested_strategy(cfg, config.hidden_size)
    check_resume(cfg, strategy)
    accelerator = make_accelerator(cfg, strategy)  # collective: the process group
    set_seed(cfg.seed)
    net = build_model(config, StandInTokenizer(300))  # the corpus tokenizer's size (384 padded), corpus unread
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused=False)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    prepared = accelerator.prepare(net, optimizer, scheduler)  # collective
    path = resolve_resume_once(accelerator, cfg.resume_from_checkpoint, cfg.output_dir, cfg.verify_checksums)
    load_checkpoint(accelerator, path, config.to_dict(), strategy, prepared)  # collective
    loaded = gather_neutral(*prepared[:2])  # collective
    loaded["lr"] = prepared[2].get_last_lr()
    if accelerator.is_main_process:  # rank 0 only: the file write
        torch.save(loaded, Path(cfg.output_dir) / "loaded.pt")
    accelerator.wait_for_everyone()  # collective
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/ranks.py)


if __name__ == "__main__":
    run_rank(main)
