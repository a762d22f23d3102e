"""The step limits the flags set: --profile_steps' window of optimizer steps, and the step watchdog's default
deadline and the exit status of a rank it stops (--step_timeout)."""

from __future__ import annotations

HUNG = 124  # exit status of a rank stopped by --step_timeout (as timeout(1) exits)
GPU_STEP_TIMEOUT = 1200.0  # seconds; below the process group's 30-minute collective timeout


def parse_steps(spec: str) -> tuple[int, int]:
    """`"3-4"` -> (3, 4); `"5"` -> (5, 5): the first and last optimizer step to record, counted from 1."""
    first, _, last = spec.partition("-")
    try:
        steps = int(first), int(last or first)
    except ValueError:
        steps = (0, 0)
    if not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"--profile_steps {spec!r}: give `first-last` optimizer steps counted from 1, such as 3-4")
    return steps
