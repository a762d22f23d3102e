"""Checkpoints across strategies and numbers of ranks, through one strategy-neutral form.

The neutral form is a dict keyed by the HF parameter names: the full fp32 weights, AdamW's `exp_avg` and
`exp_avg_sq`, and the optimizer step. `read_checkpoint` builds it offline, in one process, from what each strategy
writes, with the libraries' own readers: DeepSpeed's `ds_to_universal` for ZeRO-1/2/3, torch's `dcp_to_torch_save`
for FSDP2's torch.distributed.checkpoint folders, plain files for DDP and one process. `load_neutral` puts it into
the objects `accelerator.prepare` returned, with the libraries' own setters: torch's `set_model_state_dict` and
`set_optimizer_state_dict` (full state dicts) for DDP and FSDP, DeepSpeed's `safe_set_full_fp32_param` and
`safe_set_full_optimizer_state` for ZeRO. The scheduler, the data position and (same number of ranks) the RNG
states are the checkpoint's own files, which every strategy writes alike.

A resume under the strategy and number of ranks that wrote the checkpoint loads it natively
(`accelerator.load_state`); any other goes through the neutral form, converted once by rank 0 into the checkpoint
directory (`neutral.pt`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from training.core.family import family_named, family_of
from training.strategy import Strategy

STATE = "trainer_state.json"
NEUTRAL = "neutral.pt"
RANDOM_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")  # accelerate's, on every device


# ---------------------------------------------------------------------- which checkpoints convert


def checkpoint_format(strategy: Strategy) -> str:
    """What decides a checkpoint's files: its family's format (training/core/: the ZeRO strategy itself, `fsdp`,
    `fsdp1`, `plain` for DDP and one process), or `pipeline` for any pipeline layout (torch.distributed.checkpoint
    folders as FSDP2's, each rank its stages' part)."""
    return "pipeline" if strategy.pp_size > 1 else family_of(strategy).checkpoint_format(strategy)


def written_by(saved: dict) -> Strategy:
    """The strategy a checkpoint was written under, from its trainer state's record (strategy.json's fields)."""
    return Strategy.from_name(saved["strategy"], saved["world_size"])


def needs_conversion(saved: dict, strategy: Strategy, world: int) -> bool:
    """Whether a checkpoint written under `saved` (its trainer state's strategy) must be converted, rather than load
    natively here. A pipeline's checkpoint, or a pipeline run, always goes through the neutral form: exact in fp32,
    whichever stages each rank holds."""
    written = checkpoint_format(written_by(saved))
    if "pipeline" in (written, checkpoint_format(strategy)):
        return True
    return written != checkpoint_format(strategy) or saved["world_size"] != world


def refusal(saved: dict, strategy: Strategy, world: int) -> str | None:
    """Why a checkpoint written under `saved` cannot resume in this launch, or None."""
    if not needs_conversion(saved, strategy, world):
        return None
    for side, where in ((written_by(saved), "the checkpoint's"), (strategy, "this launch's")):
        if not family_of(side).converts(side):
            return (
                f"{saved['strategy']} on {saved['world_size']} ranks cannot resume under {strategy.name} on {world} "
                f"ranks: {where} {side.name} is not converted (NVMe swap files, FSDP1's flat parameters); resume "
                "under the strategy and ranks that wrote it, or move between DDP, FSDP2 and ZeRO-1/2/3 with or "
                "without CPU offload"
            )
    return None


def reader(written: Strategy):
    """The family whose files a checkpoint of `written` holds: a pipeline's are FSDP2's folders."""
    return family_named("fsdp") if written.pp_size > 1 else family_of(written)


# ---------------------------------------------------------------------- reading a checkpoint, offline


def read_checkpoint(path: Path) -> dict:
    """The neutral form of a checkpoint: {"step", "weights", "exp_avg", "exp_avg_sq"}, tensors on the CPU, read in
    one process by the reader of the family that wrote it."""
    path = Path(path)
    state = json.loads((path / STATE).read_text())
    written = written_by(state["strategy"])
    if not family_of(written).converts(written):
        raise ValueError(
            f"checkpoint {str(path)!r} was written by {checkpoint_format(written)}, whose checkpoints are not converted"
        )
    return reader(written).read_neutral(path, state)


# ---------------------------------------------------------------------- loading into prepared objects


def load_neutral(net, optimizer, neutral: dict, strategy: Strategy) -> None:
    """Weights, Adam's moments and step into the model and optimizer prepared for `strategy`, with its family's
    setters (a collective: every rank calls it with the same neutral form)."""
    family_of(strategy).load_neutral(net, optimizer, neutral)


def gather_neutral(net, optimizer, strategy: Strategy) -> dict:
    """The neutral form of the model and optimizer prepared for `strategy`, on every rank, with its family's getters
    (a collective: ZeRO and FSDP gather their shards)."""
    return family_of(strategy).gather_neutral(net, optimizer)


def load_around(path: Path, optimizer, scheduler, rank: int, same_world: bool, written: Strategy) -> None:
    """The files every strategy writes alike: the scheduler (and the learning rate it sets for the next step), and
    each rank's RNG states when the number of ranks is the checkpoint's. `written`: the strategy that wrote it (a
    DeepSpeed engine that owned the schedule kept it among its own files)."""
    scheduler.load_state_dict(reader(written).scheduler_state(path))
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    states = read_random_state(random_state_file(path, rank))[0] if same_world else None
    if states is not None:  # else --resume_inexact said what is lost
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])


def random_state_file(path: Path, rank: int) -> Path:
    """accelerate's file of a rank's random states in a checkpoint."""
    return path / f"random_states_{rank}.pkl"


def read_random_state(file: Path) -> tuple[dict | None, str | None]:
    """A rank's random states from `file`, or why accelerate could not restore them from it."""
    from training.checkpoints.safety import safe_load

    if not file.is_file():
        return None, f"{file} is missing"
    try:
        states = safe_load(file)
    except Exception as e:  # any failure to unpickle: accelerate would skip it with an info line
        return None, f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    keys = [*RANDOM_KEYS, *(("torch_cuda_manual_seed",) if torch.cuda.is_available() else ())]
    if not isinstance(states, dict) or (missing := [k for k in keys if k not in states]):
        return None, f"{file} holds no {missing[0] if isinstance(states, dict) else 'random states'}"
    return states, None
