"""Gradient accumulation weights tokens, not micro batches: accumulation 4 x micro 2 gives the same update
as accumulation 1 x micro 8 (2 ranks, global batch 16), step by step, with sequences whose numbers of
counted targets range from 1 to 32, under DDP, FSDP and ZeRO-2."""

from __future__ import annotations

import json

import pytest
import torch
from launching import ROOT, launch, launcher_command

WORKER = ROOT / "tests" / "training" / "ga_worker.py"
ARGS = ["--preset=debug", "--learning_rate=3e-3", "--warmup_steps=1", "--max_steps=6"]


def run(config: str, micro: int, accumulation: int, out):
    cmd = launcher_command("accelerate", config)
    cmd[-1] = str(WORKER)  # the same launch, with the worker instead of train.py
    args = [*ARGS, f"--per_device_train_batch_size={micro}", f"--gradient_accumulation_steps={accumulation}"]
    launch(cmd, args, out)
    return json.loads((out / "ga.json").read_text()), torch.load(out / "final.pt")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero2"])
def test_accumulation_is_token_weighted(config, tmp_path):
    (acc, w_acc), (big, w_big) = run(config, 2, 4, tmp_path / "acc"), run(config, 8, 1, tmp_path / "big")
    # The test has teeth: micro batches differ a lot in how many targets they count, so averaging per micro
    # batch instead of per token would change the loss and the update.
    counts = [c for step in acc["micro_counts"] for c in step]
    assert max(counts) > 2 * min(counts)
    # Same losses step by step (fp32; only the summation order differs: measured at most 7.6e-8 relative).
    for step, (a, b) in enumerate(zip(acc["losses"], big["losses"], strict=True), 1):
        assert a == pytest.approx(b, rel=1e-6), f"step {step}"
    # Same weights. Adam divides by sqrt(v), so rounding in near-zero gradients moves an element by up to
    # ~lr x 1e-3: measured at most 4.8e-6 absolute after 6 steps of lr 3e-3 (each element travels up to 1.8e-2).
    for name, value in w_big.items():
        torch.testing.assert_close(w_acc[name], value, rtol=1e-4, atol=2e-5, msg=name)
