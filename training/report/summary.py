"""The end-of-run summary, as the HF Trainer prints one: what was trained, how fast, on how much memory per rank,
where the model went and how to use it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import torch
from accelerate.utils import gather_object

from training.loop.metrics import memory_gb


def peak_memory_per_rank(accelerator, clock: WallClock | None = None) -> list[dict[str, float]]:
    """Every rank's peak memory (`memory_gb`), and its host peaks during the clock's checkpoint phases, in rank
    order. A collective: every rank calls it."""
    peaks = {} if clock is None else {f"{k}_peak_rss_gb": v / 1e9 for k, v in clock.peaks.items()}
    peaks |= {} if clock is None else {f"{k}_added_rss_gb": v / 1e9 for k, v in clock.added.items()}
    return gather_object([memory_gb(accelerator.device) | peaks])  # collective: all-gather of a small dict per rank


class HostPeak:
    """This process's resident host memory, sampled in a thread every `interval` s while the `with` block runs:
    `peak` (bytes) once it ends. What a save, a load or the export's gather holds at once, the threads of a
    background writer included."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.peak = interval, 0
        self._done = threading.Event()

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, process.memory_info().rss)

    def __enter__(self) -> HostPeak:
        self.start = self.peak = psutil.Process().memory_info().rss  # `peak - start`: what the block added
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


class WallClock:
    """Where this rank's wall time goes, phase by phase: start-up (from the process's start: the interpreter and the
    imports, until `WallClock()` at the top of `main`), then each phase `mark`ed at its end (set-up, training,
    export). A launch's start-up is most of a short run's time."""

    def __init__(self):
        now = time.time()
        self.phases = {"startup": now - psutil.Process().create_time()}
        self.since = now
        self.seconds: dict[str, float] = {}  # checkpoint_save (the last one's, inside training), checkpoint_load
        self.peaks: dict[str, int] = {}  # this rank's host peak during each, in bytes (the highest save's)
        self.added: dict[str, int] = {}  # and how far above its start the peak rose

    def measured(self, what: str, seconds: float, peak: HostPeak) -> None:
        """`what` (checkpoint_save, checkpoint_load, export) took `seconds` and peaked at `peak`'s host memory."""
        self.seconds[what] = seconds
        self.peaks[what] = max(self.peaks.get(what, 0), peak.peak)
        self.added[what] = max(self.added.get(what, 0), peak.peak - peak.start)

    def mark(self, phase: str) -> None:
        """End `phase` now: the time since the previous mark (or since the start-up) is its."""
        now = time.time()
        self.phases[phase] = now - self.since
        self.since = now

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def record(self, step: int) -> dict:
        """A metrics.jsonl record of the phases, in seconds (`startup_s`, `setup_s`, ...) and their sum, `wall_s`, and
        the last checkpoint's save (`checkpoint_save_s`, part of `train_s`; under --save_async the step's wait for
        the copy) and the resume's load (`checkpoint_load_s`, part of `setup_s`) where the run had them, and the
        export; with this rank's host peak during each (`<phase>_peak_rss_gb`) and how far it rose above the phase's
        start (`<phase>_added_rss_gb`)."""
        phases = {f"{k}_s": round(v, 3) for k, v in self.phases.items()}
        measured = {f"{k}_s": round(v, 3) for k, v in self.seconds.items()}
        peaks = {f"{k}_peak_rss_gb": round(v / 1e9, 3) for k, v in self.peaks.items()}  # this rank's
        peaks |= {f"{k}_added_rss_gb": round(v / 1e9, 3) for k, v in self.added.items()}
        return {"step": step, **phases, "wall_s": round(self.total, 3), **measured, **peaks}

    def describe(self) -> str:
        """`1 min 49 s: start-up 9 s, set-up 6 s, training 1 min 20 s, export 14 s`."""
        names = {"startup": "start-up", "setup": "set-up", "train": "training"}
        parts = ", ".join(f"{names.get(k, k)} {duration(v)}" for k, v in self.phases.items())
        return f"{duration(self.total)}: {parts}"


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def memory_line(memory: dict[str, float]) -> str:
    gpu = f"GPU {memory['gpu_max_allocated_gb']:.2f} GB allocated, " if "gpu_max_allocated_gb" in memory else ""
    return f"{gpu}host {memory['cpu_peak_rss_gb']:.2f} GB resident"


def run_summary(
    steps: int, tokens_per_step: int, clock: WallClock, throughput: float | None, latest: dict, memory: list[dict],
    out: Path, device: torch.device,
) -> str:  # fmt: skip
    """The summary's lines. `clock`: this launch's phases; `latest`: the last value of each metric logged
    (`MetricsWriter.latest`); `throughput`: tokens/s over this launch's timed steps; `memory`:
    `peak_memory_per_rank`'s list."""
    rows = [
        ("steps", f"{steps:,} ({steps * tokens_per_step:,} tokens seen)"),
        ("wall time", clock.describe()),
    ]
    if "loss" in latest:
        rows.append(("train loss", f"{latest['loss']:.4f} (the last logged)"))
    if "eval_loss" in latest:
        rows.append(("eval loss", f"{latest['eval_loss']:.4f} (perplexity {latest['eval_perplexity']:,.2f})"))
    if throughput:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
        rows.append(("throughput", f"{throughput:,.0f} tokens/s on {len(memory)} x {name} (training steps only)"))
    rows += [(f"peak memory rank {rank}", memory_line(m)) for rank, m in enumerate(memory)]
    if "restart" in latest:  # a restarted generation: what the fault cost (metrics.jsonl's record of it)
        rows.append(("restarted", f"restart {latest['restart']} resumed at step {latest['resumed_at_step']}: "
                                  f"{latest['steps_recomputed']} steps recomputed, {latest['fault_s']:.1f} s from the "
                                  "last record before the fault to the first step after it"))  # fmt: skip
    rows.append(("model", str(out)))
    width = max(len(name) for name, _ in rows)
    lines = ["***** run summary *****", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    lines += [
        "load it and generate (the export's generation_config.json holds the sampling settings):",
        "  from transformers import pipeline",
        f'  print(pipeline("text-generation", "{out}", trust_remote_code=True)("def ")[0]["generated_text"])',
    ]
    return "\n".join(lines)
