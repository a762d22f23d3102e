"""Checkpoints: exact resume under each strategy, auto-resume skipping a half-written checkpoint, refusal
of another model's checkpoint, and the stop on a non-finite loss."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launching import launch, launcher_command, quiet_console_problems
from parity import cell_args, cell_run
from safetensors.torch import load_file

from training.checkpoints.checkpoint import MARKER, latest_checkpoint, resolve_resume

TRAIN = [
    "--preset=debug", "--max_steps=20", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4", "--save_total_limit=5",
]  # fmt: skip
# The straight runs: tests/recipes/parity.py's cells of these configs, which save every 5 steps; AutoTP's is this
# module's own.
SHARED = {"ddp", "fsdp", "zero2", "zero3"}

STRATEGIES = [
    ("accelerate", "ddp"), ("accelerate", "fsdp"), ("accelerate", "zero2"), ("accelerate", "zero3"),
    # DeepSpeed AutoTP: each rank saves and reloads its column/row shards (one data-parallel rank of micro 4).
    pytest.param("accelerate", "autotp", marks=pytest.mark.matrix),
]  # fmt: skip


def test_latest_checkpoint_skips_incomplete_ones(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}" / MARKER).write_text("{}")
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-20"
    assert resolve_resume("auto", str(tmp_path)) == tmp_path / "checkpoint-20"
    with pytest.raises(ValueError, match="has no checkpoint_complete marker"):
        resolve_resume(str(tmp_path / "checkpoint-30"), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_resume(str(tmp_path / "checkpoint-99"), str(tmp_path))


def final_weights(run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "model.safetensors")


_STRAIGHT: dict[str, object] = {}


def megabytes(checkpoint) -> str:
    """A checkpoint's size as its saved line gives it: the files its marker lists."""
    files = json.loads((checkpoint / MARKER).read_text())["files"]
    return f"{sum(f['size'] for f in files.values()) / 1e6:,.1f} MB"


def straight_args(config: str, corpus, scratch) -> list[str]:
    """The flags of `config`'s straight run, with which its resumed runs are launched too."""
    if config in SHARED:
        return cell_args("accelerate", config, corpus, scratch)
    return [*corpus["flags"], *TRAIN, "--save_steps=5"]


def straight_run(config: str, corpus, tmp_path_factory):
    """20 steps with a checkpoint every 5, once per strategy for every test that needs it."""
    if config in SHARED:
        return cell_run("accelerate", config, corpus, tmp_path_factory)
    if config not in _STRAIGHT:
        out = tmp_path_factory.mktemp(f"straight-{config}")
        args = straight_args(config, corpus, out)
        _STRAIGHT[config] = launch(launcher_command("accelerate", config), args, out / "run")
    return _STRAIGHT[config]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config"), STRATEGIES, ids=lambda v: str(v))
def test_resume_continues_exactly(launcher, config, corpus, tmp_path, tmp_path_factory):
    """20 straight steps (checkpoints every 5), then: drop what came after step 10 and resume to 20, then drop
    what came after 15 (a checkpoint the resumed process wrote) and resume again. Steps 11-20 and the final
    weights must be bitwise those of the straight run."""
    cmd = launcher_command(launcher, config)
    straight = straight_run(config, corpus, tmp_path_factory)
    out = tmp_path / "run"
    shutil.copytree(straight.output_dir, out)
    args = straight_args(config, corpus, tmp_path)
    losses, weights = straight.losses, final_weights(straight)
    # The resumed-from state is far from a fresh one, so a resume that silently restarted from the initial
    # weights (or the first batches) could not match the straight run's later steps.
    assert sorted(losses) == list(range(1, 21)) and losses[11] < losses[1] - 0.3
    # Each checkpoint is one line of the project's, on rank 0 alone, and none of accelerate's.
    saved = [line.split(" INFO ")[-1] for line in straight.stderr.splitlines() if "saved checkpoint-" in line]
    out_dir = straight.output_dir
    assert saved == [
        f"saved checkpoint-{s} ({megabytes(out_dir / f'checkpoint-{s}')}) to {out_dir}" for s in (5, 10, 15, 20)
    ]
    assert quiet_console_problems(straight.stdout + straight.stderr, launcher) == []

    for resume_from in (10, 15):
        for step in range(resume_from + 5, 21, 5):
            shutil.rmtree(out / f"checkpoint-{step}")
        (out / "model.safetensors").unlink()
        state = json.loads((out / f"checkpoint-{resume_from}" / "trainer_state.json").read_text())
        assert state["step"] == resume_from and state["loader"]["step"] == resume_from
        resumed = launch(cmd, [*args, "--resume_from_checkpoint=auto"], out)
        assert f"resumed from {out / f'checkpoint-{resume_from}'}" in resumed.stderr
        again = resumed.own_losses  # this run's records alone: a step it failed to log cannot pass
        assert sorted(again) == list(range(resume_from + 1, 21)), f"the resumed run logged steps {sorted(again)}"
        for step in range(resume_from + 1, 21):
            assert again[step] == losses[step], f"resume from {resume_from}, step {step}"
        final = final_weights(resumed)
        assert all(torch.equal(final[k], weights[k]) for k in weights), f"resume from {resume_from}: weights differ"


@pytest.mark.slow
def test_auto_resume_skips_a_half_written_checkpoint(corpus, tmp_path):
    cmd = launcher_command("python")
    out = tmp_path / "out"
    launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=10"], out)
    # Simulate a save killed half way: checkpoint-15 exists but has no marker.
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-15")
    (out / "checkpoint-15" / MARKER).unlink()
    args = [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=12", "--resume_from_checkpoint=auto"]
    run = launch(cmd, args, out)
    assert "skipping" in run.stderr and "checkpoint-15" in run.stderr
    assert sorted(run.own_losses) == [11, 12]  # resumed from step 10


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(corpus, tmp_path):
    cmd = launcher_command("python")
    out = tmp_path / "out"
    launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=5"], out)
    run = launch(cmd, [*corpus["flags"], *TRAIN, "--preset=tiny", "--resume_from_checkpoint=auto"], out, check=False)
    assert run.returncode == 2
    assert "holds a different model (hidden_size: checkpoint 64 vs this run 256" in run.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_before_the_optimizer_step(corpus, tmp_path):
    cmd = launcher_command("python")
    out = tmp_path / "out"
    args = [*corpus["flags"], *TRAIN, "--save_steps=1"]
    run = launch(cmd, args, out, check=False, env={"SHARDGPT_FAULT": "nan@4"})
    assert run.returncode == 2
    assert "loss is nan at step 4; stopped before the optimizer step" in run.stderr
    # The weights on disk are the last good ones: step 3's checkpoint is complete, nothing of step 4 exists.
    assert latest_checkpoint(out) == out / "checkpoint-3"
    assert not (out / "checkpoint-4").exists() and not (out / "model.safetensors").exists()
    assert max(run.losses) == 3


KILLS = [
    ("ddp", "kill@12", 10),
    ("ddp", "kill_in_save@10", 5),
    pytest.param("ddp", "kill_mid_shard@10", 5, marks=pytest.mark.matrix),  # one file: FSDP's and ZeRO-3's shards below
    ("fsdp", "kill_mid_shard@10", 5),
    ("zero3", "kill_mid_shard@10", 5),
]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("config", "fault", "resumed_from"), KILLS, ids=lambda v: str(v))
def test_killed_run_resumes_to_the_same_weights(config, fault, resumed_from, corpus, tmp_path, tmp_path_factory):
    """Rank 0 is SIGKILLed after step 12, after the shards of checkpoint 10 are written but before its marker, or
    while a shard of checkpoint 10 is being written (its largest file cut short); the launcher tears the job
    down; a relaunch with `--resume_from_checkpoint auto` skips the half-written checkpoint and ends with the
    uninterrupted run's weights."""
    cmd = launcher_command("accelerate", config)
    args = straight_args(config, corpus, tmp_path)
    straight = straight_run(config, corpus, tmp_path_factory)
    out = tmp_path / "killed"
    killed = launch(cmd, args, out, check=False, env={"SHARDGPT_FAULT": fault})
    assert killed.returncode != 0 and not (out / "model.safetensors").exists()
    if "save" in fault or "shard" in fault:
        assert (out / "checkpoint-10").is_dir() and not (out / "checkpoint-10" / MARKER).exists()
    if "shard" in fault:  # a file of the killed save is shorter than the same file of a complete save
        whole = straight.output_dir / "checkpoint-10"
        cut = [f for f in whole.rglob("*") if f.is_file() and (out / "checkpoint-10" / f.relative_to(whole)).exists()
               and (out / "checkpoint-10" / f.relative_to(whole)).stat().st_size < f.stat().st_size]  # fmt: skip
        assert cut, "no file of checkpoint-10 was cut short"
    assert latest_checkpoint(out) == out / f"checkpoint-{resumed_from}"
    resumed = launch(cmd, [*args, "--resume_from_checkpoint=auto"], out)
    assert f"resumed from {out / f'checkpoint-{resumed_from}'}" in resumed.stderr
    again = resumed.own_losses
    assert sorted(again) == list(range(resumed_from + 1, 21)), f"the resumed run logged steps {sorted(again)}"
    assert all(again[s] == straight.losses[s] for s in again), "the resumed run's losses differ"
    final, expected = final_weights(resumed), final_weights(straight)
    assert all(torch.equal(final[k], expected[k]) for k in expected)
