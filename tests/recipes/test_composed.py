"""The axes composed, launched as users write them: an accelerate YAML of FSDP2 with a `parallelism_config` block
(dp_shard 2 x tp 2, as accelerate documents it) on 4 CPU ranks trains the model of one process; so does the same
YAML on 8 ranks with a pipeline flag on top (FSDP2 x TP x PP, 2 x 2 x 2), and torchrun with
--tensor_parallel_degree beside --pipeline_parallel_degree (TP x PP).

The layers split by the model's plan over each pair of consecutive ranks (training/axes/tensor/plan.py), FSDP2 shards
every slice over the two pairs; each pair trains on one micro batch of 4, so a step takes the reference's 8
sequences. Losses and gradient norms (clipping active at every step) must equal one process's at the parity cells'
tolerances (tests/recipes/test_strategies.py's docstring): a gradient off by the tensor-parallel degree, or a slice's
squares missing from the norm or counted once per tensor-parallel rank, would miss them by far more (FSDP2's strided
shards of a tensor-parallel slice are not `Shard` placements: a norm that read only those lost 2.5% at step 1).
Its checkpoint resumes under one process exactly, and the export loads as the Hub loads it.
"""

from __future__ import annotations

import json

import pytest
import torch
from communication import assert_closed_form, launched
from launching import accelerate_with, launch, launcher_command
from parity import (
    DDP_TP_YAML,
    STEPS,
    TRAIN,
    TWO_RANKS,
    assert_same_training,
    by_step,
    reference_run,
    with_replicas,
)

from model import ShardGPTConfig, ShardGPTForCausalLM

# A user's YAML: FSDP2 and a parallelism_config block, nothing of this project's.
FSDP_TP = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
num_machines: 1
num_processes: 4
mixed_precision: "no"
use_cpu: false
"""
SAVE_AT = 10


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return reference_run(corpus, tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp_tp(corpus, tmp_path_factory):
    """The 4-rank launch, saving a checkpoint halfway."""
    root = tmp_path_factory.mktemp("fsdp-tp")
    (root / "fsdp_tp.yaml").write_text(FSDP_TP)
    args = [*corpus["flags"], *TRAIN, *TWO_RANKS, f"--save_steps={SAVE_AT}"]
    return launch(accelerate_with(str(root / "fsdp_tp.yaml")), args, root / "out")


def split_share(out) -> float:
    """The share of the model's parameters a rank holds under dp_shard 2 x tp 2: a quarter of every matrix the plan
    splits (the embedding, tied to the head, by vocabulary rows), half of the rest (the norms)."""
    config = ShardGPTConfig.from_pretrained(out)
    with torch.device("meta"):
        net = ShardGPTForCausalLM(config)
    total = sum(p.numel() for p in net.parameters())
    split = sum(m.weight.numel() for name, m in net.named_modules() if name.endswith(("_proj", "embed_tokens")))
    return (split / 4 + (total - split) / 2) / total


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_x_tensor_parallel_yaml_trains_like_one_process(fsdp_tp, reference):
    seen = fsdp_tp.strategy
    assert seen["strategy"] == "fsdp-tp2" and seen["world_size"] == 4, seen
    assert seen["engine"] == "FSDPShardGPTForCausalLM" and seen["optimizer_chain"][-1] == "AdamW", seen
    # Each of the 2 layers' q, k, v, gate and up split by output rows, o and down by input columns; the embedding
    # and the (tied) head by vocabulary rows.
    split = {"colwise": 10, "rowwise": 4, "embedding_rowwise": 1, "colwise_gather_output": 1}
    assert seen["tensor_parallel"] == {"size": 2, "data_parallel_size": 2, "split_modules": split}
    assert seen["local_parameter_fraction"] == pytest.approx(split_share(fsdp_tp.output_dir), abs=1e-4), seen
    assert fsdp_tp.losses[STEPS] < fsdp_tp.losses[1] - 0.5
    assert_same_training(fsdp_tp, reference)
    # What each rank sent in step 3, to the byte: sequence parallelism's 4 all-gathers and 4 reduce-scatters a layer
    # of a micro batch's activations, FSDP2's gathers and reduce-scatter of the rank's slice
    # (training/plan/communication.dtensor_payloads).
    want = assert_closed_form(fsdp_tp)
    assert set(want) == {"all_reduce", "all_gather", "reduce_scatter"}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
def test_fsdp2_x_tensor_parallel_checkpoint_resumes_under_one_process(fsdp_tp, reference, corpus, tmp_path):
    """The 4-rank checkpoint (each rank's slices of its shards, torch.distributed.checkpoint) read by one process:
    the steps after it are the reference's."""
    assert_resumes_under_one_process(fsdp_tp.output_dir / f"checkpoint-{SAVE_AT}", reference, corpus, tmp_path)


def assert_resumes_under_one_process(checkpoint, reference, corpus, tmp_path) -> None:
    """One process resumed from `checkpoint` (step SAVE_AT) takes the reference's steps after it."""
    args = [*corpus["flags"], *TRAIN, "--per_device_train_batch_size=8", f"--resume_from_checkpoint={checkpoint}"]
    run = launch(launcher_command("python"), args, tmp_path / "resumed")
    losses, norms = run.own_losses, by_step(run, "grad_norm")
    assert sorted(losses) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-5), f"step {step}"
        assert norms[step] == pytest.approx(by_step(reference, "grad_norm")[step], rel=1e-6), f"step {step}"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
def test_ddp_x_tensor_parallel_yaml_trains_like_one_process(reference, corpus, tmp_path):
    """dp_replicate 2 x tp 2 from a DDP YAML: FSDP2's mesh replicated over the copies, sharded over none, around the
    slices (DDP's reducer takes no DTensor); each rank holds half of every split matrix and all of the rest, and the
    copies all-reduce their slices' gradients, DDP's traffic. An FSDP2 YAML with the same block (hybrid sharding)
    is this strategy (tests/training/test_config.py)."""
    (tmp_path / "replicated_tp.yaml").write_text(DDP_TP_YAML)
    run = launch(accelerate_with(str(tmp_path / "replicated_tp.yaml")), [*corpus["flags"], *TRAIN, *TWO_RANKS],
                 tmp_path / "out")  # fmt: skip
    seen = run.strategy
    assert seen["strategy"] == "fsdp-hybrid-tp2" and seen["tensor_parallel"]["data_parallel_size"] == 2, seen
    assert seen["local_parameter_fraction"] == pytest.approx(2 * split_share(run.output_dir), abs=1e-4), seen
    assert_same_training(run, reference)
    assert_closed_form(run)  # sequence parallelism's gathers and scatters, the slice's all-reduce across the copies


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
def test_hybrid_fsdp2_x_tensor_parallel_yaml_trains_like_one_process(reference, corpus, tmp_path):
    """8 ranks: the FSDP2 YAML's block with `parallelism_config_dp_replicate_size: 2` on top, 2 replicas x 2 shards
    x tp 2: each copy of the model split over pairs and sharded over two pairs, the copies' shards all-reduced once a
    step. It trains like one process, and each rank sends the closed form (training/plan/communication.py's
    `dtensor_payloads`: the replicas' all-reduce of the reduce-scattered shard of the slice, a quarter of it here)."""
    (tmp_path / "hybrid_tp.yaml").write_text(with_replicas(FSDP_TP))
    args = [*corpus["flags"], *TRAIN, "--per_device_train_batch_size=2"]
    run = launch(accelerate_with(str(tmp_path / "hybrid_tp.yaml")), args, tmp_path / "out")
    seen = run.strategy
    assert seen["strategy"] == "fsdp-hybrid-tp2" and seen["world_size"] == 8, seen
    assert seen["tensor_parallel"]["data_parallel_size"] == 4, seen
    assert seen["local_parameter_fraction"] == pytest.approx(split_share(run.output_dir), abs=1e-4), seen
    assert_same_training(run, reference)
    want = assert_closed_form(run)
    assert set(want) == {"all_reduce", "all_gather", "reduce_scatter"}


def assert_planned_parameters(run) -> None:
    """Rank 0's parameters (its stage's tensor-parallel slices, FSDP2's shards of them) are the memory planner's for
    that stage, to the element (training/plan/memory/stages.py, the step-time planner's memory of these layouts)."""
    from training.plan.memory.planner import predict

    strategy, _ = launched(run)
    flags = json.loads((run.output_dir / "run_config.json").read_text())
    config = ShardGPTConfig.from_pretrained(run.output_dir)
    row = predict(config, strategy, "fp32", flags["per_device_train_batch_size"], flags["block_size"],
                  micro_batches=flags["gradient_accumulation_steps"], cpu_ranks=True)  # fmt: skip
    (stage,) = run.strategy["pipeline"]["this_rank_stages"]
    assert row["stages"][stage]["params"] == 4 * run.strategy["local_parameters"], (row["stages"][stage], run.strategy)


# Two stages, each micro batch of the step one after another: the global batch of 8 as 2 micro batches a step.
PIPELINE = ["--pipeline_parallel_degree=2", "--gradient_accumulation_steps=2"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_x_tensor_x_pipeline_parallel_trains_like_one_process(reference, corpus, tmp_path):
    """8 ranks: the YAML's dp_shard 2 x tp 2 times --pipeline_parallel_degree 2. Pipeline rank p holds ranks 4p to
    4p + 3, a stage each split over a pair and sharded over the two pairs; micro batches of 2 on 2 data-parallel
    ranks, 2 a step. Its checkpoint (each rank's FSDP2 shards of its stage's slices) resumes under one process
    exactly."""
    (tmp_path / "fsdp_tp.yaml").write_text(FSDP_TP)
    cmd = [*accelerate_with(str(tmp_path / "fsdp_tp.yaml"))]
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--num_processes", "8"]
    args = [*corpus["flags"], *TRAIN, *PIPELINE, "--per_device_train_batch_size=2", f"--save_steps={SAVE_AT}"]
    run = launch(cmd, args, tmp_path / "out")
    pipe = run.strategy["pipeline"]
    assert run.strategy["strategy"] == "fsdp-tp2-pp2" and run.strategy["world_size"] == 8, run.strategy
    assert (pipe["degree"], pipe["data_parallel"], pipe["data_parallel_size"], pipe["tensor_parallel_size"]) == (
        2, "fsdp2", 2, 2,
    ), pipe  # fmt: skip
    # rank 0's stage: one of the 2 layers, and the embedding
    assert pipe["split_modules"] == {"colwise": 5, "rowwise": 2, "embedding_rowwise": 1}, pipe
    assert pipe["sequence_parallel"], pipe  # the stages send their sequence shards
    assert_same_training(run, reference)
    # What each rank sent in step 3, to the byte, stage by stage: sequence parallelism's 4 all-gathers and 4
    # reduce-scatters a layer and micro batch inside the stages, the sequence shards sent between them, the tied
    # embedding's shard summed, FSDP2's gathers and reduce-scatter of the rank's slice
    # (training/plan/communication.pipeline_payloads).
    assert_closed_form(run)
    assert_planned_parameters(run)
    assert_resumes_under_one_process(run.output_dir / f"checkpoint-{SAVE_AT}", reference, corpus, tmp_path)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
@pytest.mark.parametrize(("schedule", "nproc"), [("1F1B", 4), ("GPipe", 8)])
def test_tensor_x_pipeline_parallel_under_torchrun_trains_like_one_process(schedule, nproc, reference, corpus,
                                                                           tmp_path):  # fmt: skip
    """torchrun with --tensor_parallel_degree 2 --pipeline_parallel_degree 2: on 4 ranks one pipeline of two stages,
    each split over a pair of ranks, the global batch of 8 as 2 micro batches of 4; on 8 ranks two such pipelines,
    DDP's average across them (DDP x TP x PP), 2 micro batches of 2 each. The 4-rank run's checkpoint (each rank's
    slices of its stage, torch.distributed.checkpoint) resumes under one process exactly."""
    cmd = launcher_command("torchrun", nproc=nproc)
    micro = 16 // nproc
    args = [*corpus["flags"], *TRAIN, *PIPELINE, "--tensor_parallel_degree=2", f"--per_device_train_batch_size={micro}",
            f"--pipeline_parallel_schedule={schedule}", f"--save_steps={SAVE_AT if nproc == 4 else 0}"]  # fmt: skip
    run = launch(cmd, args, tmp_path / "out")
    pipe = run.strategy["pipeline"]
    name = "single-tp2-pp2" if nproc == 4 else "ddp-tp2-pp2"
    assert run.strategy["strategy"] == name and run.strategy["world_size"] == nproc, run.strategy
    assert (pipe["schedule"], pipe["data_parallel"], pipe["split_modules"]) == (
        schedule, "none" if nproc == 4 else "all-reduce", {"colwise": 5, "rowwise": 2, "embedding_rowwise": 1},
    ), pipe  # fmt: skip
    assert_same_training(run, reference)
    assert_closed_form(run)  # the stages' gathers, scatters and sends, the tie, DDP's average of the slices
    assert_planned_parameters(run)
    if nproc == 4:
        # One pipeline evaluates the reference's batches: the stages' sequence shards give one process's losses.
        evaluated = {r["step"]: r["eval_loss"] for r in run.records if "eval_loss" in r}
        want = {r["step"]: r["eval_loss"] for r in reference.records if "eval_loss" in r}
        assert evaluated.keys() == want.keys() and evaluated, (evaluated, want)
        assert all(evaluated[s] == pytest.approx(want[s], rel=1e-5) for s in want), (evaluated, want)
        assert_resumes_under_one_process(run.output_dir / f"checkpoint-{SAVE_AT}", reference, corpus, tmp_path)
