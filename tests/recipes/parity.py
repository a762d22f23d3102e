"""The suite's standard runs: one process, and every config of accelerate_configs/ and ds_configs/ on 2 CPU ranks,
20 steps of the `debug` preset with a global batch of 8, each launched once per test process and read by every test
that needs it. tests/recipes/test_strategies.py holds them to one process's losses, gradient norms and weights;
test_resume.py and test_faults.py resume from their checkpoints, test_multinode.py launches their two-node
twins, test_trainer.py the HF Trainer beside them and test_precision.py reads activation checkpointing off four of
them. A launch costs more than the assertions on it (docs/testing.md), so each is made once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hub import assert_loads_as_the_hub_does
from launching import Run, launch, launcher_command

# DDP x TP as a user writes it: a DDP YAML (accelerate_configs/ddp.yaml's settings) with replicas instead of shards,
# 2 copies of the model, each split over 2 tensor-parallel ranks (tests/recipes/test_composed.py, test_memory.py).
DDP_TP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_tp_size: 2
num_machines: 1
num_processes: 4
mixed_precision: "no"
use_cpu: false
"""


def with_replicas(yaml: str) -> str:
    """An FSDP2 x TP YAML of 4 ranks (dp_shard 2 x tp 2) with 2 replicas of it: hybrid FSDP2 x TP on 8 ranks."""
    yaml = yaml.replace("parallelism_config:\n", "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n")
    return yaml.replace("num_processes: 4", "num_processes: 8")


STEPS = 20
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=10", "--max_eval_batches=4", "--save_steps=0", "--save_total_limit=5", "--sample_max_new_tokens=0",
]  # fmt: skip
MAX_GRAD_NORM = 1.0  # --max_grad_norm's default, below every step's norm here: clipping acts at every step
EXPORT_ATOL = 1e-4  # 10x the measured worst difference (tests/recipes/test_strategies.py's docstring)
NORM_RTOL = 1e-6  # every step's gradient norm against one process's
ONE_PROCESS = ["--per_device_train_batch_size=8"]
TWO_RANKS = ["--per_device_train_batch_size=4"]
# These cells take the same 8 sequences a step as 2 micro batches of 2 per rank: what a step sends with gradient
# accumulation (FSDP2 and ZeRO-3 gather every micro batch; FSDP2 and ZeRO-1 reduce once a step, ZeRO-2 and ZeRO-3
# every micro batch) is held to its closed form too.
ACCUMULATING = {("accelerate", "fsdp"), ("accelerate", "fsdp_shard_grad_op"), ("accelerate", "zero1"),
                ("deepspeed", "zero2"), ("deepspeed", "zero3"), ("torchrun", "zero2")}  # fmt: skip
# Cells that also report to trackers, read back from their files (W&B offline): rank 0's metrics, as metrics.jsonl
# holds them (tests/recipes/test_debugging.py reads W&B under DDP).
TRACKERS = {("accelerate", "ddp"): "tensorboard", ("accelerate", "zero3_offload_cpu"): "tensorboard,wandb"}
# Cells that save a checkpoint every 5 steps, from which test_resume.py, test_faults.py and test_multinode.py resume.
SAVING = {("accelerate", "ddp"), ("accelerate", "fsdp"), ("accelerate", "zero2"), ("accelerate", "zero3")}
# Cells that recompute each decoder layer in the backward (--gradient_checkpointing), one per family: DDP, FSDP2,
# ZeRO-2 and ZeRO-3 (test_precision.py); the same configs run without it through another launcher or config.
CHECKPOINTING = {("accelerate", "ddp"), ("accelerate", "fsdp"), ("accelerate", "zero2"), ("accelerate", "zero3")}


def cell_args(launcher: str, config: str | None, corpus: dict, scratch: Path) -> list[str]:
    """The flags of a cell's launch: the common ones, its batch split, its DeepSpeed JSON under the deepspeed
    launcher and torchrun, its trackers, checkpoints and activation checkpointing; `scratch` for NVMe offload."""
    # Tensor-parallel ranks train on the same batch: one data-parallel rank takes the whole global batch of 8.
    batch = ONE_PROCESS if config == "autotp" else TWO_RANKS
    if (launcher, config) in ACCUMULATING:
        batch = ["--per_device_train_batch_size=2", "--gradient_accumulation_steps=2"]
    args = [*corpus["flags"], *TRAIN, *batch, *([f"--nvme_path={scratch}"] if "nvme" in (config or "") else [])]
    if launcher in ("deepspeed", "torchrun") and config:
        args.append(f"--deepspeed=ds_configs/{config}.json")
    if (launcher, config) in TRACKERS:
        args.append(f"--report_to={TRACKERS[launcher, config]}")
    if (launcher, config) in SAVING:
        args.append("--save_steps=5")
    if (launcher, config) in CHECKPOINTING:
        args.append("--gradient_checkpointing")
    return args


_RUNS: dict[tuple, Run] = {}


def cell_run(launcher: str, config: str | None, corpus: dict, tmp_path_factory) -> Run:
    """The cell's launch on 2 ranks, made once per test process (its output directory is read, never written)."""
    key = (launcher, config)
    if key not in _RUNS:
        root = tmp_path_factory.mktemp(f"cell-{launcher}-{config}")
        _RUNS[key] = launch(launcher_command(launcher, config), cell_args(launcher, config, corpus, root), root / "out")
    return _RUNS[key]


def reference_run(corpus: dict, tmp_path_factory) -> Run:
    """One process, micro batch 8: what every cell (micro 4 x 2 ranks, or 2 x 2 accumulated) must reproduce."""
    if "reference" not in _RUNS:
        out = tmp_path_factory.mktemp("reference") / "out"
        _RUNS["reference"] = launch(launcher_command("python"), [*corpus["flags"], *TRAIN, *ONE_PROCESS], out)
    return _RUNS["reference"]


def by_step(run: Run, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run.records if key in r}


def assert_same_training(run, reference) -> None:
    """Every step's loss and gradient norm (before clipping, which acts at every step) equal the single process's,
    and the export loads as the Hub loads it, holding the single process's weights (tolerances: tests/recipes/
    test_strategies.py's docstring)."""
    losses, ref = run.losses, reference.losses
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        rtol = 1e-6 if step == 1 else 1e-5
        assert losses[step] == pytest.approx(ref[step], rel=rtol), f"step {step}"
    norms, ref_norms = by_step(run, "grad_norm"), by_step(reference, "grad_norm")
    assert sorted(norms) == sorted(ref_norms) and min(ref_norms.values()) > MAX_GRAD_NORM, ref_norms  # clipping acts
    worst = max(abs(norms[step] / ref_norms[step] - 1) for step in ref_norms)
    print(f"gradient norms: largest relative difference {worst:.3g}")
    assert worst <= NORM_RTOL, {step: (norms[step], ref_norms[step]) for step in ref_norms}
    seen = assert_loads_as_the_hub_does(run.output_dir, reference.output_dir, EXPORT_ATOL)
    print(f"exported weights: max abs difference {seen['max_abs_diff']:.3g}")
