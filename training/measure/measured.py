"""Measured model-state memory beside its predictions: the launches of `recipes/measure/measure_memory.py`,
their per-rank records, and each set against the planner and the ZeRO paper's formulas, term by term.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from model import ShardGPTConfig
from training.paths import ROOT
from training.plan.memory import planner as pm
from training.plan.memory.layout import Layout, layout, zero_config
from training.plan.memory.states import Item, bytes_by_category, model_states
from training.strategy import Strategy

LAUNCHES = [("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"), ("fsdp", "fp32"),
            ("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "bf16")]  # fmt: skip


def launch_command(config: str, precision: str, preset: str, output_dir: Path) -> list[str]:
    """The command that measures one launch (2 ranks, as accelerate_configs/ says)."""
    with socket.socket() as s:  # a free port: other jobs may be training on this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
           "--main_process_port", str(port), str(ROOT / "recipes" / "measure" / "measure_memory.py"),
           f"--preset={preset}",
           "--per_device_train_batch_size=1", "--block_size=64", f"--output_dir={output_dir}"]  # fmt: skip
    return cmd + (["--bf16"] if precision == "bf16" else [])


def load(run_dir: Path) -> list[dict]:
    """Every rank's record of one launch, by rank."""
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("memory_rank*.json"))]
    if not records:
        raise FileNotFoundError(f"no memory_rank*.json in {run_dir}: run recipes/measure/measure_memory.py there first")
    return sorted(records, key=lambda r: r["rank"])


def recorded_strategy(record: dict) -> Strategy:
    """The strategy a record measured, as its name and world size say."""
    return Strategy.from_name(record["strategy"], record["world_size"])


def planner_inputs(record: dict) -> tuple[Layout, Strategy, dict | None]:
    """The planner's view of a measured launch: the layout of the model (of one tensor-parallel slice under AutoTP
    or FSDP2 x TP), the strategy and the resolved ZeRO section."""
    config = ShardGPTConfig.from_preset(record["preset"], vocab_size=record["vocab_size"])
    strategy = recorded_strategy(record)
    tp = strategy.tp_size
    zero = None
    if strategy.family == "deepspeed":
        zero = zero_config(strategy, config, record["world_size"] // tp, record["precision"],
                              record["micro_batch"], record["ds_config"])  # fmt: skip
    return layout(config, tp=tp), strategy, zero


def planned(record: dict) -> list[Item]:
    """The planner's model-state items for the rank, precision and DeepSpeed config that `record` measured
    (under tensor parallelism: the rank's slice, over the data-parallel ranks; tp is the mesh's inner dimension;
    under hybrid FSDP2 over the ranks of its copy, dp_shard inside dp_replicate)."""
    lay, strategy, zero = planner_inputs(record)
    tp = strategy.tp_size
    world, rank = record["world_size"] // tp, record["rank"] // tp
    if strategy.family == "fsdp":
        world, rank = strategy.shard_size, rank % strategy.shard_size
    return model_states(lay, strategy, world, rank, record["precision"], zero)


def paper(record: dict) -> float:
    """The ZeRO paper's bytes for this launch: DDP and FSDP keep fp32 weights, gradients and Adam whatever the
    precision flag (autocast, or FSDP's bf16 compute copies), so they take the fp32 figures."""
    strategy = recorded_strategy(record)
    precision = record["precision"] if strategy.family == "deepspeed" else "fp32"
    stage = 3 if strategy.family == "fsdp" else strategy.zero_stage  # FSDP shards every state, as ZeRO-3
    return pm.zero_paper(record["psi"], record["world_size"], stage, precision)


TERMS = {
    "adam_step": "Adam step counters",
    "ddp_buckets": "DDP bucket copies of the gradients",
    "fp32_master": "fp32 master copy",
    "zero2_whole_grads": "whole gradients touching the partition",
    "persistent": "persistent parameters whole",
    "padding": "padding",
}


def deviations(record: dict) -> dict[str, float]:
    """Measured minus the paper's figure, term by term (keys of TERMS); the terms add up to the difference."""
    detail = record["snapshots"][record["peak_snapshot"]]["detail"]
    strategy = recorded_strategy(record)
    e = pm.BYTES[record["precision"]]
    terms = {
        "adam_step": detail.get("optimizer_states.adam.step", 0),
        "ddp_buckets": detail.get("grads.ddp_buckets", 0),
        "persistent": detail.get("params.persistent_whole", 0),
    }
    if record["precision"] == "fp32" and strategy.family == "deepspeed":
        terms["fp32_master"] = record["bytes"]["master_params"]
    if strategy.zero_stage == 2 and not strategy.offloads:
        kept = detail.get("grads.averaged_gradients", 0) + detail.get("grads.grads_in_partition", 0)
        terms["zero2_whole_grads"] = kept - e * record["psi"] / record["world_size"]
    terms = {k: v for k, v in terms.items() if v}
    rest = record["model_states"] - paper(record) - sum(terms.values())
    if abs(rest) > 1e-6:
        terms["padding"] = rest
    return terms


def rows(out: Path, launches=LAUNCHES) -> list[dict]:
    """One row per launch: the rank with the most model-state bytes, with paper, planner and deviations."""
    table = []
    for config, precision in launches:
        records = load(out / f"{precision}_{config}")
        worst = max(records, key=lambda r: r["model_states"])
        plan = sum(bytes_by_category(planned(worst)).values())
        table.append({"launch": config, "record": worst, "paper": paper(worst), "planner": plan,
                      "deviations": deviations(worst)})  # fmt: skip
    return table


def format_table(table: list[dict]) -> str:
    head = "launch | prec | at | params | master | grads | optim | total B/rank | B/param | paper | planner | " \
           "measured - paper"  # fmt: skip
    lines = [head, " | ".join("---" for _ in head.split(" | "))]
    for row in table:
        r = row["record"]
        per = {k: r["bytes"][k] / r["psi"] for k in ("params", "master_params", "grads", "optimizer_states")}
        plan = "=" if row["planner"] == r["model_states"] else f"{row['planner']:,}"
        terms = "; ".join(f"{TERMS[k]} {v:+,.0f}" for k, v in row["deviations"].items()) or "none"
        lines.append(
            f"{row['launch']} | {r['precision']} | {r['peak_snapshot']} | {per['params']:.2f} | "
            f"{per['master_params']:.2f} | {per['grads']:.2f} | {per['optimizer_states']:.2f} | "
            f"{r['model_states']:,} | {r['model_states'] / r['psi']:.3f} | {row['paper'] / r['psi']:.3f} | {plan} | "
            f"{terms}"
        )
    return "\n".join(lines)
