"""The end-of-run summary, as the HF Trainer prints one: what was trained, how fast, on how much memory per rank,
where the model went and how to use it."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import torch
from accelerate.utils import gather_object

from training.loop.metrics import memory_gb


def peak_memory_per_rank(accelerator) -> list[dict[str, float]]:
    """Every rank's peak memory (`memory_gb`), in rank order. A collective: every rank calls it."""
    return gather_object([memory_gb(accelerator.device)])  # collective: all-gather of one small dict per rank


class WallClock:
    """Where this rank's wall time goes, phase by phase: start-up (from the process's start: the interpreter and the
    imports, until `WallClock()` at the top of `main`), then each phase `mark`ed at its end (set-up, training,
    export). A launch's start-up is most of a short run's time."""

    def __init__(self):
        now = time.time()
        self.phases = {"startup": now - psutil.Process().create_time()}
        self.since = now
        self.checkpoint_save: float | None = None  # the last checkpoint's save, inside training

    def saved(self, seconds: float) -> None:
        """A checkpoint was saved in `seconds` (within the training phase): the record keeps the last one's."""
        self.checkpoint_save = seconds

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
        the last checkpoint's save (`checkpoint_save_s`, part of `train_s`) where the run saved one."""
        phases = {f"{k}_s": round(v, 3) for k, v in self.phases.items()}
        saved = {} if self.checkpoint_save is None else {"checkpoint_save_s": round(self.checkpoint_save, 3)}
        return {"step": step, **phases, "wall_s": round(self.total, 3), **saved}

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
    rows.append(("model", str(out)))
    width = max(len(name) for name, _ in rows)
    lines = ["***** run summary *****", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    lines += [
        "load it and generate (the export's generation_config.json holds the sampling settings):",
        "  from transformers import pipeline",
        f'  print(pipeline("text-generation", "{out}", trust_remote_code=True)("def ")[0]["generated_text"])',
    ]
    return "\n".join(lines)
