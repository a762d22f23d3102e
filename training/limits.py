"""The step limits the flags set: --profile_steps' window of optimizer steps (between checkpoints), and the step
watchdog's default deadline and the exit status of a rank it stops (--step_timeout)."""

from __future__ import annotations

HUNG = 124  # exit status of a rank stopped by --step_timeout (as timeout(1) exits)
# --step_timeout's default. A phase of unknown length (an evaluation, a save: disk-bound) and the first training steps
# (compilation, warm-up) get the ceiling, below the process group's 30-minute collective timeout; once STEPS_MEASURED
# steps have run, a training step gets STEP_FACTOR times the slowest of them after the first, and at least STEP_FLOOR:
# a frozen rank is then found in minutes, not the process group's 30.
PHASE_CEILING = 1200.0  # seconds
STEP_FACTOR, STEP_FLOOR, STEPS_MEASURED = 10.0, 120.0, 3


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


def check_profile_steps(profile_steps: str, max_steps: int, save_steps: int) -> None:
    """--profile_steps inside --max_steps, and between checkpoints."""
    first, last = parse_steps(profile_steps)
    if last > max_steps:
        raise ValueError(f"--profile_steps {profile_steps} ends after --max_steps {max_steps}: profile earlier steps")
    # A checkpoint inside the window would be recorded as part of the steps; and torch 2.13's profiler with
    # stacks fails to read back the events of FSDP's checkpoint-writer threads (UnicodeDecodeError).
    saves = [s for s in range(first, last) if save_steps and s % save_steps == 0]
    if saves:
        raise ValueError(
            f"--profile_steps {profile_steps} spans checkpoint-{saves[0]} (--save_steps {save_steps}): "
            f"profile steps between checkpoints, such as {saves[0] + 1}-{saves[0] + 1 + last - first}"
        )
