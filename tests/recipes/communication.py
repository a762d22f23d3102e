"""What a launch's strategy.json says its ranks sent in the counted step, against the closed form for the settings
in force (training/comms.py's `expected_payloads`)."""

from __future__ import annotations

import json
from dataclasses import replace

from model import ShardGPTConfig
from training.comms import ModelShape, expected_payloads, paper_volume
from training.strategy import Strategy

# The all-reduces of the step's loss and gradient norm (and DeepSpeed's overflow check): a few scalars, 84 bytes at
# most as measured (FSDP2: the loss and a norm per parameter tensor, 21 floats); the bound leaves room for a few more.
SCALARS = 256


def launched(run) -> tuple[Strategy, ModelShape]:
    """The strategy strategy.json names, with the run's resolved DeepSpeed JSON, and the exported model's shape."""
    seen = run.strategy
    ds_file = run.output_dir / "ds_config.json"
    ds = json.loads(ds_file.read_text()) if ds_file.exists() else None
    strategy = replace(Strategy.from_name(seen["strategy"], seen["world_size"]), deepspeed=ds)
    zero = (ds or {}).get("zero_optimization", {})
    threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if strategy.zero_stage == 3 else 0
    shape = ModelShape.of(ShardGPTConfig.from_pretrained(run.output_dir), threshold)
    assert shape.parameters == seen["parameters"], (shape, seen["parameters"])
    return strategy, shape


def assert_closed_form(run, step: int = 3) -> dict | None:
    """Every rank's record of `step`: where a closed form is known, each kind's payload equals it to the byte, but
    for the scalars' all-reduces (at most SCALARS bytes), and no other kind of collective ran. Returns the closed
    form (None: unknown for this strategy; then the record is only checked to exist on every rank)."""
    seen = run.strategy
    comm = seen["communication"]
    assert (comm["step"], comm["world_size"], len(comm["per_rank"])) == (step, seen["world_size"], seen["world_size"])
    strategy, shape = launched(run)
    want = expected_payloads(strategy, shape)
    for rank, record in enumerate(comm["per_rank"]):
        got = {kind: count["payload_bytes"] for kind, count in record["kinds"].items()}
        if want is None:
            assert record["volume_bytes"] > 0, (rank, record)
            continue
        extra = {kind: got.get(kind, 0) - want.get(kind, 0) for kind in got.keys() | want.keys()}
        scalars = extra.pop("all_reduce", 0)
        assert 0 < scalars <= SCALARS and not any(extra.values()), (rank, got, want)
        paper = paper_volume(strategy, shape.parameters)
        print(f"rank {rank}: {record['volume_bytes'] / 4 / shape.parameters:.4f} Psi per step; the paper's "
              f"{paper / 4 / shape.parameters:.0f} Psi")  # fmt: skip
    return want
