"""Fault injection, for the test suite to prove the run survives what real runs meet.

`SHARDGPT_FAULT` holds `kind@step` items, comma-separated; nothing happens when it is unset:
- `nan@N`: the loss of step N becomes NaN (every rank), as an overflow would make it;
- `kill@N`: rank 0 SIGKILLs itself after finishing step N, as a preempted node would;
- `kill_node@N`: every rank that has it in its environment SIGKILLs its launcher's agent (its parent) and then
  itself after step N: set for one torchrun agent of an elastic job, that node is lost whole;
- `kill_in_save@N`: rank 0 SIGKILLs itself in the middle of saving checkpoint N (shards written, no marker);
- `kill_mid_shard@N`: rank 0 cuts the largest file of checkpoint N to half its size and SIGKILLs itself before
  the marker: what a kill while that shard was being written leaves on disk;
- `kill_in_background_save@N`: rank 0 SIGKILLs itself while checkpoint N is written in the background
  (`--save_async`): its first file written, the others and the marker not;
- `fill_disk@N`: rank 0 fills the output directory's filesystem with a file `fill` just before writing checkpoint N,
  after the free-space check, as another job writing to the same disk would;
- `term_launcher@N`: rank 0 sends SIGTERM to its parent (the launcher) after step N, as SLURM or a spot-instance
  preemption does; the launcher forwards it to every rank;
- `usr1_last_rank@N`: the last rank alone sends itself SIGUSR1 after step N (SLURM's `--signal`): the other ranks
  only learn it through the ranks' agreement;
- `stall@N`: the last rank stops answering after step N (it sleeps for an hour) while the others wait for it in
  the next collective, as a rank stuck on a bad node does.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _faults() -> set[tuple[str, int]]:
    spec = os.environ.get("SHARDGPT_FAULT", "")
    return {(kind, int(step)) for kind, step in (item.split("@") for item in spec.split(",") if item)}


def active(kind: str, step: int) -> bool:
    """Whether `kind@step` is injected: in the first generation of workers only (a restarted one replays the steps
    after its checkpoint, and the fault it recovers from does not recur)."""
    return (kind, step) in _faults() and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def after_step(step: int, rank: int, world_size: int) -> None:
    """The faults a run meets between steps: a kill, a preemption signal, a stalled rank."""
    maybe_kill("kill", step, rank == 0)
    if active("kill_node", step):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    maybe_signal(step, rank, world_size)
    maybe_stall(step, rank, world_size)


def maybe_kill(kind: str, step: int, is_main_process: bool) -> None:
    if is_main_process and active(kind, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_signal(step: int, rank: int, world_size: int) -> None:
    if rank == 0 and active("term_launcher", step):
        os.kill(os.getppid(), signal.SIGTERM)
    if rank == world_size - 1 and active("usr1_last_rank", step):
        os.kill(os.getpid(), signal.SIGUSR1)


def maybe_stall(step: int, rank: int, world_size: int) -> None:
    if rank == world_size - 1 and active("stall", step):
        time.sleep(3600)


def maybe_fill_disk(step: int, directory: Path, is_main_process: bool) -> None:
    if not (is_main_process and active("fill_disk", step)):
        return
    with open(directory / "fill", "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):  # down to the last byte the filesystem takes
            try:
                while f.write(bytes(size)):
                    pass
            except OSError:
                continue


def maybe_kill_mid_shard(step: int, checkpoint: Path, is_main_process: bool) -> None:
    if not (is_main_process and active("kill_mid_shard", step)):
        return
    largest = max((f for f in checkpoint.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    os.kill(os.getpid(), signal.SIGKILL)
