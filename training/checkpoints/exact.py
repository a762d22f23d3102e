"""A resume is exact or says why not: before anything loads a checkpoint, its pickles are checked for code they could
run (training/checkpoints/safety.py) and the files an exact continuation needs are read: every rank's random states
(accelerate skips one it cannot load with an info line and carries on), the learning-rate schedule, and the data
loader's position.

A random state that is missing or unreadable ends the resume in one line naming it, or, with `--resume_inexact`,
resumes saying in one line that this launch's random states replace it. A missing schedule or loader position always
ends it: without them the run would not be the one that was saved.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from training.checkpoints import safety
from training.checkpoints.portable import STATE, random_state_file, read_random_state
from training.checkpoints.safety import safe_load

logger = logging.getLogger("shardgpt")

LOADER_KEYS = ("epoch", "step", "seed", "global_batch_size", "num_blocks")  # data.loader's state_dict


class InexactResumeError(ValueError):
    """A checkpoint lacks a file an exact continuation needs: nothing was loaded."""

    same_on_every_rank = True


def check_resumable(path: Path, trust: bool = False, inexact: bool = False, say: bool = True) -> None:
    """Refuse, in one line, a checkpoint that could run code (unless `trust`: --trust_checkpoint) or that lacks what
    an exact resume needs (but random states, with `inexact`: --resume_inexact). `say`: log what a flag gave up (on
    the rank that decides, after the process group; before it every rank checks, silently)."""
    lenient = [p.name for p in path.glob("random_states_*.pkl")] if inexact else ()
    safety.check_checkpoint(path, trust, lenient=lenient, say=say)
    try:
        state = json.loads((path / STATE).read_text())
        world = int(state["strategy"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{path / STATE} cannot be read ({type(e).__name__}: {e})"
        raise InexactResumeError(f"{why}: restore it from a copy, or resume from another checkpoint") from None
    loader = state.get("loader") or {}
    if missing := [key for key in LOADER_KEYS if key not in loader]:
        raise InexactResumeError(
            f"{path / STATE} holds no data loader position ({', '.join(missing)} missing): the resumed run would not "
            "see the batches the saved one would have; restore the file from a copy, or resume from another checkpoint"
        )
    if why := unreadable_schedule(path):
        raise InexactResumeError(
            f"{why}: the learning-rate schedule cannot continue where it stopped; restore the file from a copy, or "
            "resume from another checkpoint"
        )
    lost = [why for rank in range(world) if (why := read_random_state(random_state_file(path, rank))[1])]
    if lost and not inexact:
        raise InexactResumeError(
            f"{lost[0]}: the resumed run would not draw the random numbers the saved one would have; restore the file "
            "from a copy, resume from another checkpoint, or pass --resume_inexact to continue with fresh ones"
        )
    if lost and say:
        logger.warning("resuming inexactly (--resume_inexact): %s; this launch's random states replace it", lost[0])


def unreadable_schedule(path: Path) -> str | None:
    """Why the checkpoint's scheduler state cannot be read, or None: accelerate's `scheduler.bin`, or, where a
    DeepSpeed engine owned the schedule, its model states (read by DeepSpeed itself)."""
    file = path / "scheduler.bin"
    if not file.is_file():
        return None if list(path.glob("*/*model_states.pt")) else f"{file} is missing"
    try:
        safe_load(file)
    except Exception as e:  # accelerate's own load would end the run in a traceback
        return f"{file} cannot be read ({type(e).__name__})"
    return None
