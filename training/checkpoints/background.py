"""Saves that do not stall the step (`--save_async`): the step waits only for a copy of the state in host memory, a
thread of each rank writes the files from it, and the completion marker is written once every rank's files are on disk.

What a rank copies and writes is its family's (`Family.save_async`, with training/core/staging.py): one process and
DDP write accelerate's own files from a copy of the weights and AdamW's states; FSDP2 and the pipelines go through
torch.distributed.checkpoint's `async_save`, its collectives on gloo groups of their own.

When a rank's files are durable (fsynced) its thread writes `.written-<rank>`, or why they are not; rank 0's thread
waits for every rank's, then lists the files in the marker and prunes the old checkpoints. Nothing but DCP's own save
runs a collective off the main thread. A kill before the marker leaves the previous checkpoint the newest intact. The
next save, the end of the run and a preemption wait for the save in flight (`BackgroundSaves.wait`), and its failure is
raised then, on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from training import faults
from training.checkpoints.space import CheckpointSpaceError, full_disk
from training.core.ranks import all_ranks_max

logger = logging.getLogger("shardgpt")

WRITTEN = ".written-{rank}"
_SLOT = 1024  # each rank's `.written-<rank>`, made this size before the writes: its status fits a full disk too
_PENDING = {"pending": True}
_POLL_S = 0.05


class BackgroundSaveError(RuntimeError):
    """A checkpoint written in the background failed; the checkpoints already complete are untouched."""

    same_on_every_rank = True  # every rank raises it after the same collective: rank 0 reports it for all


class BackgroundSaves:
    """This rank's checkpoint in flight, one at a time."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.thread: threading.Thread | None = None
        self.failure: tuple[int, str] | None = None  # (2: the disk filled, 1: another error; why)
        self.staged: dict = {}  # the host copies (and DCP's writers) the next save writes over

    def reserve(self, path: Path) -> None:
        """This rank's `.written-<rank>`, made now (before the step goes on, where a full disk is caught by the
        foreground's check) at the size its status will take: the thread overwrites it in place, which a disk the
        background writes have filled still allows."""
        _write_status(path / WRITTEN.format(rank=self.rank), _PENDING, create=True)

    def start(self, path: Path, writes: list[Callable[[], None]], finish: Callable[[], None]) -> None:
        """Run `writes` (this rank's files, in order) in a thread; on rank 0, `finish` (the marker, the pruning)
        once every rank's files are written."""
        step = int(path.name.rsplit("-", 1)[1])

        def run():
            status = {"ok": True}
            try:
                for i, write in enumerate(writes):
                    write()
                    if i == 0:  # the first file written, the rest not
                        faults.maybe_kill("kill_in_background_save", step, self.rank == 0)
            except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is one
                first = (str(e).splitlines() or [""])[0][:300]
                status = {"ok": False, "space": full_disk(e), "why": f"{type(e).__name__}: {first}"}
            _write_status(path / WRITTEN.format(rank=self.rank), status)
            if self.rank == 0:
                self.failure = self._finish(path, finish)
            elif not status["ok"]:
                self.failure = (2 if status["space"] else 1, status["why"])

        self.failure = None
        self.thread = threading.Thread(target=run, name=f"save-{path.name}", daemon=True)
        self.thread.start()

    def _finish(self, path: Path, finish: Callable[[], None]) -> tuple[int, str] | None:
        """Rank 0: wait for every rank's `.written-<rank>`, then `finish`, or remove the partial checkpoint."""
        files = [path / WRITTEN.format(rank=r) for r in range(self.world)]
        statuses = [_read_status(f) for f in files]
        while None in statuses:  # the other ranks write theirs; a lost rank ends this process
            time.sleep(_POLL_S)
            statuses = [_read_status(f) for f in files]
        for f in files:
            f.unlink()
        failed = [(r, s) for r, s in enumerate(statuses) if not s["ok"]]
        if failed:
            shutil.rmtree(path, ignore_errors=True)  # the partial checkpoint gives its space back
            r, s = failed[0]
            return (2 if any(s["space"] for _, s in failed) else 1, f"rank {r}: {s['why']}")
        try:
            finish()
        except OSError as e:
            return (2 if full_disk(e) else 1, f"rank 0: {type(e).__name__}: {e}")
        return None

    def wait(self) -> tuple[int, str] | None:
        """Wait for the save in flight, if any: its failure on this rank (rank 0: on any rank), or None."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        return failure


def finish_saves(accelerator, background: BackgroundSaves, output_dir: str) -> None:
    """Wait for the save in flight (before the export, or a preempted run's exit), and raise its failure on every
    rank (a collective)."""
    failed = background.wait()
    (failure,) = all_ranks_max([failed[0] if failed else 0], accelerator.device)  # collective: any rank's failure
    if failure:
        raise background_failure(output_dir, failure, failed)


def background_failure(output_dir: str, code: int, failed: tuple[int, str] | None) -> RuntimeError:
    """A background save's failure, raised on every rank (rank 0's line names the rank and the error)."""
    why = failed[1] if failed else "on another rank"
    if code == 2:
        error = CheckpointSpaceError(
            f"--output_dir {output_dir!r} ran out of space while a checkpoint was written in the background ({why}): "
            "the checkpoints already complete are untouched. Free space, keep fewer checkpoints "
            "(--save_total_limit), or pass another --output_dir with --resume_from_checkpoint pointing at the last one"
        )
    else:
        error = BackgroundSaveError(
            f"a checkpoint written in the background under --output_dir {output_dir!r} failed ({why}); the "
            "checkpoints already complete are untouched: resume with --resume_from_checkpoint auto"
        )
    return error


def _write_status(path: Path, status: dict, create: bool = False) -> None:
    """`status` into `path`, padded to `_SLOT` bytes and fsynced: made (`create`), else overwritten in place."""
    data = json.dumps(status).encode().ljust(_SLOT)
    with open(path, "wb" if create or not path.is_file() else "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_status(path: Path) -> dict | None:
    """A rank's status once its thread has written it; None while it is pending (or not yet made)."""
    try:
        status = json.loads(path.read_bytes())
    except (OSError, ValueError):  # not made yet, or caught mid-write
        return None
    return None if status.get("pending") else status
