"""What `--report_to` trackers wrote, read back from their files: TensorBoard event files and an offline W&B run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

# metrics.jsonl keys that trackers do not get (accelerate.log takes numbers; the step is the x axis).
NOT_LOGGED = {"step"}


def tensorboard_scalars(output_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} from the event files of accelerate's TensorBoard tracker (output_dir/shardgpt/)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "shardgpt"), size_guidance={"scalars": 0}).Reload()
    by_step: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for point in events.Scalars(tag):
            by_step.setdefault(point.step, {})[tag] = point.value
    return by_step


def wandb_records(path: Path) -> list[bytes]:
    """The records of a `.wandb` transaction log: W&B's LevelDB-style log (a 7-byte file header `:W&B`, magic
    0xBEE1, version; then 32 KiB blocks of records, each a 7-byte header of CRC-32, length and type FULL=1,
    FIRST=2, MIDDLE=3, LAST=4, a record cut across blocks being joined from its pieces). wandb 0.31 has no
    reader of its own for an offline run (`wandb.Api` needs the server)."""
    data, block, records, pending = path.read_bytes(), 32768, [], b""
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding at the end of the file
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_history(wandb_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the one offline W&B run under wandb_dir/wandb/ (--output_dir, or the user's
    WANDB_DIR)."""
    from wandb.proto import wandb_internal_pb2

    runs = list((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run (rank 0 only): {runs}"
    by_step: dict[int, dict[str, float]] = {}
    for raw in wandb_records(runs[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop("_step", record.history.step.num)
        by_step.setdefault(int(step), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return by_step


def assert_same_as_metrics(logged: dict[int, dict[str, float]], records: list[dict], tracker: str) -> None:
    """Every number of every metrics.jsonl record reached the tracker at the record's step, once (rank 0 alone)."""
    expected: dict[int, dict[str, float]] = {}
    for r in records:
        numbers = {k: v for k, v in r.items() if isinstance(v, (int, float)) and k not in NOT_LOGGED}
        expected.setdefault(r["step"], {}).update(numbers)
    assert sorted(logged) == sorted(expected), f"{tracker}: steps {sorted(logged)} != {sorted(expected)}"
    for step, numbers in expected.items():
        assert logged[step].keys() == numbers.keys(), f"{tracker} step {step}: {logged[step]} != {numbers}"
        for key, value in numbers.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-6), f"{tracker} step {step} {key}"
