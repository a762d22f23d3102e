"""The training curves of a run as one picture: training and evaluation loss, learning rate and tokens/s against
the optimizer step, drawn from the run's metrics.jsonl (training/loop/metrics.py writes its records)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = "training_curves.png"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under `key`."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def plot_training_curves(metrics: Path, out: Path | None = None) -> Path:
    """Draw metrics.jsonl's curves into `out` (default: training_curves.png beside it); returns its path."""
    # A Figure of its own, drawn to a file: no pyplot (its global state and backend machinery), no display.
    from matplotlib.figure import Figure

    metrics = Path(metrics)
    out = Path(out) if out is not None else metrics.with_name(CURVES)
    records = read_metrics(metrics)
    if not any("loss" in r for r in records):
        raise ValueError(f"{metrics} holds no training-loss record: pass a metrics.jsonl that recipes/train.py wrote")
    fig = Figure(figsize=(7, 7))
    loss, lr, speed = fig.subplots(3, 1, sharex=True, height_ratios=(2, 1, 1))
    loss.plot(*series(records, "loss"), label="training (mean since the last log)", color="tab:blue")
    eval_steps, eval_loss = series(records, "eval_loss")
    if eval_steps:
        loss.plot(eval_steps, eval_loss, "o-", label="evaluation", color="tab:orange")
    loss.set_ylabel("loss (nats/token)")
    loss.legend()
    lr.plot(*series(records, "lr"), color="tab:green")
    lr.set_ylabel("learning rate")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    steps, tokens_per_sec = series(records, "tokens_per_sec")
    speed.plot(steps, tokens_per_sec, color="tab:purple")
    speed.set_ylabel("tokens/s")
    speed.set_ylim(0, 1.15 * max(tokens_per_sec, default=1))  # from 0, so a change reads as its true size
    speed.set_xlabel("optimizer step")
    for ax in (loss, lr, speed):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{metrics.parent.name}: {max(r['step'] for r in records)} steps")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
