"""Resumable checkpoints: a directory per step, a completion marker written last, the newest N kept.

`accelerator.save_state` writes what the strategy shards (DeepSpeed's engine files, FSDP's sharded state dicts, or
plain files) plus each rank's RNG states; `trainer_state.json` adds the step, the data loader's position and the model
config. A checkpoint without its marker (a crash or a full disk mid-save) is never resumed from. The marker lists
every file, every rank's shards included, with its size and CRC-32: rank 0 writes it after a barrier, when every rank
has finished writing. A resume checks the sizes, the checksums unless `--skip_checkpoint_checksum`, and the pickles
(training/checkpoints/exact.py), and refuses a checkpoint with a missing, truncated, altered or foreign file; `auto`
falls back to the newest intact one. Before a save the free space is compared with the previous checkpoint's size (or
an estimate from the parameter count), and a disk that fills during the save ends the run with one line that says so;
the checkpoints already complete stay as they were.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from training import faults
from training.checkpoints import portable
from training.checkpoints.background import BackgroundSaves, background_failure
from training.checkpoints.portable import STATE
from training.checkpoints.space import BYTES_PER_PARAMETER, MARGIN, disk_filled, no_space
from training.core.ranks import all_ranks_max
from training.strategy import Strategy

MARKER = "checkpoint_complete"
_STEP = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 1 << 24

logger = logging.getLogger("shardgpt")


def checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-<step>` directory, oldest first, complete or not."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / STATE).is_file()


# ---------------------------------------------------------------------- integrity


def crc32(path: Path) -> str:
    """CRC-32 of a file, streamed: about 3.5 GB/s over files just written (docs/checkpoints.md)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest(path: Path) -> dict[str, dict]:
    """Relative path -> size and CRC-32 of every file under a checkpoint directory but the marker."""
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != MARKER)
    return {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "crc32": crc32(f)} for f in files}


def damage(path: Path, checksums: bool = True) -> str | None:
    """Why a complete checkpoint cannot be trusted (a file missing, of another size, or with another checksum
    than its marker recorded), or None when it is intact. A marker from before files were recorded has nothing
    to check against."""
    try:
        recorded = json.loads((path / MARKER).read_text()).get("files")
    except ValueError:
        return f"{path / MARKER} is not valid JSON"
    if recorded is None:
        logger.warning("%s: its marker records no file sizes or checksums; it is not verified", path)
        return None
    for name, want in recorded.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} is {size} bytes, {want['size']} when saved (truncated or overwritten)"
    if checksums:
        for name, want in recorded.items():
            if (crc := crc32(path / name)) != want["crc32"]:
                return f"{path / name} has CRC-32 {crc}, {want['crc32']} when saved (altered after the save)"
    return None


def latest_checkpoint(output_dir: str | os.PathLike, checksums: bool = True) -> Path | None:
    """The newest complete and intact checkpoint; newer incomplete or damaged ones are skipped with a warning.
    Refuses to start afresh when every complete checkpoint is damaged."""
    damaged = []
    for _, path in reversed(checkpoints(output_dir)):
        if not is_complete(path):
            logger.warning("skipping %s: no completion marker (the save was interrupted)", path)
            continue
        why = damage(path, checksums)
        if why is None:
            return path
        logger.warning("skipping damaged checkpoint %s: %s", path, why)
        damaged.append(why)
    if damaged:
        raise ValueError(
            f"every complete checkpoint in {str(output_dir)!r} is damaged (newest: {damaged[0]}): restore one from "
            "a copy, or start afresh with --overwrite_output_dir"
        )
    return None


def resolve_resume(arg: str | None, output_dir: str, checksums: bool = True) -> Path | None:
    """`--resume_from_checkpoint`: None, `auto` (newest complete and intact in output_dir, or none yet), or a path."""
    if arg is None:
        return None
    if arg == "auto":
        return latest_checkpoint(output_dir, checksums)
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
    why = damage(path, checksums)
    if why is not None:
        raise ValueError(
            f"--resume_from_checkpoint {arg!r} is damaged: {why}; pass an older checkpoint, or auto to pick the "
            "newest intact one"
        )
    return path


def resume_candidate(arg: str | None, output_dir: str) -> tuple[Path | None, dict | None]:
    """The checkpoint `arg` resumes from (`auto`: the newest whose sizes match its marker; rank 0 verifies checksums
    later) and its trainer state, read on any rank before the process group; None for what is missing."""
    if arg == "auto":
        newest = reversed([p for _, p in checkpoints(output_dir)])
        path = next((p for p in newest if is_complete(p) and damage(p, checksums=False) is None), None)
    else:
        path = Path(arg) if arg is not None and is_complete(Path(arg)) else None
    try:
        return path, json.loads((path / STATE).read_text()) if path is not None else None
    except ValueError:
        return path, None


def check_resume(cfg, strategy: Strategy) -> None:
    """Before the process group, on every rank: the checkpoint a resume picks (`resume_candidate`) must hold no
    pickle that could run code and every file an exact resume needs, have this launch's global batch (counting
    data-parallel ranks: tensor-parallel ones share a batch), and, written under another layout, convert."""
    path, state = resume_candidate(cfg.resume_from_checkpoint, cfg.output_dir)
    if state is None:
        return  # nothing to resume, or rank 0's verification refuses it after the process group
    from training.checkpoints.exact import check_resumable

    try:
        check_resumable(path, cfg.trust_checkpoint, cfg.resume_inexact, say=False)  # no code, nothing lost
    except ValueError:
        if damage(path) is not None:  # a damaged file, not a foreign one: rank 0 says so (or `auto` skips it)
            return
        raise
    run, saved = state["run_config"], state["strategy"]
    saved_dp = saved.get("tensor_parallel", {}).get("data_parallel_size", saved["world_size"])
    was, now = state["loader"]["global_batch_size"], cfg.global_batch(strategy.data_parallel_size)
    if was != now:
        raise ValueError(
            f"checkpoint {str(path)!r} trained with a global batch of {was} (micro {run['per_device_train_batch_size']}"
            f" x accumulation {run['gradient_accumulation_steps']} x {_ranks(saved_dp, saved['world_size'])}); this "
            f"launch gives {now} (micro {cfg.per_device_train_batch_size} x accumulation "
            f"{cfg.gradient_accumulation_steps} x {_ranks(strategy.data_parallel_size, strategy.world_size)}): "
            f"pass --global_batch_size {was}"
        )
    optim = run.get("optim", "adamw_torch")  # checkpoints written before --optim: AdamW's
    if optim != cfg.optim:
        raise ValueError(
            f"checkpoint {str(path)!r} trained with --optim {optim}, whose optimizer states this launch's --optim "
            f"{cfg.optim} does not have: pass --optim {optim} to resume it, or start from its weights alone "
            "(--model_name_or_path on its exported folder)"
        )
    why = portable.refusal(saved, strategy, strategy.world_size)
    if why is not None:
        raise ValueError(f"checkpoint {str(path)!r}: {why}")


def _ranks(data_parallel: int, world: int) -> str:
    return f"world {world}" if data_parallel == world else f"{data_parallel} data-parallel ranks of {world}"


def resolve_resume_once(accelerator: Accelerator, cfg) -> Path | None:
    """`resolve_resume` of the run's flags on rank 0 alone (one reader of the checkpoint files), then the check that
    it runs no code and resumes exactly (training/checkpoints/exact.py), its verdict, or its refusal, sent to every
    rank: all resume from the same checkpoint or all stop with the same error."""
    verdict = [None]
    if accelerator.is_main_process:  # rank 0 only: verifying reads every file of the checkpoint
        try:
            path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir, cfg.verify_checksums)
            if path is not None:  # no pickle that runs code, nothing an exact resume needs missing
                from training.checkpoints.exact import check_resumable  # imported by a run that resumes

                check_resumable(path, cfg.trust_checkpoint, cfg.resume_inexact)
            verdict = [("ok", path)]
        except (ValueError, FileNotFoundError) as e:
            verdict = [(type(e).__name__, str(e))]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict)  # collective: rank 0's verdict to every rank
    kind, value = verdict[0]
    if kind == "ok":
        if value is not None and cfg.trust_checkpoint:  # every rank's loads of it use the full unpickler
            from training.checkpoints.safety import TRUSTED

            TRUSTED.add(Path(value).resolve())
        return value
    error = (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(value)
    error.same_on_every_rank = True  # rank 0's verdict: rank 0 reports it for all
    raise error


# ---------------------------------------------------------------------- disk space


def expected_size(output_dir: str | os.PathLike, parameters: int) -> int:
    """Bytes the next checkpoint will take: the newest complete one's, or an estimate for the first."""
    for _, path in reversed(checkpoints(output_dir)):
        if is_complete(path) and damage(path, checksums=False) is None:
            files = json.loads((path / MARKER).read_text()).get("files")
            if files is not None:
                return sum(f["size"] for f in files.values()) + MARGIN
    return BYTES_PER_PARAMETER * parameters + MARGIN


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, step: int, trainer_state: dict, keep: int | None,
    write_state: Callable[[Path], None] | None = None, background: BackgroundSaves | None = None,
    copy_state: Callable[[Path], list] | None = None,
) -> Path:  # fmt: skip
    """Save on every rank (a collective); only rank 0 writes the shared files, the marker and prunes. The model,
    optimizer, scheduler and RNG states are `write_state`'s to write (a collective), by default
    `accelerator.save_state`'s; with `copy_state` (--save_async: its family's `save_async`) the step waits only for
    a copy of them, and `background` writes the files, the marker and the pruning after (training/checkpoints/
    background.py). A save in flight is waited for first.

    Raises `CheckpointSpaceError` on every rank when the checkpoint would not fit, or did not: the older complete
    checkpoints are untouched, and pruning happens only after the new one is complete."""
    out = Path(output_dir)
    path = out / f"checkpoint-{step}"
    failed = background.wait() if background is not None else None  # one save in flight at a time
    needed, free = 0, 0
    if accelerator.is_main_process:  # rank 0 only: one look at the shared directory
        if path.exists():
            shutil.rmtree(path)  # an incomplete leftover of a crashed run at the same step
        needed = expected_size(out, trainer_state["strategy"]["parameters"])
        free = shutil.disk_usage(out).free
    # collective: rank 0's numbers, any rank's failure in the background; a barrier
    needed, free, failure = all_ranks_max([needed, free, failed[0] if failed else 0], accelerator.device)
    if failure:
        raise background_failure(output_dir, failure, failed)
    if needed > free:
        raise no_space(output_dir, step, needed, free, during=False)
    faults.maybe_fill_disk(step, out, accelerator.is_main_process)
    writes = []

    def write_shards():
        if copy_state is not None:
            writes.extend(copy_state(path))  # collective under FSDP2: DCP's plan; each rank copies its share
            background.reserve(path)  # the status its thread writes, on a disk it may have filled
        elif write_state is None:
            accelerator.save_state(str(path))  # collective under DeepSpeed/FSDP: each rank writes its shard
        else:
            write_state(path)  # collective: each rank writes its part
        faults.maybe_kill("kill_in_save", step, accelerator.is_main_process)
        faults.maybe_kill_mid_shard(step, path, accelerator.is_main_process)
        if accelerator.is_main_process:  # rank 0 only: the shared trainer state
            _write_json(path / STATE, trainer_state)

    def write_marker() -> int:
        if not accelerator.is_main_process:
            return 0
        files = manifest(path)  # rank 0 only: the marker lists every rank's files
        _write_json(path / MARKER, {"step": step, "files": files})
        return sum(f["size"] for f in files.values())

    def complete(started: float | None = None) -> None:  # rank 0 only: the new checkpoint is complete
        saved = write_marker() if started is not None else sizes[0]
        for old in [p for _, p in checkpoints(output_dir) if is_complete(p)][: -keep if keep else 0]:
            shutil.rmtree(old, ignore_errors=True)
        late = "" if started is None else f", written in the background in {time.perf_counter() - started:.1f} s"
        logger.info("saved %s (%s MB) to %s%s", path.name, f"{saved / 1e6:,.1f}", output_dir, late)

    # Each collective below is also the barrier the next part needs: every shard is on disk before the marker
    # lists it, and the marker is written before old checkpoints are pruned.
    sizes = []
    for write in (write_shards,) if copy_state is not None else (write_shards, lambda: sizes.append(write_marker())):
        (filled,) = all_ranks_max([disk_filled(write, out)], accelerator.device)  # collective: any rank's disk?
        if filled:
            if accelerator.is_main_process:  # rank 0 only: the partial checkpoint gives its space back
                shutil.rmtree(path, ignore_errors=True)
            accelerator.wait_for_everyone()  # collective: nobody exits while rank 0 still removes it
            raise no_space(output_dir, step, needed, shutil.disk_usage(out).free, during=True)
    if copy_state is not None:  # the marker once every rank's thread has written its files
        background.start(path, writes, partial(complete, time.perf_counter()))
        return path
    if accelerator.is_main_process:  # rank 0 only: prune; one line for accelerate's INFO lines (report/console.py)
        complete()
    accelerator.wait_for_everyone()  # collective: pruning is done before anyone looks again
    return path


def load_checkpoint(accelerator: Accelerator, path: Path, model_config: dict, strategy: Strategy, prepared) -> dict:
    """Restore model, optimizer, scheduler and RNG on every rank (a collective); returns trainer_state.

    `prepared` is (model, optimizer, scheduler) as `accelerator.prepare` returned them. A checkpoint written under
    this strategy family and number of ranks loads natively; any other through the neutral form
    (training/checkpoints/portable.py). A checkpoint of a differently shaped model is refused before anything is
    loaded."""
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
    written, world = state["strategy"], accelerator.num_processes
    if not portable.needs_conversion(written, strategy, world):  # never for a pipeline's checkpoint or run
        accelerator.load_state(str(path))
        return state
    model, optimizer, scheduler = prepared
    portable.load_neutral(model, optimizer, neutral_form(accelerator, path), strategy)  # collective
    same_world = written["world_size"] == world
    portable.load_around(
        path, optimizer, scheduler, accelerator.process_index, same_world, portable.written_by(written)
    )
    logger.info("converted %s (%s on %d ranks) for %s", path, written["strategy"], written["world_size"], strategy.name)
    return state


def neutral_form(accelerator: Accelerator, path: Path) -> dict:
    """The checkpoint's neutral form, converted by rank 0 alone the first time (a collective: the others wait,
    then every rank reads it)."""
    target = path / portable.NEUTRAL
    error = [None]
    if accelerator.is_main_process and not target.is_file():  # rank 0 only: one process converts and writes
        try:
            neutral = portable.read_checkpoint(path)
            tmp = target.with_suffix(".tmp")
            torch.save(neutral, tmp)
            os.replace(tmp, target)
        except Exception as e:  # every rank must learn it, or the others would wait forever
            error = [f"converting {str(path)!r} failed: {type(e).__name__}: {e}"]
    if accelerator.num_processes > 1:
        broadcast_object_list(error)  # collective: rank 0's outcome to every rank; a barrier
    if error[0] is not None:
        raise RuntimeError(error[0])
    from training.checkpoints.safety import safe_load

    return safe_load(target)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
