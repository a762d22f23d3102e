"""Model-state memory, measured on 2 CPU ranks (gloo) by recipes/measure/measure_memory.py, against the planner and
the ZeRO paper.

For every strategy, on every rank: the bytes of parameters, fp32 master copies, gradients and optimizer states
that the engine really holds equal recipes/plan_memory.py's count to the byte; and they differ from the ZeRO
paper's formulas (training/plan/memory/planner.zero_paper) by exactly the terms asserted below, each computed here in
closed form from the model's shape. The `tiny` preset on 2 ranks has only even dimensions, so no padding
term appears; the 3-rank launches of `debug` (odd shards, alignment padding) check the planner alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import ROOT, launch, launcher_command
from parity import DDP_TP_YAML, with_replicas

from model import ShardGPTConfig
from training.measure.measured import deviations, load, planned, planner_inputs
from training.plan.memory import planner as pm
from training.plan.memory.activations import temporaries
from training.plan.memory.states import bytes_by_category

TINY = ["--preset=tiny", "--per_device_train_batch_size=1", "--block_size=64"]
LAUNCHES = [("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"), ("fsdp", "fp32"),
            ("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "bf16")]  # fmt: skip


def bf16_reduction_config(config: str, tmp_path) -> Path:
    """accelerate_configs/<config>.yaml pointing at a copy of its JSON whose gradient reduction and accumulation
    dtypes are "auto", so that --bf16_gradient_reduction can set them to bf16."""
    ds = json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())
    ds["communication_data_type"] = "auto"
    ds.setdefault("data_types", {})["grad_accum_dtype"] = "auto"
    (tmp_path / f"{config}.json").write_text(json.dumps(ds))
    yaml = (ROOT / "accelerate_configs" / f"{config}.yaml").read_text()
    yaml = yaml.replace(f"ds_configs/{config}.json", str(tmp_path / f"{config}.json"))
    (tmp_path / f"{config}.yaml").write_text(yaml)
    return tmp_path / f"{config}.yaml"


def measure(config: str | Path, args: list[str], out, nproc: int = 2) -> list[dict]:
    """`config`: a name in accelerate_configs/, or the path of a YAML."""
    name = str(config) if isinstance(config, str) else "ddp"
    cmd = launcher_command("accelerate", name, script="measure/measure_memory.py")
    if isinstance(config, Path):
        cmd[cmd.index("--config_file") + 1] = str(config)
    if nproc != 2:
        cmd[-1:-1] = ["--num_processes", str(nproc)]  # before the script: an accelerate flag
    launch(cmd, args, out)
    records = load(out)
    assert [r["rank"] for r in records] == list(range(nproc))
    return records


def expected_deviations(record: dict) -> dict[str, float]:
    """Measured minus the paper's bytes for `tiny` on 2 ranks, in closed form, with the reason for each term."""
    c = ShardGPTConfig.from_preset("tiny", vocab_size=record["vocab_size"])
    psi, world, strategy = record["psi"], record["world_size"], record["strategy"]
    e = pm.BYTES[record["precision"]]
    embedding = c.vocab_size * c.hidden_size  # tied with lm_head: one tensor
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size  # two RMSNorms per layer and the final one
    out: dict[str, float] = {}
    # torch's AdamW keeps a 4-byte fp32 `step` per tensor it steps: every parameter under DDP and FSDP, one
    # flat partition per parameter group (decay, no decay) under DeepSpeed.
    out["adam_step"] = 4 * (record["param_tensors"] if strategy in ("ddp", "fsdp") else 2)
    if strategy == "ddp":
        out["ddp_buckets"] = 4 * psi  # the reducer's flat buckets are copies of the fp32 gradients
    if strategy.startswith("zero") and record["precision"] == "fp32":
        # The paper's fp32 figures have no master copy (the weights are fp32 already); DeepSpeed still clones
        # the partition into an fp32 optimizer copy.
        out["fp32_master"] = 4 * psi / world
    if strategy == "zero2":
        # The no-decay group is [embedding, 9 norms]. Rank 0's half of it lies inside the embedding, yet the
        # gradient partition holds every gradient it touches whole: the whole embedding's. Rank 1's half holds
        # the embedding's tail and every norm: the whole group. The decay group (4 equal layers of matrices)
        # splits between layers 1 and 2: nothing extra there.
        group = embedding + norms
        kept = embedding if record["rank"] == 0 else group
        out["zero2_whole_grads"] = e * (kept - group / 2)
    if strategy == "zero3":
        # stage3_param_persistence_threshold = 10 x hidden (ds_configs/zero3.json "auto"): every RMSNorm
        # weight (hidden elements) stays whole on every rank, besides its partition.
        out["persistent"] = e * norms
    return out


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("config", "precision"), LAUNCHES, ids=lambda v: str(v))
def test_model_states_match_planner_and_paper(config, precision, tmp_path):
    """In bf16, DeepSpeed runs with bf16 gradient reduction and accumulation (`--bf16_gradient_reduction`, the
    JSON's two dtype keys left "auto"): the memory model the planner and the ZeRO paper describe. The project's
    default bf16 reduces and accumulates in fp32 (docs/precision.md): the planner counts ZeRO-3's gradient
    partitions in that dtype, but does not model ZeRO-2's fp32 gradients or DeepSpeed's BF16_Optimizer under
    ZeRO-1 yet."""
    args = TINY + (["--bf16", "--bf16_gradient_reduction"] if precision == "bf16" else [])
    launched = bf16_reduction_config(config, tmp_path) if precision == "bf16" else config
    for record in measure(launched, args, tmp_path / "out"):
        # 1. The planner's count, category by category, to the byte.
        predicted = bytes_by_category(planned(record))
        assert {k: record["bytes"][k] for k in predicted} == predicted, record["snapshots"]

        # 2. Against the paper: exactly the named terms (no padding: tiny's dimensions are even).
        assert deviations(record) == pytest.approx(expected_deviations(record), abs=1e-6)

        # 3. ZeRO-1 peaks with the whole gradients at the end of the backward, the others at the step.
        assert record["peak_snapshot"] == ("backward_end" if config == "zero1" else "pre_step")

        # 4. The walk missed nothing: what else the process holds in tensors is the batch (a few kB).
        for name, snap in record["snapshots"].items():
            assert snap["unattributed"]["bytes"] < 64 * 1024, (name, snap["unattributed"])

        # 5. DeepSpeed's reduce buckets, as the planner sizes them from the JSON (a temporary buffer).
        if config.startswith("zero"):
            lay, strategy, zero = planner_inputs(record)
            temps = temporaries(lay, strategy, 2, precision, zero)
            buckets = sum(it.nbytes for it in temps if it.label == "reduce_buckets")
            assert record["snapshots"]["backward_end"]["detail"]["buffers.reduce_buckets"] == buckets


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_autotp_states_match_planner(nproc, tmp_path):
    """DeepSpeed AutoTP (accelerate_configs/autotp.yaml, tensor-parallel size 2): each rank holds half of every
    split matrix and the whole norms, and ZeRO-1 partitions that slice over the nproc / 2 data-parallel ranks. In
    fp32: the slice's weights and whole gradients (4 + 4 bytes each), the fp32 master copy and Adam's moments of its
    partition (4 + 8 bytes), two step counters. The planner counts the same, category by category, to the byte."""
    c = ShardGPTConfig.from_preset("tiny")
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size  # replicated on every tensor-parallel rank
    for record in measure("autotp", TINY, tmp_path / "out", nproc=nproc):
        dp = nproc // 2
        local = (record["psi"] - norms) // 2 + norms
        assert record["local_parameter_fraction"] == pytest.approx(local / record["psi"], abs=1e-4)
        assert record["model_states"] == (4 + 4) * local + (4 + 8) * local // dp + 4 * 2, record["bytes"]
        predicted = bytes_by_category(planned(record))
        assert {k: record["bytes"][k] for k in predicted} == predicted, record["snapshots"]
        lay, strategy, zero = planner_inputs(record)  # the reduce bucket, sized from the JSON for the slice
        buckets = sum(it.nbytes for it in temporaries(lay, strategy, dp, "fp32", zero) if it.label == "reduce_buckets")
        assert record["snapshots"]["backward_end"]["detail"]["buffers.reduce_buckets"] == buckets
        for name, snap in record["snapshots"].items():
            assert snap["unattributed"]["bytes"] < 64 * 1024, (name, snap["unattributed"])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", [pytest.param("zero2", marks=pytest.mark.matrix), "zero3", "fsdp"])
def test_planner_exact_with_padding_on_3_ranks(config, tmp_path):
    """`debug` on 3 ranks: rows and groups do not divide by 3, so FSDP pads shards, ZeRO-2 pads its flat
    buffers and splits parameters across partitions, ZeRO-3 rounds partitions up and pads its gathers."""
    args = ["--preset=debug", "--per_device_train_batch_size=1", "--block_size=32", "--tokenizer_vocab_size=300"]
    for record in measure(config, args, tmp_path / "out", nproc=3):
        predicted = bytes_by_category(planned(record))
        assert {k: record["bytes"][k] for k in predicted} == predicted, (record["rank"], record["snapshots"])


@pytest.mark.matrix  # 4 ranks oversubscribed on 2 cores: only bytes are measured
@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["zero3", "fsdp"])
def test_sharded_states_fall_as_one_over_n_on_4_ranks(config, tmp_path):
    """What recipes/measure/memory_scaling.py plots: on 4 ranks ZeRO-3 and FSDP hold a quarter of the model states,
    the paper's 16Ψ/4 plus exactly the named terms (ZeRO-3's fp32 master copy and whole norms, Adam's step
    counters), and the planner's count to the byte."""
    for record in measure(config, TINY, tmp_path / "out", nproc=4):
        predicted = bytes_by_category(planned(record))
        assert {k: record["bytes"][k] for k in predicted} == predicted, record["snapshots"]
        assert deviations(record) == pytest.approx(expected_deviations(record), abs=1e-6)
        assert record["model_states"] < 6 * record["psi"]  # against 16Ψ to 20Ψ unsharded


# The composed layouts' YAMLs as users write them: FSDP2 x TP (the shipped fsdp_tp.yaml), DDP x TP (a DDP YAML with
# replicas, held by FSDP2 on a replicate-only mesh) and hybrid FSDP2 x TP (replicas of a copy sharded over 2 ranks).
COMPOSED = [("fsdp_tp", 4, 2), ("ddp_tp", 4, 1), ("hybrid_tp", 8, 2)]  # (YAML, ranks, ranks a copy is sharded over)


def composed_yaml(name: str, tmp_path) -> str | Path:
    """The accelerate config of a composed layout: the shipped one, or one written as a user writes it."""
    if name == "fsdp_tp":
        return name
    text = DDP_TP_YAML if name == "ddp_tp" else (ROOT / "accelerate_configs" / "fsdp_tp.yaml").read_text()
    if name == "hybrid_tp":
        text = with_replicas(text)
    (tmp_path / f"{name}.yaml").write_text(text)
    return tmp_path / f"{name}.yaml"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix  # 4 and 8 ranks oversubscribed on 2 cores: only bytes are measured
@pytest.mark.parametrize(("name", "nproc", "shards"), COMPOSED, ids=[c[0] for c in COMPOSED])
def test_composed_states_match_planner(name, nproc, shards, tmp_path):
    """FSDP2 x TP (dp_shard 2 x tp 2), DDP x TP (dp_replicate 2 x tp 2) and hybrid FSDP2 x TP (2 replicas x 2 shards x
    tp 2): each rank holds half of every split matrix and of the (tied) embedding's vocabulary rows (its
    tensor-parallel slice), FSDP2 holds a `shards`-th of that slice and of what stays whole across the
    tensor-parallel ranks (the norms); weights, gradients and Adam's moments of that share in fp32, a step counter per
    tensor. The planner counts the same, category by category, to the byte."""
    c = ShardGPTConfig.from_preset("tiny")
    config = composed_yaml(name, tmp_path)
    for record in measure(config, TINY, tmp_path / "out", nproc=nproc):
        norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
        split = record["psi"] - norms  # the matrices and the embedding: split over tp, then sharded
        local = split // (2 * shards) + norms // shards
        assert record["model_states"] == (4 + 4 + 8) * local + 4 * record["param_tensors"], record["bytes"]
        predicted = bytes_by_category(planned(record))
        assert {k: record["bytes"][k] for k in predicted} == predicted, record["snapshots"]
        for snap_name, snap in record["snapshots"].items():
            assert snap["unattributed"]["bytes"] < 64 * 1024, (snap_name, snap["unattributed"])
