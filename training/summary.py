"""The end-of-run summary, as the HF Trainer prints one: what was trained, how fast, on how much memory per rank,
where the model went and how to use it."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import gather_object

from training.metrics import memory_gb


def peak_memory_per_rank(accelerator) -> list[dict[str, float]]:
    """Every rank's peak memory (`memory_gb`), in rank order. A collective: every rank calls it."""
    return gather_object([memory_gb(accelerator.device)])  # collective: all-gather of one small dict per rank


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def memory_line(memory: dict[str, float]) -> str:
    gpu = f"GPU {memory['gpu_max_allocated_gb']:.2f} GB allocated, " if "gpu_max_allocated_gb" in memory else ""
    return f"{gpu}host {memory['cpu_peak_rss_gb']:.2f} GB resident"


def run_summary(
    steps: int, tokens_per_step: int, seconds: float, throughput: float | None, latest: dict, memory: list[dict],
    out: Path, device: torch.device,
) -> str:  # fmt: skip
    """The summary's lines. `latest`: the last value of each metric logged (`MetricsWriter.latest`); `throughput`:
    tokens/s over this launch's timed steps; `memory`: `peak_memory_per_rank`'s list."""
    rows = [
        ("steps", f"{steps:,} ({steps * tokens_per_step:,} tokens seen)"),
        ("wall time", f"{duration(seconds)} (this launch, set-up and export included)"),
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
