"""What a launch's strategy.json says its ranks sent in the counted step, against the closed form for the settings
in force (training/loop/comms.py's `expected_payloads`; `autotp_payloads` under AutoTP, `ulysses_payloads` under
sequence parallelism)."""

from __future__ import annotations

import json
from dataclasses import replace

from model import ShardGPTConfig
from training.plan.communication import ModelShape, paper_volume, step_payloads
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
    if seen.get("pipeline"):  # the schedule in force, which the name does not spell
        pipe = seen["pipeline"]
        strategy = replace(strategy, pp_schedule=pipe["schedule"], pp_stages_per_rank=pipe["stages_per_rank"])
    zero = (ds or {}).get("zero_optimization", {})
    threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if strategy.zero_stage == 3 else 0
    shape = ModelShape.of(ShardGPTConfig.from_pretrained(run.output_dir), threshold)
    assert shape.parameters == seen["parameters"], (shape, seen["parameters"])
    return strategy, shape


def closed_form(run, strategy: Strategy, shape: ModelShape, rank: int = 0) -> dict[str, int]:
    """training/plan/communication.py's closed form for the launch's global rank `rank`: AutoTP's from the split
    modules strategy.json lists, AutoTP's, Ulysses' and a pipeline's from the micro batches run_config.json holds, the
    data-parallel strategies' from the strategy alone."""
    flags = json.loads((run.output_dir / "run_config.json").read_text())
    tokens = flags["per_device_train_batch_size"] * flags["block_size"]  # a micro batch's, whole sequences
    micro_batches = flags["gradient_accumulation_steps"]
    config = ShardGPTConfig.from_pretrained(run.output_dir)
    split = (run.strategy.get("tensor_parallel") or {}).get("split_modules")  # under AutoTP
    optim = flags.get("optim", "adamw_torch")
    want = step_payloads(strategy, shape, config, tokens, micro_batches, split, rank=rank, optim=optim)
    assert want is not None, f"no closed form for {strategy.name}"
    return want


def assert_closed_form(run, step: int = 3) -> dict[str, int]:
    """Every rank's record of `step`: each kind's payload equals the closed form to the byte, but for the scalars'
    all-reduces (at most SCALARS bytes), and no other kind of collective ran. Returns the closed form."""
    seen = run.strategy
    comm = seen["communication"]
    assert (comm["step"], comm["world_size"], len(comm["per_rank"])) == (step, seen["world_size"], seen["world_size"])
    strategy, shape = launched(run)
    for rank, record in enumerate(comm["per_rank"]):
        want = closed_form(run, strategy, shape, rank)  # a pipeline's ranks differ by their stages
        got = {kind: count["payload_bytes"] for kind, count in record["kinds"].items()}
        extra = {kind: got.get(kind, 0) - want.get(kind, 0) for kind in got.keys() | want.keys()}
        scalars = extra.pop("all_reduce", 0)
        assert 0 < scalars <= SCALARS and not any(extra.values()), (rank, got, want)
        paper = paper_volume(strategy, shape.parameters)
        paper = "none" if paper is None else f"{paper / 4 / shape.parameters:.0f} Psi"
        print(f"rank {rank}: {record['volume_bytes'] / 4 / shape.parameters:.4f} Psi per step; the paper's {paper}")
    return want
