"""`--step_timeout`: a step that outlives its deadline ends the run, naming the ranks that hang and where.

A thread per rank is armed when a step starts and told each phase of it (train_step, profile_export, evaluate,
save, agree_on_stop); each phase but the profile's export (local work) has a deadline: --step_timeout seconds when
given, else one measured (training/limits.py): a training step gets 10 times the slowest step seen after the first
(at least 2 minutes) once three have run, and the rest of a step that evaluates or saves, like the first steps, the
20-minute ceiling. When a deadline passes, the step's collectives are blocked, so nothing goes through the process
group: each rank writes `output_dir/hang/rank<k>.txt` (its step and phase, then every thread's Python stack from
`faulthandler`); rank 0 waits a little for the others' files, reads them, prints which rank hangs in which phase and
frame (a rank that wrote nothing is named as dead, frozen or stuck outside Python) and writes `hang/report.txt`;
every rank exits with status `HUNG`, which a restarting launcher (--max-restarts) answers with a new generation that
resumes by itself. Checkpoints are complete only once their marker is written, so the last complete one stays intact
whatever a step was doing. On GPUs, torch's own `TORCH_NCCL_DUMP_ON_TIMEOUT` adds NCCL's view (docs/debugging.md).
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import threading
import time
from pathlib import Path

from training.limits import HUNG, PHASE_CEILING, STEP_FACTOR, STEP_FLOOR, STEPS_MEASURED

REPORT = "report.txt"
# A frame of faulthandler's dump: `  File "/path/x.py", line 12 in func`.
FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/", "accelerate/utils/operations.py")
LONG_PHASES = ("evaluate", "save")  # disk- or data-bound, of no measured length: the ceiling for the rest of the step


class StepWatchdog:
    """Call `arm(step)` when a step starts, `phase(name)` as it moves on; `stop()` when the loop ends.

    `timeout`: seconds for every timed phase, or None for the measured deadlines (the module's docstring); `floor`
    and `ceiling` bound those."""

    def __init__(self, timeout: float | None, output_dir: str, rank: int, world_size: int,
                 floor: float = STEP_FLOOR, ceiling: float = PHASE_CEILING):  # fmt: skip
        self.timeout, self.floor, self.ceiling = timeout, floor, ceiling
        self.rank, self.world_size = rank, world_size
        self.folder = Path(output_dir) / "hang"
        self.step, self.where, self.deadline, self.allowed = 0, "start", None, 0.0
        self.step_seconds: list[float] = []  # each training step's, measured from arm() to the next phase
        self.started, self.long = 0.0, False
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    def arm(self, step: int, where: str = "train_step") -> None:
        self.step, self.started, self.long = step, time.monotonic(), False
        self._enter(where)

    def phase(self, where: str, timed: bool = True) -> None:
        """The step moves on to `where`, which gets a deadline of its own (none if not `timed`)."""
        if self.where == "train_step":
            self.step_seconds.append(time.monotonic() - self.started)
        self._enter(where, timed)

    def allowance(self, where: str) -> float:
        """Seconds `where` may take: --step_timeout's, or the measured default's."""
        self.long |= where in LONG_PHASES
        if self.timeout is not None:
            return self.timeout
        if self.long or len(self.step_seconds) < STEPS_MEASURED:
            return self.ceiling
        return round(min(self.ceiling, max(self.floor, STEP_FACTOR * max(self.step_seconds[1:]))), 1)

    def stop(self) -> None:
        self.stopped.set()

    def _enter(self, where: str, timed: bool = True) -> None:
        self.allowed = self.allowance(where) if timed else 0.0
        self.where, self.deadline = where, time.monotonic() + self.allowed if timed else None

    def _watch(self) -> None:
        while not self.stopped.wait(min((self.timeout or self.floor) / 10, 1.0)):
            if self.deadline is not None and time.monotonic() > self.deadline:
                self._dump_and_exit()

    def _dump_and_exit(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        mine = self.folder / f"rank{self.rank}.txt"
        with open(mine.with_suffix(".tmp"), "w") as f:
            f.write(f"rank {self.rank} step {self.step} phase {self.where}: no progress for {self.allowed:g} s\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        mine.with_suffix(".tmp").rename(mine)  # complete or absent: rank 0 never reads half a dump
        grace = time.monotonic() + min(max(self.allowed, 10.0), 60.0)  # the others' deadlines pass about now too
        if self.rank == 0:  # rank 0 only: one report for the run, from the files (no collective can run)
            while time.monotonic() < grace and len(list(self.folder.glob("rank*.txt"))) < self.world_size:
                time.sleep(0.2)
            how = "--step_timeout" if self.timeout is not None else "--step_timeout's measured default"
            report = hang_report(self.folder, self.world_size, self.step, self.allowed, how)
            (self.folder / REPORT).write_text(report + "\n")
            print(report, file=sys.stderr, flush=True)
        else:  # leave rank 0 time to report before the launcher, seeing this rank end, stops the others
            while time.monotonic() < grace + 5 and not (self.folder / REPORT).exists():
                time.sleep(0.2)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HUNG)


class NoWatchdog(StepWatchdog):
    """--step_timeout off: no thread, nothing to do."""

    def __init__(self):
        pass

    def allowance(self, where: str) -> float:
        return 0.0

    def arm(self, step: int, where: str = "train_step") -> None:
        pass

    def phase(self, where: str, timed: bool = True) -> None:
        pass

    def stop(self) -> None:
        pass


def make_watchdog(timeout: float | None, output_dir: str, rank: int, world_size: int) -> StepWatchdog:
    """None: the default, measured deadlines (on CPU and GPU alike); 0: off; else seconds for every phase."""
    return NoWatchdog() if timeout == 0 else StepWatchdog(timeout, output_dir, rank, world_size)


def main_thread_frames(dump: str) -> list[dict]:
    """The frames of the thread that runs the script (its stack holds `<module>`), innermost first."""
    for block in re.split(r"\n(?=\S)", dump):
        frames = [m.groupdict() for m in FRAME.finditer(block)]
        if frames and frames[-1]["func"] == "<module>":
            return frames
    return []


def where_stuck(dump: str) -> str:
    """`phase P, in collective all_reduce (file:line)` or `phase P, at file:line in func`, from a rank's dump."""
    header = dump.splitlines()[0] if dump else ""
    phase = re.search(r"phase (\S+):", header)
    frames = main_thread_frames(dump)
    said = f"step {header.split()[3]} phase {phase[1]}" if phase else "unknown phase"
    hits = [i for i, f in enumerate(frames) if any(part in f["file"] for part in COLLECTIVE_FILES)]
    if hits:  # the innermost frame in torch.distributed (or DeepSpeed's comm), and this project's calls to it
        collective = frames[hits[0]]
        ours = [f for f in frames[hits[0] :] if "site-packages" not in f["file"] and f["func"] != "run_rank"]
        via = " < ".join(f"{short(f)} {f['func']}" for f in ours[:3])
        return f"{said}, waiting in collective {collective['func']} ({short(collective)}, called from {via})"
    if frames:
        return f"{said}, at {short(frames[0])} in {frames[0]['func']}"
    return said


def short(frame: dict) -> str:
    parts = Path(frame["file"]).parts
    return f"{'/'.join(parts[-2:])}:{frame['line']}"


def hang_report(folder: Path, world_size: int, step: int, timeout: float, how: str = "--step_timeout") -> str:
    lines = [f"error: step {step} made no progress for {timeout:g} s ({how}); where each rank is:"]
    for rank in range(world_size):
        dump = folder / f"rank{rank}.txt"
        if dump.exists():
            lines.append(f"  rank {rank}: {where_stuck(dump.read_text())}")
        else:
            lines.append(f"  rank {rank}: wrote no stack: dead, frozen, or stuck in native code holding the GIL")
    lines.append(f"stacks of every thread: {folder}/rank<k>.txt; the last complete checkpoint is intact")
    return "\n".join(lines)
