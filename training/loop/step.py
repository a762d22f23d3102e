"""One optimizer step over a global batch, the same under every strategy.

Kept apart from the training script so that tests can drive exactly this code with batches they craft
(for instance, micro batches with different numbers of counted tokens).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch

from training import faults
from training.core.family import family_for
from training.core.gradnorm import clip_, grad_norm


class NonFiniteLossError(RuntimeError):
    pass


class ZeroGradientError(RuntimeError):
    """A step with a finite, non-zero loss whose every gradient is exactly zero: nothing would ever train."""


@dataclass
class StepResult:
    loss: float  # the global batch's token-mean loss
    grad_norm: float | None  # the global gradient norm before clipping
    skipped: bool = False  # fp16 loss scaling skipped the update (the gradients overflowed)
    pipeline_busy: list[float] | None = None  # pipeline runs: each pipeline rank's share of the schedule computing


def train_step(accelerator, net, optimizer, scheduler, micro_batches, loss_scale: float, max_grad_norm: float,
               step: int, tp_size: int = 1, context=None, sharded_group=None) -> StepResult:  # fmt: skip
    """Forward and backward every micro batch of this rank, then step the optimizer and the schedule.

    Each micro batch's loss is sum(CE) / (targets in the whole global batch). DDP, FSDP and DeepSpeed average
    gradients over ranks and accelerate/DeepSpeed divide the loss by the accumulation steps, so the caller's
    `loss_scale` = world size x accumulation steps makes the update the gradient of the token-mean loss of the
    global batch, however it is split into micro batches and ranks. `loss_scale` counts data-parallel ranks: the
    `tp_size` ranks of a tensor-parallel group compute the same loss on the same batch.

    `sharded_group`: the ranks that hold shards of the plain gradients, for their norm (the family's `norm_group`:
    FSDP1's process group; `clip_gradients`).

    `context(micro)`, if given, is a context manager each micro batch's forward and backward run in (ring context
    parallelism shards the micro batch's positions in it: training/axes/ulysses.py).

    Returns the global batch's loss, the gradient norm (before clipping) and whether fp16 loss scaling skipped the
    update. Raises `NonFiniteLossError` before the optimizer step if the loss or the norm is not finite (unless
    loss scaling is in force: then the scaler skips the update).
    """
    step_loss = torch.zeros((), device=accelerator.device)
    grad_norm, skipped = None, False
    scaled = loss_scaling(accelerator, net)  # fp16: an overflow skips the step instead of stopping the run
    for i, micro in enumerate(micro_batches):
        micro = {k: v.to(accelerator.device, non_blocking=True) for k, v in micro.items()}
        # no gradient sync until the last micro batch
        with accelerator.accumulate(net), context(micro) if context else contextlib.nullcontext():
            loss = net(**micro).loss
            if faults.active("nan", step):
                loss = loss * float("nan")
            step_loss += loss.detach()
            if i == len(micro_batches) - 1:
                # Before the backward that ends the step (under DeepSpeed it also steps the optimizer).
                # Collective: the sum of the ranks' partial losses is the global batch's token-mean loss (each
                # tensor-parallel group adds its share tp_size times).
                global_loss = accelerator.reduce(step_loss, reduction="sum").item() / tp_size
                check_loss(global_loss, step, scaled)
            accelerator.backward(loss * loss_scale)
            if accelerator.sync_gradients:
                clip = partial(clip_gradients, accelerator, net, max_grad_norm, sharded_group)  # FSDP: a collective
                grad_norm, skipped = update(accelerator, optimizer, scheduler, clip, step, scaled)
                if grad_norm is None and hasattr(net, "get_global_grad_norm"):  # DeepSpeed's, after its step
                    grad_norm = float(net.get_global_grad_norm())
    return StepResult(global_loss, grad_norm, skipped)


def accumulated_loss_scale(strategy, accumulation: int) -> float:
    """`train_step`'s `loss_scale` for the launch: what the gradient reduction divides by on the strategy's mesh
    (`Strategy.gradient_divisor`: the data-parallel ranks, or DeepSpeed's own divisor under sequence parallelism)
    times the accumulation steps accelerate and DeepSpeed divide the loss by."""
    return strategy.gradient_divisor * accumulation


def pipelined_step(pipeline, micro_batches: list[dict], optimizer, scheduler, max_grad_norm: float, step: int,
                   autocast, accelerator=None) -> StepResult:  # fmt: skip
    """One optimizer step of this rank's pipeline stages (training/axes/pipeline/): every micro batch through the
    schedule, forward and backward, with the gradients reduced as one process's would be, then the tail every step
    shares (`check_loss`, `update`). No loss scaling: the pipelines run fp32 or bf16."""
    # collective: the stages' sends, the data-parallel reduction, the tied gradient, the loss to every rank
    global_loss, busy = pipeline.forward_backward(micro_batches, autocast)
    check_loss(global_loss, step)
    clip = partial(pipeline.clip_gradients, max_grad_norm)  # collective: the norm over the pipeline's stages
    grad_norm, skipped = update(accelerator, optimizer, scheduler, clip, step)
    return StepResult(global_loss, grad_norm, skipped, pipeline_busy=busy)


def check_loss(global_loss: float, step: int, scaled: bool = False) -> None:
    """Stop before the optimizer step if the global batch's loss is not finite (unless fp16 loss scaling is in
    force: its scaler skips the update instead)."""
    if not math.isfinite(global_loss) and not scaled:
        raise NonFiniteLossError(
            f"loss is {global_loss} at step {step}; stopped before the optimizer step, the weights of the last "
            "checkpoint are untouched (lower --learning_rate, or train in bf16)"
        )


def update(accelerator, optimizer, scheduler, clip, step: int, scaled: bool = False) -> tuple[float | None, bool]:
    """The tail of every step, once the gradients are whole: `clip()` clips them and returns the global norm (None
    where DeepSpeed clips inside its own step), a non-finite norm stops the run before the update (unless fp16 loss
    scaling skips it), then the optimizer and the schedule step and the gradients are dropped. Returns the norm and
    whether fp16 loss scaling skipped the update. `accelerator`: None where no accelerate scaler can be in force."""
    grad_norm = clip()
    if grad_norm is not None and not math.isfinite(grad_norm) and not scaled:
        raise NonFiniteLossError(f"gradient norm is {grad_norm} at step {step}; stopped before the optimizer step")
    scaler = getattr(accelerator, "scaler", None)
    scale = scaler.get_scale() if scaler is not None else None
    optimizer.step()
    skipped = update_was_skipped(accelerator, optimizer, scale)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def loss_scaling(accelerator, net) -> bool:
    """Whether fp16 loss scaling is in force (GPUs only): accelerate's GradScaler (DDP, one process) or FSDP2's
    scaler, or DeepSpeed's dynamic loss scale. Under it a step whose gradients overflow is skipped by the scaler,
    which then lowers the scale: reported by `update_was_skipped`, not a reason to stop."""
    return accelerator.scaler is not None or bool(getattr(net, "fp16_enabled", lambda: False)())


def update_was_skipped(accelerator, optimizer, scale_before: float | None) -> bool:
    """Whether fp16 loss scaling skipped the update just taken. accelerate's GradScaler lowers its scale exactly when
    it skips a step (inf or NaN gradients), which holds for fused optimizers too: with a fused AdamW (CUDA) the
    scaler calls the optimizer's step, which skips inside, and accelerate's own `step_was_skipped` stays False.
    DeepSpeed's optimizer reports its overflow flag. Always False without fp16."""
    if scale_before is not None:
        return accelerator.scaler.get_scale() < scale_before
    return hasattr(getattr(optimizer, "optimizer", None), "overflow") and bool(optimizer.step_was_skipped)


def check_gradients_flow(result: StepResult, step: int, compiled: bool) -> None:
    """After a process's first optimizer step: a finite, non-zero loss with a gradient norm of exactly zero means
    no weight can ever change. It is what torch 2.11's compiler did to this model's earlier loss (in-place writes
    inside a traced autograd function, pytorch issue 180642); stop instead of training nothing for hours."""
    if result.grad_norm != 0.0 or not math.isfinite(result.loss) or result.loss == 0.0 or result.skipped:
        return
    cause = (
        f"--torch_compile with torch {torch.__version__} produced zero gradients: train without --torch_compile, "
        "or with another torch"
        if compiled
        else "the loss does not reach the weights: check for frozen parameters or a detached loss"
    )
    raise ZeroGradientError(
        f"the gradient norm is exactly 0 at step {step} while the loss is {result.loss:.4f}: nothing would train; "
        f"{cause}"
    )


def clip_gradients(accelerator, net, max_norm: float, sharded_group=None) -> float | None:
    """Clip (unless DeepSpeed clips itself, from `gradient_clipping`) and return the global gradient norm, summed
    in float64 as DeepSpeed sums its own (training/core/gradnorm.py). `max_norm` 0 disables clipping; the norm is
    still measured. `sharded_group`: the ranks FSDP1 shards the plain gradients over (None: each rank holds them whole,
    or they are DTensors that say so)."""
    if family_for(accelerator).clips_itself():
        return None  # DeepSpeed clips inside its step and reports the norm after it
    accelerator.unscale_gradients()  # fp16: the loss scaler's gradients back to their true size first
    parameters = list(net.parameters())
    # collective under FSDP: the shards' squares added over the ranks
    total = grad_norm(parameters, accelerator.device, sharded_group)
    clip_(parameters, max_norm, total)
    return total.item()
