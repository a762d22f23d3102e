"""Launched by test_convert.py in place of recipes/train.py: the training script itself, resuming from a checkpoint
(converted when another strategy or number of ranks wrote it), with one thing added right after the checkpoint is
loaded and before the first step: what the prepared model and optimizer hold is gathered by the libraries' getters,
and rank 0 writes its neutral form (weights, Adam state, the scheduler's learning rates) to loaded.pt beside the
checkpoint (the output directory, where --resume_from_checkpoint=auto finds it). The run then trains on as
recipes/train.py does, so one launch checks both the loaded state and the resumed run's losses. Not for pipelines,
whose ranks hold stages, not the whole model."""

from __future__ import annotations

from pathlib import Path

import torch

from recipes import train
from training.checkpoints.portable import gather_neutral
from training.core.ranks import run_rank

load_checkpoint = train.load_checkpoint


def load_and_record(accelerator, path, config: dict, strategy, prepared: tuple) -> dict:
    """`load_checkpoint`, then the loaded state gathered (collective: every rank gathers) and written by rank 0."""
    state = load_checkpoint(accelerator, path, config, strategy, prepared)  # collective
    loaded = gather_neutral(*prepared[:2], strategy)  # collective
    loaded["lr"] = prepared[2].get_last_lr()
    if accelerator.is_main_process:  # rank 0 only: the file write
        torch.save(loaded, Path(path).parent / "loaded.pt")  # --resume_from_checkpoint=auto: the output directory
    accelerator.wait_for_everyone()  # collective
    return state


if __name__ == "__main__":
    train.load_checkpoint = load_and_record
    run_rank(train.main)
