"""Pipeline parallelism (training/axes/pipeline/): every schedule trains like one process, alone and with DDP or
FSDP2 across the pipelines, and every bad layout is refused in one line before any process group.

The launches run tests/training/pipeline_worker.py: a 4-layer `debug` model (tied embeddings), 3 AdamW steps with
clipping active, micro batches 2 x pp x stages per rank, against the same steps in one process. Measured (torch 2.13,
2 and 4 gloo ranks): losses within 1.2e-7 relative, gradient norms within 4e-7, weights within 2.8e-5 after the 3
steps (Adam's normalisation carries a few ulps of reordered sums); the bars below are the suite's: losses 1e-6 at
step 1 and 1e-5 after, gradient norms 1e-6 at every step (both summed in float64: training/core/gradnorm.py), and
1e-4 on the weights.
"""

from __future__ import annotations

import json
import re
from unittest.mock import patch

import pytest
import torch
from launching import ROOT, launch, launcher_command

from model import ShardGPTConfig
from training.axes.pipeline.schedules import SCHEDULES, check_pipeline, stage_layers, stage_ranks
from training.plan.memory.planner import predict
from training.strategy import Strategy


def run_worker(tmp_path, nproc: int, pp: int, specs: list[str]) -> dict[str, dict]:
    """One launch of the worker for every spec (`SCHEDULE[:STAGES_PER_RANK[:ddp|fsdp|tp|fsdp-tp]]`); each spec's
    record."""
    cmd = launcher_command("torchrun", nproc=nproc)
    cmd[-1] = str(ROOT / "tests" / "training" / "pipeline_worker.py")
    launch(cmd, [str(pp), *specs], tmp_path)
    return {spec: json.loads((tmp_path / f"{spec.replace(':', '-')}.json").read_text()) for spec in specs}


def assert_planned_states(out, spec: str, nproc: int, pp: int) -> None:
    """Each rank's parameters, gradients and Adam's states, as the optimizer steps (the worker's
    <spec>-states-rank<R>.json), equal the memory planner's for its stage to the byte
    (training/plan/memory/stages.py), for every layout it plans: one stage a rank under GPipe or 1F1B, whole, sharded
    by FSDP2 or split over tensor-parallel ranks. Under FSDP2, what the stage holds gathered and its gradients
    accumulated whole as the last backward ends (<spec>-gathered-rank<R>.json) are the planner's too; with tensor
    parallelism, the first stage's embedding gradient held whole until the schedule ends (torch's embedding backward
    has no row-wise strategy: <spec>-whole-rank<R>.json under DDP or none, the accumulated gradients under FSDP2)."""
    from pipeline_worker import degrees

    schedule, per_rank, data_parallel = (spec.split(":") + ["1", "ddp"][spec.count(":") :])[:3]
    family, tp, _ = degrees(data_parallel, nproc, pp)
    strategy = Strategy.of(family, nproc, pp=pp, tp=tp, pp_schedule=schedule,
                           **({"fsdp_version": 2} if family == "fsdp" else {}))  # fmt: skip
    assert per_rank == "1", spec
    config = ShardGPTConfig.from_preset("debug", num_hidden_layers=4, vocab_size=256)  # the worker's model
    stages = predict(config, strategy, "fp32", 2, 32, micro_batches=2 * pp, cpu_ranks=True)["stages"]
    for rank in range(nproc):
        record = json.loads((out / f"{spec.replace(':', '-')}-states-rank{rank}.json").read_text())
        (stage,) = record["stages"]
        measured, planned = record["bytes"], stages[stage]
        held = {"params": measured["params"], "grads": measured["grads"],
                "optimizer_states": measured["master_params"] + measured["optimizer_states"]}  # fmt: skip
        assert held == {k: planned[k] for k in held}, (spec, rank, record["detail"], planned["detail"])
        if family == "fsdp":  # the stage gathered and its gradients whole by the last backward: the planner's peak
            gathered = json.loads((out / f"{spec.replace(':', '-')}-gathered-rank{rank}.json").read_text())[str(stage)]
            for label in ("unsharded_params", "unsharded_accumulated_grads"):
                assert gathered[f"buffers.{label}"] == planned["detail"][f"gpu:buffers.{label}"], (spec, rank, label)
        elif tp > 1:  # the embedding's gradient whole on each tensor-parallel rank until the schedule ends
            whole = json.loads((out / f"{spec.replace(':', '-')}-whole-rank{rank}.json").read_text())["beyond_slices"]
            assert whole == planned["detail"].get("gpu:buffers.embedding_gradient_whole", 0), (spec, rank, whole)
            assert whole > 0 or stage > 0, (spec, rank)


def assert_like_one_process(record: dict, spec: str) -> None:
    assert record["error"] is None, f"{spec}: {record['error']}"
    ours, ref = record["pipeline"], record["reference"]
    # Step 1 is the same weights on the same data: the losses and the norms agree to 1e-6. From step 2 the weights
    # carry the first step's rounding (the stages and data-parallel ranks sum in another order; 4e-6 measured on
    # the norm at step 3 of pp 2 x dp 2), and both are held to 1e-5.
    for step, (loss, want) in enumerate(zip(ours["losses"], ref["losses"], strict=True), 1):
        assert loss == pytest.approx(want, rel=1e-6 if step == 1 else 1e-5), f"{spec}: loss at step {step}"
    for step, (norm, want) in enumerate(zip(ours["grad_norms"], ref["grad_norms"], strict=True), 1):
        assert norm == pytest.approx(want, rel=1e-6 if step == 1 else 1e-5), f"{spec}: gradient norm at step {step}"
    assert record["missing_weights"] == [] and record["max_weight_difference"] <= 1e-4, (spec, record)


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_schedule_trains_like_one_process(tmp_path):
    """pp 2 on 2 ranks: GPipe and 1F1B (a stage per rank), the looped schedules with 2 stages per rank, and the
    V-shaped ZBVZeroBubble (rank 0 holds the first and the last stage, so the tied embedding is one tensor there)."""
    specs = [s if s in ("GPipe", "1F1B") else f"{s}:2" for s in SCHEDULES]
    for spec, record in run_worker(tmp_path, 2, 2, specs).items():
        assert_like_one_process(record, spec)
    for spec in ("GPipe", "1F1B"):
        assert_planned_states(tmp_path, spec, 2, 2)


@pytest.mark.slow
@pytest.mark.multiproc
def test_pipelines_with_ddp_and_fsdp2_train_like_one_process(tmp_path):
    """pp 2 x dp 2 on 4 ranks: the two pipelines read halves of each global batch; their stages average gradients
    (ddp) or are FSDP2-sharded over the pair (fsdp: every schedule but the zero-bubble ones, refused with FSDP2).
    The tied embedding's gradient is summed over the first and last stage of each pipeline. In the same launch,
    pp 2 x tp 2: one pipeline whose stages' layers are split over a pair of ranks, with sequence parallelism, under
    1F1B and every schedule with two stages a rank, looped and V-shaped (the launches of
    tests/recipes/test_composed.py run GPipe and 1F1B). Every rank's model states under DDP, FSDP2 and TP pipelines
    are the memory planner's to the byte."""
    specs = ["GPipe", "1F1B", "Interleaved1F1B:2", "ZBVZeroBubble:2", "GPipe:1:fsdp", "1F1B:1:fsdp",
             "Interleaved1F1B:2:fsdp", "LoopedBFS:2:fsdp", "1F1B:1:tp", "Interleaved1F1B:2:tp", "LoopedBFS:2:tp",
             "InterleavedZeroBubble:2:tp", "ZBVZeroBubble:2:tp"]  # fmt: skip
    for spec, record in run_worker(tmp_path, 4, 2, specs).items():
        assert_like_one_process(record, spec)
    for spec in ("1F1B", "GPipe:1:fsdp", "1F1B:1:fsdp", "1F1B:1:tp"):  # the layouts the memory planner plans
        assert_planned_states(tmp_path, spec, 4, 2)


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_x_tensor_x_pipeline_model_states_are_the_planners_to_the_byte(tmp_path):
    """pp 2 x dp 2 x tp 2 on 8 ranks under 1F1B: each stage's layers split over a pair of ranks with sequence
    parallelism, FSDP2 sharding the slices over the two pairs. It trains like one process, and every rank's
    parameters, gradients and Adam's states as the optimizer steps, and what its stage holds gathered with its
    gradients accumulated whole as the last backward ends, are the memory planner's to the byte."""
    for spec, record in run_worker(tmp_path, 8, 2, ["1F1B:1:fsdp-tp"]).items():
        assert_like_one_process(record, spec)
    assert_planned_states(tmp_path, "1F1B:1:fsdp-tp", 8, 2)


def test_stages_are_laid_out_looped_or_v_shaped():
    assert stage_ranks("1F1B", 4, 1) == [0, 1, 2, 3]
    assert stage_ranks("Interleaved1F1B", 2, 2) == [0, 1, 0, 1]
    assert stage_ranks("ZBVZeroBubble", 2, 2) == [0, 1, 1, 0]
    assert [list(stage_layers(8, 4, s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_pipeline_is_the_outermost_degree():
    """4 ranks, pp 2: ranks 0 and 2 form one pipeline and read share 0; 1 and 3 the other, share 1."""
    s = Strategy.of("ddp", 4, pp=2)
    assert (s.name, s.data_parallel_size) == ("ddp-pp2", 2)
    assert [s.pipeline_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [s.data_parallel_rank(r) for r in range(4)] == [0, 1, 0, 1]
    fsdp = Strategy.of("fsdp", 4, fsdp_version=2, pp=2)
    assert (fsdp.name, fsdp.shard_size) == ("fsdp-pp2", 2)
    for name in ("single-pp2", "ddp-pp2", "fsdp-pp2"):
        assert Strategy.from_name(name, 4).name == name


BAD_LAYOUTS = [
    (("DualPipeV", 2, 2, 8, 4), "--pipeline_parallel_schedule DualPipeV does not train", "choose one of GPipe"),
    (("1F1B", 2, 1, 1, 4), "--gradient_accumulation_steps 1 is fewer micro batches than the 2 stages", "2 or more"),
    (("GPipe", 2, 1, 2, 3), "3 decoder layers do not split into 2 equal stages", "num_hidden_layers"),
    (("GPipe", 4, 1, 4, 2), "2 decoder layers do not split into 4 equal stages", "divides 2"),
    (("Interleaved1F1B", 2, 2, 5, 4), "--gradient_accumulation_steps 5 with Interleaved1F1B", "multiple of 2"),
    (("ZBVZeroBubble", 2, 3, 8, 12), "a V-shaped schedule holds exactly 2 stages per rank", "pass 2"),
    (("GPipe", 2, 2, 4, 4), "--pipeline_parallel_virtual_stages 2 with --pipeline_parallel_schedule GPipe",
     "multi-stage schedule"),
]  # fmt: skip


@pytest.mark.parametrize(("layout", "what", "fix"), BAD_LAYOUTS, ids=[w[:40] for _, w, _ in BAD_LAYOUTS])
def test_a_layout_torch_cannot_run_is_refused(layout, what, fix):
    with pytest.raises(ValueError) as err:
        check_pipeline(*layout)
    assert what in str(err.value) and fix in str(err.value) and "\n" not in str(err.value), str(err.value)


def launch_env(monkeypatch, world: int, **variables: str) -> None:
    """What the launcher exports: the world size, and accelerate's variables for its YAML."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def run_config(**flags):
    from training.config import RunConfig

    pipeline = {"pipeline_parallel_degree": 2, "save_steps": 0, "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2, "preset": "debug", "output_dir": "/nonexistent/x"}  # fmt: skip
    return RunConfig(**{**pipeline, **flags})


@pytest.mark.parametrize(("world", "flags", "variables", "refusal"), [
    (3, {}, {}, "--pipeline_parallel_degree = 2 does not divide the 3 launched ranks: set it to one of [1, 3]"),
    (2, {"deepspeed": str(ROOT / "ds_configs" / "zero1.json")}, {}, "(ZeRO-1): the pipeline's stages are run by"),
    (2, {"deepspeed": str(ROOT / "ds_configs" / "autotp.json")}, {}, "(ZeRO-1 with AutoTP)"),
    (2, {}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE":
             str(ROOT / "ds_configs" / "zero3.json")}, "(ZeRO-3): the pipeline's stages"),
    (2, {}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "with fsdp_version: 1 in the FSDP config"),
    (2, {}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     "with fsdp_offload_params: true"),
    (2, {"pipeline_parallel_schedule": "ZBVZeroBubble", "config_overrides": "num_hidden_layers=4",
         "gradient_accumulation_steps": 4}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
     "ZBVZeroBubble with FSDP2: the zero-bubble schedules do not train under FSDP2"),
    (2, {"pipeline_parallel_schedule": "InterleavedZeroBubble", "config_overrides": "num_hidden_layers=4",
         "gradient_accumulation_steps": 4}, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
     "InterleavedZeroBubble with FSDP2"),
    (2, {"gradient_accumulation_steps": 1}, {}, "fewer micro batches than the 2 stages of 1F1B"),
])  # fmt: skip
def test_a_pipeline_it_cannot_run_is_refused_before_the_process_group(monkeypatch, world, flags, variables, refusal):
    """The launch's checks as recipes/train.py runs them, before any process group: one line naming the fix."""
    from training.launch import resolve_launch

    launch_env(monkeypatch, world, **variables)
    with pytest.raises(ValueError) as err:
        resolve_launch(run_config(**flags))
    assert refusal in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_trainer_refuses_pipeline_flags():
    """The HF Trainer has no pipeline engine: refused in one line that points to recipes/train.py."""
    from recipes import trainer

    with pytest.raises(ValueError, match="--pipeline_parallel_degree 2 needs recipes/train.py: the HF Trainer has no"):
        trainer.main(["--pipeline_parallel_degree", "2"])


def test_global_batch_counts_the_pipelines_not_their_stages(monkeypatch):
    """4 ranks as 2 pipelines of 2 stages: --global_batch_size 8 with micro 2 is 2 micro batches per pipeline."""
    from training.launch import resolve_launch

    launch_env(monkeypatch, 4, ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    launch = resolve_launch(run_config(global_batch_size=8, gradient_accumulation_steps=1))
    cfg, strategy = launch.cfg, launch.strategy
    assert (strategy.name, strategy.data_parallel_size, cfg.gradient_accumulation_steps) == ("fsdp-pp2", 2, 2)
    assert cfg.global_batch(strategy.data_parallel_size) == 8


@pytest.mark.parametrize(("built", "refusal"), [
    ({}, None),
    ({"degree": 4}, "degree 4 (asked: 2)"),
    ({"schedule": "GPipe"}, "schedule GPipe (asked: 1F1B)"),
    ({"data_parallel": "all-reduce"}, "data_parallel all-reduce (asked: fsdp2)"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 2 (asked: 1)"),
])  # fmt: skip
def test_a_pipeline_built_otherwise_than_asked_is_refused(built, refusal):
    """Every engine's strategy is verified: the pipeline as built (`Pipeline.in_force`) against the strategy."""
    from types import SimpleNamespace

    from training.axes.pipeline.runtime import verify_pipeline

    strategy = Strategy.of("fsdp", 4, pp=2)
    layout = {"degree": 2, "schedule": "1F1B", "stages_per_rank": 1, "data_parallel_size": 2, "data_parallel": "fsdp2",
              "tensor_parallel_size": 1, "split_modules": {}}  # fmt: skip
    layout = {"pipeline": layout | built}
    accelerator = SimpleNamespace(num_processes=4, mixed_precision="no", distributed_type="DistributedType.NO")
    with (
        patch("torch.distributed.is_initialized", return_value=True),
        patch("torch.distributed.get_world_size", return_value=4),
    ):
        if refusal is None:
            seen = verify_pipeline(accelerator, layout, strategy)
            assert seen["distributed_type"] == "PIPELINE" and seen["pipeline"] == layout["pipeline"]
        else:
            with pytest.raises(RuntimeError, match=re.escape(f"but the pipeline runs {refusal}")):
                verify_pipeline(accelerator, layout, strategy)


@pytest.mark.parametrize(("sending_torch", "gloo", "refused"), [("2.11.0", True, True), ("2.11.0", False, False),
                                                                 (None, True, False)])  # fmt: skip
def test_a_v_shaped_schedule_is_refused_on_gloo_where_torch_sends_to_its_own_rank(monkeypatch, sending_torch, gloo,
                                                                                   refused):  # fmt: skip
    """torch 2.11 opens the link between a rank's two V-shaped stages with a send to the rank itself, which gloo
    cannot make (the run hangs); 2.13 hands the value over in memory. On CPU ranks under such a torch the launch is
    refused before any process group, in one line naming the fix; NCCL (GPUs) and a newer torch go ahead."""
    from training import compat
    from training.launch import resolve_launch

    launch_env(monkeypatch, 2)
    monkeypatch.setattr(compat, "pipeline_sends_to_own_rank", lambda: sending_torch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: not gloo)
    cfg = run_config(pipeline_parallel_schedule="ZBVZeroBubble", config_overrides="num_hidden_layers=4",
                     gradient_accumulation_steps=4)  # fmt: skip
    if not refused:
        assert resolve_launch(cfg).strategy.pp_schedule == "ZBVZeroBubble"
        return
    with pytest.raises(ValueError) as err:
        resolve_launch(cfg)
    message = str(err.value)
    assert "ZBVZeroBubble on CPU ranks (gloo) with torch 2.11.0" in message and "use Interleaved1F1B" in message
    assert "\n" not in message


V_ON_ONE_GLOO_RANK = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
stages = [PipelineStage(torch.nn.Linear(4, 4), s, 2, torch.device("cpu")) for s in (0, 1)]
schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda out, target: out.pow(2).mean())
try:
    schedule.step(torch.randn(2, 4), target=torch.zeros(2, 4), losses=[])
    print("trained")
except Exception as e:
    print("failed:", type(e).__name__, str(e).splitlines()[0][:200])
os._exit(0)  # gloo's threads may outlive a failed send
"""


def test_the_installed_torch_is_read_for_its_pipeline_warm_up(tmp_path):
    """The V-shaped schedule's two stages on one gloo rank (every link a send to the rank itself): the step trains
    exactly where `compat.pipeline_sends_to_own_rank` finds the in-memory warm-up, and fails in gloo where it names
    the torch (2.11). Runs on the floor's torch too (make test-floor)."""
    import subprocess
    import sys

    from training import compat

    script = tmp_path / "v_on_one_rank.py"
    script.write_text(V_ON_ONE_GLOO_RANK)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    outcome = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    sending = compat.pipeline_sends_to_own_rank()
    if sending is None:
        assert outcome == "trained", outcome
    else:
        assert sending == torch.__version__ and outcome.startswith("failed:") and "Pair is not connected" in outcome, (
            outcome
        )
