"""A checkpoint's disk space: the size the next one needs, the refusal when it does not fit, and a write that failed on
a full disk told from any other failure (ENOSPC or a full quota, on any rank, or a write error on a filesystem now
full). The checkpoints already complete are never touched."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger("shardgpt")

# First save, nothing to measure yet: fp32 weights (4 bytes a parameter), Adam's two moments (8), and a mixed-precision
# copy or master weights (4); the small files (RNG, scheduler, trainer state) fit in the margin.
BYTES_PER_PARAMETER = 16
MARGIN = 1 << 20


class CheckpointSpaceError(RuntimeError):
    """The output directory cannot hold the next checkpoint; nothing already saved was touched."""

    same_on_every_rank = True  # every rank raises it after the same collective: rank 0 reports it for all


def no_space(output_dir: str, step: int, needed: int, free: int, during: bool) -> CheckpointSpaceError:
    when = "ran out of space while saving" if during else "has no space for"
    return CheckpointSpaceError(
        f"--output_dir {output_dir!r} {when} checkpoint-{step}: it needs about {needed:,} bytes, {free:,} are free; "
        "the checkpoints already complete are untouched. Free space, keep fewer checkpoints (--save_total_limit), "
        "or pass another --output_dir with --resume_from_checkpoint pointing at the last checkpoint"
    )


def disk_filled(write, directory: Path) -> int:
    """1 when `write` failed because the disk is full: ENOSPC, or any write error (torch's zip writer reports
    "unexpected pos") on a filesystem now full; 0 when it succeeded. Other errors propagate."""
    try:
        write()
    except (Exception, CheckpointException) as e:  # torch.distributed.checkpoint's is a BaseException
        if not (full_disk(e) or shutil.disk_usage(directory).free < MARGIN):
            raise
        logger.warning("a write failed on a full disk: %s", str(e).splitlines()[0])
        return 1
    return 0


def full_disk(e: BaseException) -> bool:
    """ENOSPC or a full quota, raised here or, under FSDP, by any rank's torch.distributed.checkpoint writer."""
    if isinstance(e, CheckpointException):
        return any(full_disk(error) for error, _ in e.failures.values())
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
