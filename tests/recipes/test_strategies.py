"""Every config of accelerate_configs/ and ds_configs/ trains the same model on 2 CPU ranks (gloo).

Same seed, initial weights, data order and global batch (8 sequences): each launch's per-step losses and gradient
norms must equal a single-process run's at every step. The launches are tests/recipes/parity.py's cells, made once
and read by other modules too (resume, faults, two nodes, the Trainer, activation checkpointing on four of them).
Tolerance: fp32 throughout; the ranks' partial gradients are summed by gloo in another order than one process's
batched matmuls, which perturbs each step by a few ulps, and Adam's normalisation carries that forward. Measured on
2 CPU cores: at most 1.2e-7 relative over 20 steps for every launch below; the test allows 1e-6 at step 1 and 1e-5
after (10-100x margin for other CPUs' kernels). The gradient norm before clipping (clipping acts at every step:
--max_grad_norm 1.0 is below every norm here) is summed in float64 by every strategy (training/core/gradnorm.py, as
DeepSpeed sums its own): within NORM_RTOL = 1e-6 of one process's at every step. The exported weights after 20
steps (magnitudes up to about 1) differ from the single process's by at most 1.0e-5 (measured, every launch below);
the test allows EXPORT_ATOL = 1e-4, read in a fresh process without the project, as the Hub loads the folder
(tests/hub.py: `from_pretrained` with trust_remote_code and the model card's own `pipeline(...)` line).

DeepSpeed AutoTP (`ds_configs/autotp.json`) splits every layer over the 2 ranks, which then train on one batch: its
launch takes micro batch 8, the reference's global batch, and must match it the same way (measured: steps 1-3 equal
to the last digit on 2 ranks; at most 1.1e-7 relative on 4 ranks, 2 data-parallel x 2 tensor-parallel).

What each rank holds is read from the prepared objects (`strategy.json`, written by the script after its
first optimizer step): the wrapper and optimizer classes, the ZeRO stage, where parameters and Adam's states
live, FSDP2's resharding and offload policy, and this rank's share of parameters, gradients and optimizer
states, counted in the tensors the engine, FSDP or the optimizer really hold; and what each rank sent in the third
step, by kind of collective, equal to training/loop/comms.py's closed form for the settings in force (tests/recipes/
communication.py), or, for a pipeline, its stages' activations and gradients.
"""

from __future__ import annotations

import json

import pytest
from communication import assert_closed_form
from launching import ROOT, launch, launcher_command, quiet_console_problems
from parity import STEPS, TRACKERS, TRAIN, TWO_RANKS, assert_same_training, cell_run, reference_run
from trackers import assert_same_as_metrics, tensorboard_scalars, wandb_history

# What the prepared objects must show, per strategy. shares: this rank's fraction of (parameters, gradients
# given to the optimizer, Adam's states). ZeRO-1 and -2 both hand the optimizer a 1/N gradient partition;
# they differ in the backward, where ZeRO-1 reduces whole gradients and ZeRO-2 partitions them bucket by bucket.
HALF, WHOLE = 0.5, 1.0
DDP = {"engine": "DistributedDataParallel", "zero_stage": 0, "inner": "AdamW", "shares": (WHOLE, WHOLE, WHOLE)}
FSDP = {"engine": "FSDPShardGPTForCausalLM", "zero_stage": 0, "inner": "AdamW", "shares": (HALF, HALF, HALF),
        "reshard_after_forward": [True], "fsdp_offload_policy": ["OffloadPolicy"]}  # fmt: skip
ZERO = {"engine": "DeepSpeedEngine", "inner": "AdamW"}
FSDP_NO_CASTS = {"param_dtype": None, "reduce_dtype": None, "output_dtype": None}
FP32_ZERO = {"bf16": False, "fp16": False, "communication_data_type": "float32", "grad_accum_dtype": "float32"}
EXPECTED = {
    "ddp": DDP,
    "fsdp": FSDP,
    "fsdp-shard-grad-op": {**FSDP, "reshard_after_forward": [False]},
    "fsdp-offload": {**FSDP, "fsdp_offload_policy": ["CPUOffloadPolicy"], "offload": ("cpu", "cpu")},
    # FSDP1: torch's FullyShardedDataParallel, a flat parameter per decoder layer and one for the rest.
    "fsdp1": {"engine": "FullyShardedDataParallel", "zero_stage": 0, "inner": "AdamW", "shares": (HALF, HALF, HALF),
              "fsdp_sharding_strategy": ["FULL_SHARD"]},
    "zero1": {**ZERO, "zero_stage": 1, "shares": (WHOLE, HALF, HALF), "gradients_partitioned_in_backward": False},
    "zero2": {**ZERO, "zero_stage": 2, "shares": (WHOLE, HALF, HALF), "gradients_partitioned_in_backward": True},
    "zero2-offload-cpu": {**ZERO, "zero_stage": 2, "inner": "DeepSpeedCPUAdam", "shares": (WHOLE, HALF, HALF),
                          "offload": ("none", "cpu"), "gradients_partitioned_in_backward": True},
    "zero3": {**ZERO, "zero_stage": 3, "shares": (HALF, HALF, HALF), "gradients_partitioned_in_backward": True},
    # DeepSpeed AutoTP over the 2 ranks (one data-parallel rank): each holds half of every split matrix, whole
    # norms. The 2 layers' q, k, v, gate, up split by output rows, o and down by input columns, the tied
    # embedding and head by vocabulary rows.
    "zero1-autotp": {**ZERO, "zero_stage": 1, "shares": (HALF, HALF, HALF), "gradients_partitioned_in_backward": False,
                     "tensor_parallel": {"size": 2, "data_parallel_size": 1, "split_modules": {
                         "colwise": 10, "rowwise": 4, "embedding_rowwise": 1, "colwise_gather_output": 1}}},
    "zero3-offload-cpu": {**ZERO, "zero_stage": 3, "inner": "DeepSpeedCPUAdam", "shares": (HALF, HALF, HALF),
                          "offload": ("cpu", "cpu"), "gradients_partitioned_in_backward": True},
    # NVMe offload in force, though the `debug` model's partitions are all below DeepSpeed's 1 MiB swap minimum:
    # nothing reaches the drive here (`nvme`: the shares on it); test_nvme_offload_swaps_and_trains_the_same
    # trains a model whose partitions do.
    "zero3-offload-nvme": {**ZERO, "zero_stage": 3, "inner": "DeepSpeedCPUAdam", "shares": (HALF, HALF, HALF),
                           "offload": ("nvme", "nvme"), "gradients_partitioned_in_backward": True, "nvme": (0, 0)},
}  # fmt: skip

# (launcher, config, expected strategy)
LAUNCHES = [
    ("accelerate", "ddp", "ddp"),
    ("accelerate", "fsdp", "fsdp"),
    ("accelerate", "fsdp_shard_grad_op", "fsdp-shard-grad-op"),
    ("accelerate", "fsdp_offload", "fsdp-offload"),
    ("accelerate", "fsdp1", "fsdp1"),
    ("accelerate", "zero1", "zero1"),
    ("accelerate", "zero2", "zero2"),
    ("accelerate", "zero2_offload", "zero2-offload-cpu"),
    ("accelerate", "zero3", "zero3"),
    ("accelerate", "zero3_offload_cpu", "zero3-offload-cpu"),
    ("accelerate", "zero3_offload_nvme", "zero3-offload-nvme"),
    ("deepspeed", "zero2", "zero2"),
    ("deepspeed", "zero3", "zero3"),
    # The same JSONs as the accelerate cells above, through the deepspeed launcher: `make test-matrix` (CI runs it).
    pytest.param("deepspeed", "zero1", "zero1", marks=pytest.mark.matrix),
    pytest.param("deepspeed", "zero2_offload", "zero2-offload-cpu", marks=pytest.mark.matrix),
    pytest.param("deepspeed", "zero3_offload_cpu", "zero3-offload-cpu", marks=pytest.mark.matrix),
    pytest.param("deepspeed", "zero3_offload_nvme", "zero3-offload-nvme", marks=pytest.mark.matrix),
    ("torchrun", "zero2", "zero2"),
    ("deepspeed", "autotp", "zero1-autotp"),
    ("torchrun", None, "ddp"),
]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process, micro batch 8: the losses every 2-rank launch (micro 4 x 2 ranks) must reproduce."""
    return reference_run(corpus, tmp_path_factory)


def needs_libaio(config):
    """NVMe offload needs libaio; `make setup` installs it (or fails saying so), so its absence is a failure."""
    if config and "nvme" in config:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            pytest.fail("NVMe offload needs libaio: apt-get install libaio-dev (`make setup` does it as root)")


def assert_in_force(seen: dict, strategy: str) -> None:
    """The prepared objects hold what `strategy` promises (see EXPECTED)."""
    want = EXPECTED[strategy]
    assert seen["world_size"] == 2 and seen["engine"] == want["engine"], seen
    assert seen["zero_stage"] == want["zero_stage"] and seen["optimizer_chain"][-1] == want["inner"], seen
    assert (seen["offload_param"], seen["offload_optimizer"]) == want.get("offload", ("none", "none")), seen
    shares = (seen["local_parameter_fraction"], seen["local_gradient_fraction"], seen["local_optimizer_state_fraction"])
    assert shares == pytest.approx(want["shares"], abs=0.02), f"(params, grads, optimizer states) {shares}; {seen}"
    for key in (
        "reshard_after_forward",
        "fsdp_offload_policy",
        "gradients_partitioned_in_backward",
        "fsdp_sharding_strategy",
        "tensor_parallel",
    ):
        assert seen.get(key) == want.get(key), f"{key}: {seen}"
    # fp32 throughout (precision in force: docs/precision.md): fp32 parameters, no autocast, FSDP2's policy with no
    # dtype set, and DeepSpeed with bf16/fp16 off and fp32 gradient communication and accumulation.
    assert (seen["parameter_dtypes"], seen["autocast"]) == (["float32"], False), seen
    assert seen.get("fsdp_mixed_precision") in (None, FSDP_NO_CASTS), seen
    if seen["zero_stage"]:
        assert seen["deepspeed_precision"] == FP32_ZERO, seen
    on_nvme = (seen.get("local_parameter_fraction_on_nvme", 0), seen["local_optimizer_state_fraction_on_nvme"])
    assert on_nvme == pytest.approx(want.get("nvme", (0, 0)), abs=0.02), f"(params, optimizer states) on NVMe: {seen}"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config", "strategy"), LAUNCHES, ids=lambda v: str(v))
def test_strategy_trains_the_same_model(launcher, config, strategy, corpus, reference, tmp_path_factory):
    needs_libaio(config)
    run = cell_run(launcher, config, corpus, tmp_path_factory)  # the cell's flags: tests/recipes/parity.py
    trackers = TRACKERS.get((launcher, config))

    # The strategy in force is the one asked for, as the prepared objects show it.
    assert run.strategy["strategy"] == strategy
    assert_in_force(run.strategy, strategy)
    assert_closed_form(run)  # what every rank sent in the third step, to the byte

    # It trains: metrics for every step, a falling loss, an evaluation.
    losses = run.losses
    assert losses[STEPS] < losses[1] - 0.5
    assert all(k in run.records[0] for k in ("step", "loss", "lr", "grad_norm", "tokens_per_sec"))
    assert any("eval_loss" in r for r in run.records)
    # ZeRO-3's deprecated-collective warning, printed once per call without `run_rank`'s filter.
    assert "torch.distributed.reduce_scatter_tensor` is deprecated" not in run.stderr
    assert quiet_console_problems(run.stdout + run.stderr, launcher) == []  # on every launcher and rank

    # It trains the same model as one process does, and exports it whole.
    assert_same_training(run, reference)
    if trackers:
        assert_trackers_logged(run, trackers)


def assert_trackers_logged(run, trackers: str) -> None:
    """Each tracker got every metrics.jsonl record, from rank 0 alone (one event file, one W&B run)."""
    assert len(list((run.output_dir / "shardgpt").glob("events.out.tfevents.*"))) == 1
    assert_same_as_metrics(tensorboard_scalars(run.output_dir), run.records, "tensorboard")
    if "wandb" in trackers:
        assert_same_as_metrics(wandb_history(run.output_dir), run.records, "wandb")


@pytest.mark.slow
@pytest.mark.multiproc
def test_nvme_offload_returns_the_weights_it_was_given(tmp_path):
    """The parity runs above use parameters too small to reach the NVMe drive (DeepSpeed swaps only partitions
    of 1 MiB or more). Here the embedding's partition is swapped out and back: the weights and a forward
    must be bitwise those of the model before `prepare`. (deepspeed 0.19.8 on CPU swapped fp32 through bf16
    buffers unless `keep_zero3_param_dtype` is applied: errors up to 2.4e-4.)"""
    needs_libaio("zero3_offload_nvme")
    cmd = launcher_command("accelerate", "zero3_offload_nvme")
    cmd[-1] = str(ROOT / "tests" / "recipes" / "nvme_worker.py")
    args = ["--preset=debug", "--max_steps=1", "--warmup_steps=0", f"--nvme_path={tmp_path}"]
    launch(cmd, args, tmp_path / "out")
    seen = json.loads((tmp_path / "out" / "nvme.json").read_text())
    assert "model.embed_tokens.weight" in seen["swapped"]
    assert seen["changed"] == {}
    assert seen["loss"] == seen["reference"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "config", ["zero3_offload_nvme", pytest.param("zero3_offload_nvme_small_host", marks=pytest.mark.matrix)]
)
def test_nvme_offload_swaps_and_trains_the_same(config, corpus, tmp_path):
    """ZeRO-3 with parameters and Adam's states on the drive, for real. Two things keep them off it in the
    parity runs above: DeepSpeed swaps only partitions of 1 MiB or more (here MLP matrices of 64 x 8192 give each
    rank 1 MiB partitions), and it keeps up to `offload_param.max_in_cpu` parameter elements (1e9 in
    ds_configs/zero3_offload_nvme.json) in host memory for good, so this run sets it to 0 (with a swap buffer for
    every swapped matrix, instead of five of 1e8 elements each). ds_configs/zero3_offload_nvme_small_host.json
    (max_in_cpu 0 and eight swap buffers already, smaller optimizer sub-groups) runs as written. Six steps through
    the `deepspeed` launcher equal the single process's, and the swap files are on the drive."""
    needs_libaio(config)
    args = [*corpus["flags"], *TRAIN, "--max_steps=6", "--config_overrides=intermediate_size=8192"]
    reference = launch(launcher_command("python"), [*args, "--per_device_train_batch_size=8"], tmp_path / "ref")
    ds = json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())
    if config == "zero3_offload_nvme":
        # All six swapped matrices can be live at once (stage3_max_live_parameters): a swap buffer for each.
        ds["zero_optimization"]["offload_param"].update(max_in_cpu=0, buffer_count=8, buffer_size=2**19)
    (tmp_path / "nvme.json").write_text(json.dumps(ds))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args += [*TWO_RANKS, f"--nvme_path={nvme}", f"--deepspeed={tmp_path / 'nvme.json'}"]
    run = launch(launcher_command("deepspeed"), args, tmp_path / "out")
    seen = run.strategy
    assert (seen["offload_param"], seen["offload_optimizer"]) == ("nvme", "nvme"), seen
    # The MLP matrices are 3.15M of the 3.26M parameters: each rank keeps its half of them on the drive.
    assert seen["local_parameter_fraction_on_nvme"] == pytest.approx(0.48, abs=0.02), seen
    assert seen["local_optimizer_state_fraction_on_nvme"] == pytest.approx(0.5, abs=0.02), seen
    swap_files = sorted(p.name for p in nvme.rglob("*.swp"))
    assert any("param" in name for name in swap_files) and len(swap_files) > 2, swap_files
    losses, ref = run.losses, reference.losses
    assert sorted(losses) == sorted(ref) == list(range(1, 7))
    for step in ref:
        assert losses[step] == pytest.approx(ref[step], rel=1e-6 if step == 1 else 1e-5), f"step {step}"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
def test_autotp_with_two_data_parallel_ranks_trains_the_same_model(corpus, reference, tmp_path):
    """4 ranks (2 cores oversubscribed): 2 data-parallel ranks x tensor-parallel groups of 2. Ranks 0-1 read the
    first micro batch of 4 of every global batch of 8, ranks 2-3 the second, and ZeRO-1 reduces over the data-parallel
    pairs (0, 2) and (1, 3): the same losses and export as one process. (accelerate launch of the same JSON trains and
    resumes in tests/recipes/test_resume.py.)"""
    args = [*corpus["flags"], *TRAIN, *TWO_RANKS, "--deepspeed=ds_configs/autotp.json"]
    run = launch(launcher_command("deepspeed", nproc=4), args, tmp_path / "out")
    seen = run.strategy
    assert (seen["strategy"], seen["world_size"], seen["zero_stage"]) == ("zero1-autotp", 4, 1), seen
    assert seen["tensor_parallel"] == {**EXPECTED["zero1-autotp"]["tensor_parallel"], "data_parallel_size": 2}, seen
    # Each rank: half of the model (its tensor-parallel slice), a quarter of Adam's states (ZeRO-1 over 2 of it).
    shares = (seen["local_parameter_fraction"], seen["local_optimizer_state_fraction"])
    assert shares == pytest.approx((0.5, 0.25), abs=0.02), seen
    assert_closed_form(run)  # activations all-reduced over each tensor-parallel pair, ZeRO-1 over the other
    assert_same_training(run, reference)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
@pytest.mark.parametrize("stage", [2, 3])
def test_autotp_under_zero2_and_zero3_trains_the_same_model(stage, corpus, reference, tmp_path):
    """ds_configs/autotp.json with its ZeRO stage changed, as a user would: DeepSpeed 0.19.8 runs AutoTP under every
    stage. On the 2 ranks (one tensor-parallel pair, one data-parallel rank) the plan's modules are split as under
    ZeRO-1 (under ZeRO-3 each slice is a partition's `ds_shape`), and the run is one process's."""
    ds = json.loads((ROOT / "ds_configs" / "autotp.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    (tmp_path / "autotp.json").write_text(json.dumps(ds))
    args = [*corpus["flags"], *TRAIN, "--per_device_train_batch_size=8", f"--deepspeed={tmp_path / 'autotp.json'}"]
    run = launch(launcher_command("deepspeed"), args, tmp_path / "out")
    seen = run.strategy
    assert (seen["strategy"], seen["zero_stage"]) == (f"zero{stage}-autotp", stage), seen
    assert seen["tensor_parallel"] == EXPECTED["zero1-autotp"]["tensor_parallel"], seen
    assert_same_training(run, reference)


# Pipeline parallelism through the training script (training/axes/pipeline/runtime.py; every schedule's own proof is
# tests/training/test_pipeline.py): (launcher, config, ranks, schedule, micro batch, strategy). The micro batches of a
# step are the accumulation, 2 here: the reference's global batch of 8 is micro x 2 x the data-parallel ranks.
PIPELINES = [
    ("torchrun", None, 2, "1F1B", 4, "single-pp2"),  # its flags from a JSON arguments file
    ("accelerate", "fsdp", 4, "GPipe", 2, "fsdp-pp2"),  # 2 pipelines, each stage FSDP2-sharded over 2 ranks
    pytest.param("accelerate", "ddp", 4, "1F1B", 2, "ddp-pp2", marks=pytest.mark.matrix),  # --torch_compile too
]
# Activation checkpointing inside the stages of the FSDP2 cell, compiled decoder layers inside the DDP cell's.
PIPELINE_EXTRAS = {"fsdp": ["--gradient_checkpointing"], "ddp": ["--torch_compile"]}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config", "nproc", "schedule", "micro", "strategy"), PIPELINES,
                         ids=lambda v: str(v))  # fmt: skip
def test_pipeline_trains_the_same_model(launcher, config, nproc, schedule, micro, strategy, corpus, reference,
                                        tmp_path):  # fmt: skip
    """The `debug` model's 2 layers as 2 stages: every step's loss and the export equal one process's; the layout in
    force is read back from strategy.json."""
    flags = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule,
             "per_device_train_batch_size": micro, "gradient_accumulation_steps": 2}  # fmt: skip
    if launcher == "torchrun":  # `python recipes/train.py args.json`: a layout kept in a file
        (tmp_path / "pipeline.json").write_text(json.dumps(flags))
        args = [str(tmp_path / "pipeline.json")]
    else:
        args = [f"--{k}={v}" for k, v in flags.items()]
    cmd = launcher_command(launcher, config, nproc=nproc)
    if launcher == "accelerate":
        cmd[-1:-1] = ["--num_processes", str(nproc)]  # before the script: an accelerate flag
    run = launch(cmd, [*args, *corpus["flags"], *TRAIN, *PIPELINE_EXTRAS.get(config, [])], tmp_path / "out")

    seen = run.strategy
    assert seen["compiled_blocks"] == (1 if config == "ddp" else 0), seen  # rank 0's stage: 1 of the 2 layers
    assert (seen["strategy"], seen["world_size"]) == (strategy, nproc), seen
    pipeline = seen["pipeline"]
    assert (pipeline["schedule"], pipeline["stages"], pipeline["layers_per_stage"]) == (schedule, 2, 1), seen
    assert (pipeline["stage_ranks"], pipeline["data_parallel_size"]) == ([0, 1], nproc // 2), seen
    assert pipeline["tied_embedding_synced"] and pipeline["this_rank_layers"] == [0], seen  # rank 0: stage 0
    assert seen["local_parameter_fraction"] < (0.5 if config == "fsdp" else 0.9), seen  # a stage, FSDP2: its half
    assert quiet_console_problems(run.stdout + run.stderr, launcher) == []
    assert_same_training(run, reference)
    # Each rank sends its stage's output (activations forward, gradients backward) once per micro batch: micro x
    # block x hidden fp32 values, 2 micro batches per step; what it receives is as large. Every other kind to the
    # byte too (training/plan/communication.pipeline_payloads): the tie, DDP's average or FSDP2's gathers.
    sent = 2 * micro * 64 * 64 * 4  # the corpus's block of 64 tokens, the debug preset's hidden size of 64
    for record in seen["communication"]["per_rank"]:
        assert record["kinds"]["point_to_point"]["volume_bytes"] == sent, record
    assert_closed_form(run)
    # Each pipeline rank's share of the schedule spent in its stages, logged with every record; the rest is bubble
    # (at most 1 - 1/(M + P - 1) = 2/3 busy here, less the time the schedule itself and the sends take).
    busy = [[r[f"pp_rank{p}_busy"] for p in range(2)] for r in run.records if "loss" in r]
    assert len(busy) == STEPS and all(0 < b < 1 for step in busy for b in step), busy
