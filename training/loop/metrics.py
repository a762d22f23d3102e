"""Throughput, MFU and memory, and where the numbers go (rank 0: stdout, metrics.jsonl, trackers)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from pathlib import Path

import psutil
import torch

logger = logging.getLogger("shardgpt")


def memory_gb(device: torch.device) -> dict[str, float]:
    """Peak GPU memory (allocated and reserved by torch) and this process's resident host memory, now and at its
    peak so far (the kernel's high-water mark, `ru_maxrss`: KiB on Linux), in GB."""
    out = {
        "cpu_rss_gb": psutil.Process().memory_info().rss / 1e9,
        "cpu_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }
    if device.type == "cuda":
        out["gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        out["gpu_max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    return out


class StepLog:
    """The running counts behind each log record: the steps since the last record, their losses and times, and
    the updates fp16 loss scaling skipped so far. Under --torch_compile a process's first step compiles the forward
    and backward: its time is reported once, as compile_time_s (compilation and that step), and left out of
    step_time_s, tokens/s and MFU. Times are the host's wall clock around each step; the step's loss `.item()` has
    synchronised the device by then."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, world: int, peak: float | None,
                 device: torch.device, fp16: bool, compiling: bool):  # fmt: skip
        self.tokens_per_step, self.flops_per_step, self.world, self.peak = tokens_per_step, flops_per_step, world, peak
        self.device, self.fp16, self.compiling = device, fp16, compiling
        self.compile_time: float | None = None
        self.skipped = 0
        self.total_time, self.total_timed_steps = 0.0, 0  # this launch's, for the summary's throughput
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.steps, self.train_time, self.timed_steps = 0.0, 0, 0.0, 0
        self.busy: list[float] | None = None  # pipeline runs: each rank's busy share, summed over the steps

    def add(self, result, elapsed: float) -> None:
        """One finished step (a `StepResult`) that took `elapsed` seconds."""
        if self.compiling:
            self.compile_time, self.compiling = elapsed, False
            logger.info("torch.compile: the first step took %.1f s (compilation included)", elapsed)
        else:
            self.train_time, self.timed_steps = self.train_time + elapsed, self.timed_steps + 1
            self.total_time, self.total_timed_steps = self.total_time + elapsed, self.total_timed_steps + 1
        self.loss_sum, self.steps = self.loss_sum + result.loss, self.steps + 1
        self.skipped += result.skipped
        if result.pipeline_busy is not None:
            self.busy = [a + b for a, b in zip(self.busy or [0.0] * len(result.pipeline_busy), result.pipeline_busy,
                                               strict=True)]  # fmt: skip

    def record(self, step: int, lr: float, grad_norm: float | None, epoch: int) -> dict:
        """The record of the steps since the last one (then forgotten). Training only: evaluation, saving and
        compilation are not timed (None: no timed step since the last record)."""
        dt = self.train_time / self.timed_steps if self.timed_steps else None
        record = {
            "step": step,
            "loss": self.loss_sum / self.steps,  # mean over the steps since the last log, as the HF Trainer
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": self.tokens_per_step / dt if dt else None,
            "step_time_s": dt,
            "mfu": self.flops_per_step / dt / self.world / self.peak if self.peak and dt else None,
            "epoch": epoch,
            **memory_gb(self.device),
        }
        if self.compile_time is not None:  # once, in the first record after compilation
            record["compile_time_s"], self.compile_time = self.compile_time, None
        for p, busy in enumerate(self.busy or []):  # each pipeline rank's share of the schedule spent computing
            record[f"pp_rank{p}_busy"] = round(busy / self.steps, 4)  # the rest: the bubble and the waits
        if self.fp16:  # steps whose update loss scaling skipped so far (overflowing gradients)
            record["overflow_skipped_steps"] = self.skipped
        self._reset()
        return record

    @property
    def throughput(self) -> float | None:
        """Tokens/s over every timed step of this launch (None before the first)."""
        return self.tokens_per_step * self.total_timed_steps / self.total_time if self.total_time else None


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` and forwards it to accelerate's trackers.
    Only rank 0 writes; `accelerator.log` is rank-0 gated by accelerate itself."""

    def __init__(self, accelerator, output_dir: str):
        self.accelerator = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        self.latest: dict = {}  # the last value of each metric written, for the end-of-run summary
        if accelerator.is_main_process:
            os.makedirs(output_dir, exist_ok=True)

    def replayed(self, restart: int, step: int) -> dict | None:
        """A restarted generation of workers resuming at `step` (rank 0; None elsewhere): the records of the steps
        after it, which the dead generation logged and this one recomputes, are dropped so that every step is logged
        once. Returns what the fault cost so far: the restart, the steps recomputed and the time of the last record
        before the fault (`restarted_cost` completes it at the first step after)."""
        if not self.accelerator.is_main_process or not self.path.is_file():
            return None
        records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        last_written = self.path.stat().st_mtime
        kept = [r for r in records if r.get("step", 0) <= step]
        logged = max((r["step"] for r in records if "loss" in r), default=step)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        return {"restart": restart, "resumed_at_step": step, "steps_recomputed": max(0, logged - step),
                "last_record_before_fault": last_written}  # fmt: skip

    def restarted_cost(self, replayed: dict, step: int) -> dict:
        """The record of what a restart cost, written at the first step after it (rank 0): the steps recomputed and
        the seconds from the last record before the fault (at most a step before it) to this step's end."""
        cost = {k: v for k, v in replayed.items() if k != "last_record_before_fault"}
        cost["fault_s"] = round(time.time() - replayed["last_record_before_fault"], 2)
        self.write({"step": step, **cost})
        return cost

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.latest.update(clean)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps(clean) + "\n")
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        self.accelerator.log(numeric, step=record["step"])


def format_record(r: dict) -> str:
    """One log line: step, loss, lr, grad norm, tokens/s, MFU and peak memory. MFU needs the device's peak FLOP/s
    (a GPU of `PEAK_FLOPS`, or --peak_flops): without it, as on CPU, the column is left out."""
    mfu = f" | MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    mem = f"gpu {r['gpu_max_allocated_gb']:.2f} GB" if "gpu_max_allocated_gb" in r else ""
    mem += f" rss {r['cpu_rss_gb']:.2f} GB"
    gn = r.get("grad_norm")
    gn = f"{gn:.3f}" if isinstance(gn, float) else "n/a"
    speed = f"{r['tokens_per_sec']:,.0f} tok/s" if r.get("tokens_per_sec") else "compiling"
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad norm {gn} | {speed}{mfu} | {mem.strip()}"
    )
