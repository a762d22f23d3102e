"""One optimizer step's bookkeeping (training/loop/step.py): what fp16 loss scaling skipped, and the stop on gradients
that are all zero."""

import re
import types

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState

from training.loop.step import StepResult, ZeroGradientError, check_gradients_flow, update_was_skipped


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_skipped_update_is_counted_with_fused_and_unfused_adamw(fused):
    """The GradScaler skips the update whose gradients hold a NaN and applies the next. With a fused AdamW it
    calls the optimizer's step, which skips inside: accelerate's `step_was_skipped` then stays False (what the
    H100 run's `overflow_skipped_steps` showed), while the scaler's lowered scale says it. On CPU (torch's CPU
    GradScaler and fused AdamW), as on GPUs."""
    AcceleratorState._reset_state(reset_partial_state=True)  # an earlier test's state, in this process, is not ours
    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
    net = torch.nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(net.parameters(), fused=fused), scaler=scaler)
    accelerator = types.SimpleNamespace(scaler=scaler)
    seen = []
    for factor in (float("nan"), 1.0):
        scaler.scale(net(torch.ones(2, 4)).sum() * factor).backward()
        before, weights = scaler.get_scale(), net.weight.detach().clone()
        optimizer.step()
        seen.append((update_was_skipped(accelerator, optimizer, before), not torch.equal(weights, net.weight)))
        optimizer.zero_grad()
    assert seen == [(True, False), (False, True)]  # (counted as skipped, weights changed)
    if fused:
        assert optimizer.step_was_skipped is False  # the blind spot: the NaN step above was skipped


def test_all_zero_gradients_stop_the_run_naming_compile():
    check_gradients_flow(StepResult(loss=9.16, grad_norm=1.3), 1, compiled=True)  # gradients flow: nothing said
    check_gradients_flow(StepResult(loss=0.0, grad_norm=0.0), 1, compiled=True)  # a zero loss has zero gradients
    check_gradients_flow(StepResult(loss=9.16, grad_norm=0.0, skipped=True), 1, compiled=True)  # fp16 skipped it
    with pytest.raises(
        ZeroGradientError, match=rf"exactly 0 at step 1 .* --torch_compile with torch {re.escape(torch.__version__)}"
    ):
        check_gradients_flow(StepResult(loss=9.16, grad_norm=0.0), 1, compiled=True)
    with pytest.raises(ZeroGradientError, match="the loss does not reach the weights"):
        check_gradients_flow(StepResult(loss=9.16, grad_norm=0.0), 3, compiled=False)
