"""How a rank ends and what every rank agrees on: exit statuses, one-line errors for bad input,
and the maximum of a few integers across ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from training.environment import Environment

BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
PREEMPTED = 75  # exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL, "try again later"
# A launcher ends every rank as soon as one exits: where rank 0 speaks for all, the others leave it this long to say
# it first (seen: ZeRO-3 on 4 ranks, the memory planner's refusal lost when rank 1 exited before rank 0 printed it).
RANK_0_SPEAKS_S = 2.0


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint (training/loop/preemption.py)."""


def all_ranks_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise maximum of small integers over the ranks: every rank gets the same answer (a collective when
    the process group exists; the values themselves on a single process)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # collective: every rank
    return t.tolist()


def _is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def remove_deepspeed_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (its `shm_comm` op, deepspeed 0.19.8 `ops/csrc/cpu/comm/shm.cpp`) creates one
    shared-memory file per rank, /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
    (69 MB), and never removes it: every CPU launch left its files behind, and /dev/shm is RAM (12 GB had piled
    up on a test machine). This rank's file is unlinked at exit; mappings the other ranks still hold stay valid."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if addr and port and rank:
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}").unlink(missing_ok=True)


def run_rank(main: Callable[[], object], errors: tuple[type[BaseException], ...] = BAD_INPUT) -> NoReturn:
    """Run a launched script's `main` and end the process. Bad input (and `errors`) ends with one line,
    `error: ...`, and exit status 2 instead of a traceback (set SHARDGPT_TRACEBACK=1 to see it); an error that
    every rank raises alike (its `same_on_every_rank` is true) is printed by rank 0 alone. A run stopped
    by a preemption signal after its checkpoint ends with rank 0's one line and exit status `PREEMPTED` (75).

    A rank that used a process group exits without interpreter finalization. In torch 2.13 the gloo
    backend's worker threads outlive `destroy_process_group` once DDP, FSDP or DeepSpeed have held the
    group (they keep it alive from C++; the threads are still there after garbage collection), and a
    rank that had finished and written everything has been seen to abort during finalization with
    "terminate called without an active exception" (exit -6), failing a completed run. Everything is
    flushed here first; the script has already finished its trackers and destroyed the group.

    Nor is anything that holds the process group destroyed before that exit: `main` returns what it built (the
    prepared model, the engine), or raises with it in its frames, and both are kept here until `os._exit`. In
    torch 2.13 freeing DDP's reducer destroys the gloo process group, which joins gloo's worker thread while
    holding the GIL; a worker thread still freeing a barrier's work waits for the GIL: a rank that had finished
    everything hung for good (seen with two launches sharing 2 cores)."""
    # DeepSpeed (0.19.8) calls torch's deprecated collective names; under ZeRO-3 the FutureWarning was
    # printed again and again (2,384 times in a 30-step `tiny` run), burying everything else on stderr.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        category=FutureWarning,
    )
    kept = None  # what main built, alive until os._exit (see above)
    try:
        kept = main()
        code = 0
    except errors as e:
        kept = e  # its traceback holds main's frame
        if os.environ.get("SHARDGPT_TRACEBACK"):
            raise
        if not (getattr(e, "same_on_every_rank", False) and not _is_rank_0()):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # rank 0 says it for all
            time.sleep(RANK_0_SPEAKS_S)
        code = 2
    except Preempted as e:
        kept = e
        if _is_rank_0():  # rank 0 only: one line for the whole run
            print(e, file=sys.stderr, flush=True)
        else:
            time.sleep(RANK_0_SPEAKS_S)
        code = PREEMPTED
    remove_deepspeed_shm_buffer()
    if Environment.read().world <= 1:
        del kept
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
