"""Reading what a finished run left behind: its metrics records, step-time medians, checkpoint
sizes and load times.
"""

from __future__ import annotations

import json
import re
import statistics
from datetime import datetime
from pathlib import Path

LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO (strategy in force|resumed from)")


def read_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.exists() else []


def median_after_first(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    values = values[1:] if len(values) > 1 else values  # the first step pays for warm-up and allocation
    return statistics.median(values) if values else None


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_measures(out: Path, steps: int, records: list[dict]) -> tuple[float | None, float | None]:
    """(size in MB, save seconds) of the checkpoint written at the last step: the save as the training script timed
    it (`checkpoint_save_s`, the last one its records hold)."""
    ckpt = out / f"checkpoint-{steps}"
    if not ckpt.is_dir():
        return None, None
    saves = [r["checkpoint_save_s"] for r in records if r.get("checkpoint_save_s") is not None]
    return dir_bytes(ckpt) / 1e6, (saves[-1] if saves else None)


def load_seconds(stderr: str) -> float | None:
    stamps = {}
    for line in stderr.splitlines():
        m = LOG_STAMP.match(line)
        if m:
            stamps[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    if {"strategy in force", "resumed from"} <= stamps.keys():
        return (stamps["resumed from"] - stamps["strategy in force"]).total_seconds()
    return None
