"""Resumable checkpoints: a directory per step, a completion marker written last, the newest N kept.

`accelerator.save_state` writes what the strategy shards (DeepSpeed's engine files, FSDP's sharded state
dicts, or plain files) plus each rank's RNG states; `trainer_state.json` adds the step, the data loader's
position and the model config. A checkpoint without its marker (a crash or a full disk mid-save) is never
resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from accelerate import Accelerator

from . import faults

MARKER = "checkpoint_complete"
STATE = "trainer_state.json"
_STEP = re.compile(r"^checkpoint-(\d+)$")

logger = logging.getLogger(__name__)


def checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-<step>` directory, oldest first, complete or not."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE).is_file()


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint; newer incomplete ones are skipped with a warning."""
    for _, path in reversed(checkpoints(output_dir)):
        if is_complete(path):
            return path
        logger.warning("skipping %s: no completion marker (the save was interrupted)", path)
    return None


def resolve_resume(arg: str | None, output_dir: str) -> Path | None:
    """`--resume_from_checkpoint`: None, `auto` (newest complete in output_dir, or none yet), or a path."""
    if arg is None:
        return None
    if arg == "auto":
        return latest_checkpoint(output_dir)
    path = Path(arg)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--resume_from_checkpoint {arg!r}: no such directory; pass a checkpoint-<step> dir or auto"
        )
    if not is_complete(path):
        raise ValueError(
            f"--resume_from_checkpoint {arg!r} has no {MARKER} marker: its save did not finish; pass an "
            "older checkpoint, or auto to pick the newest complete one"
        )
    return path


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, step: int, trainer_state: dict, keep: int | None
) -> Path:
    """Save on every rank (a collective); only rank 0 writes the shared files, the marker and prunes."""
    path = Path(output_dir) / f"checkpoint-{step}"
    if accelerator.is_main_process and path.exists():
        shutil.rmtree(path)  # an incomplete leftover of a crashed run at the same step
    accelerator.wait_for_everyone()  # collective: nobody writes into a directory being removed
    accelerator.save_state(str(path))  # collective under DeepSpeed/FSDP: each rank writes its shard
    faults.maybe_kill("kill_in_save", step, accelerator.is_main_process)
    faults.maybe_kill_mid_shard(step, path, accelerator.is_main_process)
    if accelerator.is_main_process:
        _write_json(path / STATE, trainer_state)
    accelerator.wait_for_everyone()  # collective: every shard is on disk before the marker says so
    if accelerator.is_main_process:
        _write_json(path / MARKER, {"step": step})
        if keep is not None:
            complete = [p for _, p in checkpoints(output_dir) if is_complete(p)]
            for old in complete[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()  # collective: pruning is done before anyone looks again
    return path


def load_checkpoint(accelerator: Accelerator, path: Path, model_config: dict) -> dict:
    """Restore model, optimizer, scheduler and RNG on every rank (a collective); returns trainer_state.

    A checkpoint of a differently shaped model is refused before anything is loaded."""
    state = json.loads((path / STATE).read_text())
    saved = state.get("model_config", {})
    shape_keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "tie_word_embeddings",
    )  # fmt: skip
    diff = {k: (saved.get(k), model_config.get(k)) for k in shape_keys if saved.get(k) != model_config.get(k)}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs this run {b}" for k, (a, b) in diff.items())
        raise ValueError(
            f"checkpoint {str(path)!r} holds a different model ({detail}): resume with the same --preset and "
            "tokenizer, or start afresh in a new --output_dir"
        )
    accelerator.load_state(str(path))
    return state


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
