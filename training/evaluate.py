"""Evaluation: the token-mean validation loss over every validation block."""

from __future__ import annotations

import torch

from data import iter_eval_batches
from training.config import RunConfig


@torch.no_grad()
def evaluate(accelerator, net, blocks, cfg: RunConfig, dp: int, dp_rank: int) -> float | None:
    """Token-mean validation loss over every validation block: each data-parallel rank sums CE over its share,
    then the sums are added across ranks (a tensor-parallel group adds its one share tp times, to the CE sum and
    the token count alike). Every rank runs the same number of forwards (ZeRO-3 and FSDP gather inside)."""
    if blocks is None or (hasattr(blocks, "__len__") and len(blocks) == 0):
        return None
    net.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    batches = iter_eval_batches(blocks, cfg.per_device_eval_batch_size, dp, dp_rank)
    for i, micro in enumerate(batches):
        if cfg.max_eval_batches is not None and i >= cfg.max_eval_batches:
            break
        micro = {k: v.to(accelerator.device) for k, v in micro.items() if k != "num_items_in_batch"}
        total += net(**micro, num_items_in_batch=1).loss  # with a divisor of 1: the sum of CE on this rank
        count += (micro["shift_labels"] != -100).sum()
    total, count = accelerator.reduce(torch.stack([total, count.float()]), reduction="sum")  # collective
    return (total / count).item() if count > 0 else None
