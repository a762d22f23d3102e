"""Fault injection, for the test suite to prove the run survives what real runs meet.

`SHARDGPT_FAULT` holds `kind@step` items, comma-separated; nothing happens when it is unset:
- `nan@N`: the loss of step N becomes NaN (every rank), as an overflow would make it;
- `kill@N`: rank 0 SIGKILLs itself after finishing step N, as a preempted node would;
- `kill_in_save@N`: rank 0 SIGKILLs itself in the middle of saving checkpoint N (shards written, no marker).
"""

from __future__ import annotations

import os
import signal


def _faults() -> set[tuple[str, int]]:
    spec = os.environ.get("SHARDGPT_FAULT", "")
    return {(kind, int(step)) for kind, step in (item.split("@") for item in spec.split(",") if item)}


def active(kind: str, step: int) -> bool:
    return (kind, step) in _faults()


def maybe_kill(kind: str, step: int, is_main_process: bool) -> None:
    if is_main_process and active(kind, step):
        os.kill(os.getpid(), signal.SIGKILL)
