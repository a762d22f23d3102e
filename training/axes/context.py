"""Torch's ring context parallelism (an FSDP2 YAML's `parallelism_config_cp_size`), passed through to accelerate on
CUDA GPUs only: each micro batch's positions sharded over the cp ranks inside accelerate's context, each shard's loss
its share of the global batch's mean, as under Ulysses (training/axes/ulysses.py). FSDP2 reduce-scatters over
accelerate's flattened dp_shard x cp mesh (`Strategy.gradient_divisor`). Imported only by a launch whose
context-parallel degree is above 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from training.axes.table import AXES, composes

if TYPE_CHECKING:
    from training.config import RunConfig


def check_context_parallel(cfg: RunConfig, cp: int, held_by: str, fsdp_version: int, cuda: bool) -> None:
    """Torch's ring context parallelism, passed through to accelerate where it can run: FSDP2 on CUDA GPUs, whose
    flash or memory-efficient attention kernels its ring attention needs (accelerate shards the batch's positions in
    `maybe_context_parallel`, load-balanced: 2 x cp chunks of each sequence). Unproven here: this project has no
    machine with several GPUs (docs/strategies.md). Refused elsewhere, in one line each."""
    if cp == 1:
        return
    if not cuda:
        raise ValueError(
            f"the accelerate config's parallelism_config sets cp_size: {cp} (torch's ring context parallelism), which "
            "needs CUDA's flash or memory-efficient attention kernels and cannot run on CPU ranks; for long sequences "
            "here use Ulysses: parallelism_config_sp_size with a DeepSpeed config (docs/strategies.md), or remove "
            "parallelism_config_cp_size"
        )
    if not composes("cp", held_by) or fsdp_version != 2:
        raise ValueError(
            f"parallelism_config_cp_size: {cp} needs FSDP2 (accelerate shards over its dp_shard x cp mesh): launch "
            "with an FSDP config with fsdp_version: 2, or use parallelism_config_sp_size with a DeepSpeed config"
        )
    if cfg.pipeline_parallel_degree > 1 and AXES["cp"].alone:
        raise ValueError(
            f"parallelism_config_cp_size: {cp} with --pipeline_parallel_degree {cfg.pipeline_parallel_degree}: the "
            "pipeline's stages run outside accelerate's context-parallel preparation; choose one of them"
        )
    if cfg.block_size % (2 * cp):
        raise ValueError(
            f"--block_size {cfg.block_size} is not divisible by 2 x cp_size = {2 * cp} (torch's load-balanced ring "
            f"attention splits each sequence into 2 x cp chunks): pass a multiple of {2 * cp}"
        )


def context_parallel(accelerator):
    """The context each micro batch's forward and backward run in under ring context parallelism (CUDA only):
    accelerate's `maybe_context_parallel`, which shards the positions of the inputs, the shifted labels and the
    position ids over the cp ranks (load-balanced) and keeps them sharded; the loss of each shard is its share of
    the global batch's mean, as under Ulysses."""

    def enter(micro: dict):
        batch, length = micro["input_ids"].shape
        micro["position_ids"] = torch.arange(length, device=micro["input_ids"].device).expand(batch, length)
        buffers = [micro["input_ids"], micro["shift_labels"], micro["position_ids"]]
        return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                  no_restore_buffers=set(buffers))  # fmt: skip

    return enter
