"""One optimizer step over a global batch, the same under every strategy.

Kept apart from the training script so that tests can drive exactly this code with batches they craft
(for instance, micro batches with different numbers of counted tokens).
"""

from __future__ import annotations

import math

import torch

from . import faults


class NonFiniteLossError(RuntimeError):
    pass


def train_step(accelerator, net, optimizer, scheduler, micro_batches, loss_scale: float, max_grad_norm: float,
               step: int, tp_size: int = 1) -> tuple[float, float | None]:  # fmt: skip
    """Forward and backward every micro batch of this rank, then step the optimizer and the schedule.

    Each micro batch's loss is sum(CE) / (targets in the whole global batch). DDP, FSDP and DeepSpeed average
    gradients over ranks and accelerate/DeepSpeed divide the loss by the accumulation steps, so the caller's
    `loss_scale` = world size x accumulation steps makes the update the gradient of the token-mean loss of the
    global batch, however it is split into micro batches and ranks. `loss_scale` counts data-parallel ranks: the
    `tp_size` ranks of a tensor-parallel group compute the same loss on the same batch.

    Returns the global batch's loss and the gradient norm (before clipping). Raises `NonFiniteLossError`
    before the optimizer step if either is not finite.
    """
    step_loss = torch.zeros((), device=accelerator.device)
    grad_norm = None
    scaled = loss_scaling(accelerator, net)  # fp16: an overflow skips the step instead of stopping the run
    for i, micro in enumerate(micro_batches):
        micro = {k: v.to(accelerator.device, non_blocking=True) for k, v in micro.items()}
        with accelerator.accumulate(net):  # no gradient sync until the last micro batch
            loss = net(**micro).loss
            if faults.active("nan", step):
                loss = loss * float("nan")
            step_loss += loss.detach()
            if i == len(micro_batches) - 1:
                # Before the backward that ends the step (under DeepSpeed it also steps the optimizer).
                # Collective: the sum of the ranks' partial losses is the global batch's token-mean loss (each
                # tensor-parallel group adds its share tp_size times).
                global_loss = accelerator.reduce(step_loss, reduction="sum").item() / tp_size
                if not math.isfinite(global_loss) and not scaled:
                    raise NonFiniteLossError(
                        f"loss is {global_loss} at step {step}; stopped before the optimizer step, the weights of "
                        "the last checkpoint are untouched (lower --learning_rate, or train in bf16)"
                    )
            accelerator.backward(loss * loss_scale)
            if accelerator.sync_gradients:
                grad_norm = clip_gradients(accelerator, net, max_grad_norm)  # collective under FSDP/ZeRO
                if grad_norm is not None and not math.isfinite(grad_norm) and not scaled:
                    raise NonFiniteLossError(
                        f"gradient norm is {grad_norm} at step {step}; stopped before the optimizer step"
                    )
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if grad_norm is None and hasattr(net, "get_global_grad_norm"):  # DeepSpeed's, after its step
                    grad_norm = float(net.get_global_grad_norm())
    return global_loss, grad_norm


def loss_scaling(accelerator, net) -> bool:
    """Whether fp16 loss scaling is in force (GPUs only): accelerate's GradScaler (DDP, one process) or FSDP2's
    scaler, or DeepSpeed's dynamic loss scale. Under it a step whose gradients overflow is skipped by the scaler,
    which then lowers the scale: counted by `step_was_skipped`, not a reason to stop."""
    return accelerator.scaler is not None or bool(getattr(net, "fp16_enabled", lambda: False)())


def step_was_skipped(optimizer) -> bool:
    """Whether loss scaling skipped the optimizer step just taken (accelerate's optimizer wrappers report it,
    from the GradScaler or DeepSpeed's overflow flag; always False without fp16)."""
    inner = getattr(optimizer, "optimizer", None)
    if getattr(optimizer, "scaler", None) is None and not hasattr(inner, "overflow"):
        return False  # no loss scaling: nothing can be skipped
    return bool(optimizer.step_was_skipped)


def clip_gradients(accelerator, net, max_norm: float) -> float | None:
    """Clip (unless DeepSpeed clips itself, from `gradient_clipping`) and return the global gradient norm."""
    if accelerator.distributed_type.name == "DEEPSPEED":
        return None  # DeepSpeed clips inside its step and reports the norm after it
    limit = max_norm if max_norm > 0 else float("inf")  # 0 disables clipping; the norm is still measured
    return accelerator.clip_grad_norm_(net.parameters(), limit).item()
