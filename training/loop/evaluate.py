"""Evaluation: the token-mean validation loss over every validation block, whichever engine computes it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from data import iter_eval_batches
from training.config import RunConfig


@torch.no_grad()
def evaluate(accelerator, net, blocks, cfg: RunConfig, dp: int, dp_rank: int,
             sums: Callable[[dict], torch.Tensor] | None = None) -> float | None:  # fmt: skip
    """Token-mean validation loss over every validation block: each data-parallel rank adds up, over its share of
    the blocks, the summed cross-entropy and the counted targets (`sums(micro)`, a tensor of the two; by default
    `net`'s forward on this rank), then the sums are added across every rank. A tensor-parallel group adds its one
    share tp times, to the cross-entropy and the count alike; a pipeline's ranks but the last stage's add zeros.
    Every rank runs the same number of forwards (ZeRO-3 and FSDP gather inside, a pipeline sends between stages)."""
    if blocks is None or (hasattr(blocks, "__len__") and len(blocks) == 0):
        return None
    net.eval()
    sums = sums or partial_sums(accelerator, net)
    total = torch.zeros(2, device=accelerator.device)
    for i, micro in enumerate(iter_eval_batches(blocks, cfg.per_device_eval_batch_size, dp, dp_rank)):
        if cfg.max_eval_batches is not None and i >= cfg.max_eval_batches:
            break
        total += sums(micro)
    total = accelerator.reduce(total, reduction="sum")  # collective: every rank
    return (total[0] / total[1]).item() if total[1] > 0 else None


def partial_sums(accelerator, net) -> Callable[[dict], torch.Tensor]:
    """The whole model's sums on this rank's micro batch: (summed cross-entropy, counted targets)."""

    def sums(micro: dict) -> torch.Tensor:
        micro = {k: v.to(accelerator.device) for k, v in micro.items() if k != "num_items_in_batch"}
        ce = net(**micro, num_items_in_batch=1).loss  # with a divisor of 1: the sum of CE on this rank
        return torch.stack([ce.float(), (micro["shift_labels"] != -100).sum().float()])

    return sums
