"""`--profile`: a torch.profiler trace of a few optimizer steps on every rank, and a summary table on rank 0.

Each rank writes `output_dir/profile/rank<k>/rank<k>.<time>.pt.trace.json`, a Chrome trace that Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin (`tensorboard --logdir output_dir/profile`)
all read. On a GPU the same steps also leave `memory_snapshot.pickle` (torch.cuda.memory's allocator history, for
pytorch.org/memory_viz). Off, the profiler is `NO_PROFILER`, whose hooks do nothing. docs/debugging.md reads a trace.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

from training.compat import dump_cuda_memory_snapshot, record_cuda_memory_history
from training.limits import parse_steps

SUMMARY_ROWS = 15


class StepProfiler:
    """Records steps `first`..`last` of this rank: `begin(step)` before a step, `end(step)` after it, `write()`
    when the step's time is taken."""

    def __init__(self, output_dir: str, steps: tuple[int, int], rank: int, device: torch.device):
        self.first, self.last = steps
        self.rank, self.device = rank, device
        self.folder = Path(output_dir) / "profile" / f"rank{rank}"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.torch_profiler = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=True)
        self.label, self.recording, self.unwritten = None, False, False

    def begin(self, step: int) -> None:
        if step == self.first:
            if self.device.type == "cuda":  # CUDA only: the caching allocator's history (no CPU counterpart)
                record_cuda_memory_history()
            self.torch_profiler.start()
            self.recording = True
        if self.recording and self.first <= step <= self.last:  # a named range per step in the trace
            self.label = record_function(f"optimizer_step#{step}")
            self.label.__enter__()

    def end(self, step: int) -> None:
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if step != self.last or not self.recording:  # a run resumed past the first step records nothing
            return
        self.torch_profiler.stop()
        self.recording, self.unwritten = False, True

    def write(self) -> bool:
        """After the last profiled step: this rank's trace, its memory snapshot, rank 0's table; else nothing.
        Apart from `end`, so that the step's time and --step_timeout's deadlines leave it out. True if written."""
        if not self.unwritten:
            return False
        self.unwritten = False
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(self.torch_profiler)
        if self.device.type == "cuda":
            dump_cuda_memory_snapshot(str(self.folder / "memory_snapshot.pickle"))
        if self.rank == 0:  # rank 0 only: one table for the run (every rank has its own trace)
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = ops_only(self.torch_profiler.key_averages()).table(sort_by=sort, row_limit=SUMMARY_ROWS)
            print(f"profile of steps {self.first}-{self.last} (rank 0, top ops by self time):\n{table}", flush=True)
            print(f"traces of every rank in {self.folder.parent}", flush=True)
        return True

    def records(self, step: int) -> bool:
        """Whether `step` is one of the steps this profiler records."""
        return self.first <= step <= self.last

    @contextmanager
    def step(self, step: int):
        self.begin(step)
        yield
        self.end(step)


def ops_only(averages: EventList) -> EventList:
    """The operators (aten::, c10d::, record_function ranges) without the Python frames `with_stack` adds, such as
    other threads' `threading.py(...): wait` that would top a CPU table."""
    ops = [e for e in averages if ".py(" not in e.key and not e.key.startswith("<built-in")]
    return EventList(ops, profile_memory=True)


class NullProfiler(StepProfiler):
    """The profiler when --profile is off: every hook does nothing."""

    def __init__(self):
        pass

    def records(self, step: int) -> bool:
        return False

    def begin(self, step: int) -> None:
        pass

    def end(self, step: int) -> None:
        pass

    def write(self) -> bool:
        return False


NO_PROFILER = NullProfiler()


def make_profiler(cfg, rank: int, device: torch.device) -> StepProfiler:
    if not cfg.profile:
        return NO_PROFILER
    return StepProfiler(cfg.output_dir, parse_steps(cfg.profile_steps), rank, device)
