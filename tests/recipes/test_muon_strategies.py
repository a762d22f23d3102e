"""--optim muon trains the same model under every strategy (training/muon.py): on 2 CPU ranks, every step's loss and
gradient norm (before clipping, which acts at every step) against one process's with the same flags, the groups and
the whole matrices the first step orthogonalized read back from strategy.json, and Muon's state resumed exactly and
converted between strategies and world sizes.

Tolerance: relative 1e-5 for losses and norms, with the Newton-Schulz iteration in float32 (--muon_ns_dtype), so that
the update is rounded as fp32 rounds; measured worst 1.5e-7 (losses) and 1.3e-7 (norms) over these 20 steps on 2 CPU
cores. In torch's bfloat16 a last-bit difference of the reduced gradient moves a bfloat16 rounding: 1.1e-5 and
1.4e-4 measured (docs/training.md). A matrix orthogonalized on a shard, or an update skipped, moves them by far more
(tests/training/test_muon.py).
"""

from __future__ import annotations

import pytest
from communication import assert_closed_form
from launching import launch, launcher_command

STEPS = 20
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=2", "--save_total_limit=5", "--sample_max_new_tokens=0",
    "--optim=muon", "--muon_ns_dtype=float32",
]  # fmt: skip
RTOL = 1e-5
PIPELINE = ["--pipeline_parallel_degree=2", "--per_device_train_batch_size=4", "--gradient_accumulation_steps=2"]
# (launcher, config, flags, the layout strategy.json reads, Muon's matrices on rank 0): the global batch of 8 each
# step, as one process's micro batch of 8. The debug preset's 2 layers hold 7 matrices each.
SAVING = {"ddp": ["--per_device_train_batch_size=4", "--save_steps=5"],
          "zero3": ["--per_device_train_batch_size=4", "--save_steps=5"]}  # fmt: skip
CELLS = [
    pytest.param("accelerate", "ddp", SAVING["ddp"], "tensors", 14, id="ddp"),
    pytest.param(
        "accelerate",
        "fsdp",
        ["--per_device_train_batch_size=2", "--gradient_accumulation_steps=2"],
        "tensors",
        14,
        id="fsdp",
    ),  # fmt: skip
    pytest.param(
        "accelerate", "zero1", ["--per_device_train_batch_size=4"], "zero1", 14, id="zero1", marks=pytest.mark.matrix
    ),  # fmt: skip
    pytest.param(
        "deepspeed",
        "zero2",
        ["--per_device_train_batch_size=2", "--gradient_accumulation_steps=2"],
        "zero2",
        14,
        id="zero2",
        marks=pytest.mark.matrix,
    ),  # fmt: skip
    pytest.param("accelerate", "zero3", SAVING["zero3"], "zero3", 14, id="zero3"),
    pytest.param("torchrun", None, PIPELINE, "tensors", 7, id="pipeline"),  # rank 0: the first stage's layer
]
_RUNS: dict = {}


def muon_run(key, cmd, args, tmp_path_factory):
    """A launch made once per test process."""
    if key not in _RUNS:
        _RUNS[key] = launch(cmd, args, tmp_path_factory.mktemp(f"muon-{key}") / "out")
    return _RUNS[key]


def reference(corpus, tmp_path_factory):
    args = [*corpus["flags"], *TRAIN, "--per_device_train_batch_size=8"]
    return muon_run("reference", launcher_command("python"), args, tmp_path_factory)


def cell(launcher, config, flags, corpus, tmp_path_factory):
    cmd = launcher_command(launcher, config)
    if launcher == "deepspeed":
        flags = [*flags, f"--deepspeed=ds_configs/{config}.json"]
    return muon_run((launcher, config), cmd, [*corpus["flags"], *TRAIN, *flags], tmp_path_factory)


def assert_same(run, ref, steps) -> None:
    """Every step's loss and gradient norm within RTOL of the reference's."""
    norms = {r["step"]: r["grad_norm"] for r in run.records if "grad_norm" in r}
    ref_norms = {r["step"]: r["grad_norm"] for r in ref.records if "grad_norm" in r}
    assert sorted(run.own_losses) == list(steps), sorted(run.own_losses)
    assert min(ref_norms.values()) > 1.0, ref_norms  # --max_grad_norm 1: clipping acts at every step
    for step in steps:
        assert run.own_losses[step] == pytest.approx(ref.losses[step], rel=RTOL), f"step {step}"
        assert norms[step] == pytest.approx(ref_norms[step], rel=RTOL), f"step {step}"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config", "flags", "layout", "matrices"), CELLS)
def test_muon_trains_the_same_model(launcher, config, flags, layout, matrices, corpus, tmp_path_factory):
    ref = reference(corpus, tmp_path_factory)
    run = cell(launcher, config, flags, corpus, tmp_path_factory)
    assert_same(run, ref, range(1, STEPS + 1))
    seen = run.strategy["optimizer"]
    assert (seen["name"], seen["layout"], seen["ns_dtype"]) == ("muon", layout, "float32"), seen
    # Every Muon matrix this rank holds orthogonalized whole in the first step: an update skipped would read fewer.
    assert seen["muon_matrices"] == seen["orthogonalized_first_step"] == matrices, seen
    groups = {g["name"]: g for g in seen["groups"]}
    assert groups["muon"]["optimizer"] == "muon" and groups["adamw_no_decay"]["optimizer"] == "adamw", groups
    assert ref.strategy["optimizer"]["orthogonalized_first_step"] == 14
    # What a step sends, to the byte: FSDP2 and ZeRO all-gather the matrices' update once more (4 bytes an element)
    assert_closed_form(run)
    if config is not None:  # the memory planner's optimizer states, to the byte: one momentum per Muon element
        assert run.strategy["local_optimizer_state_bytes"] == planned_states(run, flags), run.strategy


def planned_states(run, flags) -> int:
    """Rank 0's optimizer states (AdamW's moments, Muon's momentum; not the step counters), as the memory planner
    predicts them for the run's model and strategy."""
    from model import ShardGPTConfig
    from training.plan.memory.planner import predict
    from training.strategy import Strategy

    seen = run.strategy
    micro = int(next(f.split("=")[1] for f in flags if f.startswith("--per_device_train_batch_size")))
    config = ShardGPTConfig.from_pretrained(run.output_dir)
    plan = predict(config, Strategy.from_name(seen["strategy"], seen["world_size"]), "fp32", micro, 64,
                   cpu_ranks=True, optim="muon", rank=0)  # fmt: skip
    return sum(v for k, v in plan["detail"].items() if ":optimizer_states." in k and not k.endswith("adam.step"))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("source", "launcher", "config", "flags"),
    [
        # DDP's checkpoint under DDP: natively, Muon's momentum buffers with the rest
        (("accelerate", "ddp"), "accelerate", "ddp", ["--per_device_train_batch_size=4"]),
        # ZeRO-3's flat partitions, read by their layout, into one process
        (("accelerate", "zero3"), "python", None, ["--per_device_train_batch_size=8"]),
    ],
    ids=["ddp->ddp", "zero3@2->single@1"],
)
def test_muon_resumes_and_converts(source, launcher, config, flags, corpus, tmp_path_factory, tmp_path):
    """From step 5 of a cell's run: every later step's loss and norm as the uninterrupted one process's."""
    ref = reference(corpus, tmp_path_factory)
    written = cell(*source, SAVING[source[1]], corpus, tmp_path_factory)
    args = [*corpus["flags"], *TRAIN, *flags, f"--resume_from_checkpoint={written.output_dir / 'checkpoint-5'}"]
    run = launch(launcher_command(launcher, config), args, tmp_path / "out")
    assert_same(run, ref, range(6, STEPS + 1))
    assert run.strategy["optimizer"]["orthogonalized_first_step"] == 14  # the resumed run's first step
    if source[1] == "zero3":  # converted once, by rank 0, into the checkpoint's directory
        assert (written.output_dir / "checkpoint-5" / "neutral.pt").is_file()


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_hf_trainer_steps_the_same_muon(corpus, tmp_path_factory, tmp_path):
    """recipes/trainer.py with --optim muon under ZeRO-3: the Trainer's DeepSpeed engine steps the project's Muon on
    its partitions, every step as one process's."""
    ref = reference(corpus, tmp_path_factory)
    args = [*corpus["flags"], *TRAIN, "--per_device_train_batch_size=4", "--deepspeed=ds_configs/zero3.json"]
    run = launch(launcher_command("deepspeed", script="trainer.py"), args, tmp_path / "out")
    assert_same(run, ref, range(1, STEPS + 1))
    seen = run.strategy["optimizer"]
    assert (seen["layout"], seen["orthogonalized_first_step"]) == ("zero3", 14), seen
