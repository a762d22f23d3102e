"""Checkpoints: exact resume under each strategy, auto-resume skipping a half-written checkpoint, refusal
of another model's checkpoint, and the stop on a non-finite loss."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launching import launch, launcher_command
from safetensors.torch import load_file

from recipes.checkpoint import MARKER, latest_checkpoint, resolve_resume

TRAIN = [
    "--preset=debug", "--max_steps=20", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4", "--save_total_limit=5",
]  # fmt: skip

STRATEGIES = [("accelerate", "ddp"), ("accelerate", "fsdp"), ("accelerate", "zero2"), ("accelerate", "zero3")]


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


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config"), STRATEGIES, ids=lambda v: str(v))
def test_resume_continues_exactly(launcher, config, corpus, tmp_path):
    cmd = launcher_command(launcher, config)
    straight = launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=0"], tmp_path / "straight")

    # 10 steps and stop (saving at 5 and 10), then resume from the newest checkpoint for 10 more.
    out = tmp_path / "resumed"
    launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=10"], out)
    ckpt = out / "checkpoint-10"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["loader"]["step"] == 10
    # The resumed-from state is far from a fresh one, so a resume that silently restarted from the initial
    # weights (or the first batches) could not match the straight run's steps 11-20.
    assert straight.losses[11] < straight.losses[1] - 0.3
    resumed = launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--resume_from_checkpoint=auto"], out)

    a, b = straight.losses, resumed.losses
    for step in range(11, 21):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), f"step {step}: {b[step]} vs {a[step]}"
    wa, wb = final_weights(straight), final_weights(resumed)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_auto_resume_skips_a_half_written_checkpoint(corpus, tmp_path):
    cmd = launcher_command("python")
    out = tmp_path / "out"
    launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=10"], out)
    # Simulate a save killed half way: checkpoint-15 exists but has no marker.
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-15")
    (out / "checkpoint-15" / MARKER).unlink()
    run = launch(
        cmd, [*corpus["flags"], *TRAIN, "--save_steps=5", "--max_steps=12", "--resume_from_checkpoint=auto"], out
    )
    assert "skipping" in run.stderr and "checkpoint-15" in run.stderr
    assert min(run.losses) == 11  # resumed from step 10


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
    launch(cmd, [*corpus["flags"], *TRAIN, "--save_steps=2", "--max_steps=2"], out)
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    # An absurd learning rate blows the weights up within a few steps.
    bad = [*corpus["flags"], *TRAIN, "--learning_rate=1e12", "--warmup_steps=0", "--max_grad_norm=0",
           "--resume_from_checkpoint=auto", "--save_steps=100"]  # fmt: skip
    run = launch(cmd, bad, out, check=False)
    assert run.returncode == 2
    assert "stopped before the optimizer step" in run.stderr and "at step" in run.stderr
    again = load_file(out / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(saved[k], again[k]) for k in saved)
