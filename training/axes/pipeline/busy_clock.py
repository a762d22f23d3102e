"""How long a pipeline rank's stages compute in a step, forward and backward, against the schedule's whole time: the
rest is the bubble and the waits on the neighbouring stages (the `pp_rank<p>_busy` of every metrics record).
"""

from __future__ import annotations

import time

import torch


class BusyClock:
    """How long a rank's stages compute in a step, forward and backward, against the schedule's whole time: the
    rest is the bubble and the waits on the neighbouring stages. The host's clock on CPU; CUDA events on GPUs, whose
    kernels run asynchronously (read after the step has synchronised the device). Under the zero-bubble schedules a
    stage's weight gradients are computed apart from its backward: those schedules are not timed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple] = []
        self.open: list = []  # backwards started, not yet ended

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def busy_fraction(self, start, end) -> float:
        """The share of [start, end] spent in the spans recorded since the last call (then forgotten)."""
        busy = sum(self.seconds(a, b) for a, b in self.spans)
        self.spans, self.open = [], []
        return busy / max(self.seconds(start, end), 1e-9)


class BackwardMark(torch.autograd.Function):
    """Identity; its backward marks where a stage's backward starts (at the stage's output) or ends (its input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: BusyClock, starts: bool) -> torch.Tensor:
        ctx.clock, ctx.starts = clock, starts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.starts:
            ctx.clock.open.append(ctx.clock.mark())
        elif ctx.clock.open:
            ctx.clock.spans.append((ctx.clock.open.pop(), ctx.clock.mark()))
        return grad, None, None
