"""Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): each sequence split over `sp` ranks.

Each rank of a sequence-parallel group holds block_size / sp consecutive positions of the same sequences (the
loader slices them: `data.ShardedLoader`, `sequence_parallel_size`); its embeddings, norms, MLPs and loss see only
those. Attention needs every position: DeepSpeed's `UlyssesSPAttentionHF`, registered with transformers' attention
interface, exchanges the q, k and v of the local positions for all positions of heads / sp heads (an all-to-all),
attends, and exchanges back (an all-to-all). The degree comes from the launch's configuration: an accelerate YAML's
`parallelism_config` block (`parallelism_config_sp_size`, `parallelism_config_sp_backend: deepspeed`), or the
DeepSpeed JSON's own `sequence_parallel_size` under the `deepspeed` launcher and torchrun. Either way accelerate's
`prepare` registers the attention and hands DeepSpeed its groups (`accelerator_parallelism_config`).

The loss, done so that the gradients are the one process's: each rank's loss is the sum of its positions'
cross-entropy over the targets of the whole global batch (the loader's `num_items_in_batch`, as without sequence
parallelism), so the ranks' losses add up to the global batch's mean. DeepSpeed then averages each gradient over
the sequence-and-data-parallel ranks, dividing by a count that depends on the ZeRO stage (`gradient_divisor`); the
step multiplies the loss by that count. The recipe in DeepSpeed's tutorial, accelerate's docs and the HF Trainer
(every rank computes the sequence's whole loss from the gathered per-rank losses) makes each rank's gradient sp
times its share: right where DeepSpeed divides by the world (ZeRO-3's reduce-scatter) and sp times too large where it
divides by world / sp (ZeRO-1 and 2).

Torch's ring context parallelism (an FSDP2 YAML's `parallelism_config_cp_size`) is passed through to accelerate on
CUDA GPUs only (`check_context_parallel`, `context_parallel`): the same loss, inside accelerate's context that shards
each micro batch's positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from training.axes.table import AXES, composes
from training.mesh import Mesh

if TYPE_CHECKING:
    from model import ShardGPTConfig
    from training.config import RunConfig
    from training.environment import Environment

# Attention kernels DeepSpeed's Ulysses wraps (it needs one that masks causally by itself: eager builds a 4D mask).
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def check_sequence_parallel(cfg: RunConfig, config: ShardGPTConfig | None, sp: int, world: int, held_by: str,
                            env: Environment) -> None:  # fmt: skip
    """Refuse, before any process group, a sequence-parallel launch that could not train as asked. Each message
    names the setting, its value and the fix. `held_by`: the launch's data-parallel wrapper
    (training/axes/table.py); `env`: the launcher's, with the YAML's parallelism_config block."""
    block = env.block or {}
    cp = int(block.get("cp_size", "1") or 1)
    if cp > 1 and sp > 1 and AXES["sp"].alone:
        raise ValueError(
            f"the accelerate config's parallelism_config sets both sp_size: {sp} and cp_size: {cp}: sequence "
            "parallelism (Ulysses) and context parallelism (ring attention) split the same sequence; keep one"
        )
    if sp == 1:
        return
    if not composes("sp", held_by):
        raise ValueError(
            f"sequence parallelism (sp_size {sp}) needs DeepSpeed, whose engine reduces the gradients over the "
            "sequence-parallel ranks (accelerate's sp_backend: deepspeed): launch with a ZeRO config "
            "(accelerate_configs/zero1.yaml ... zero3.yaml with a parallelism_config block, or --deepspeed "
            "ds_configs/zero3.json with sequence_parallel_size), or remove the sequence-parallel setting"
        )
    backend = block.get("sp_backend", "deepspeed")
    if backend != "deepspeed":
        raise ValueError(f"parallelism_config_sp_backend: {backend}; the only backend is deepspeed: set it so")
    if cfg.pipeline_parallel_degree > 1 and AXES["sp"].alone:
        raise ValueError(
            f"sequence parallelism (sp_size {sp}) with --pipeline_parallel_degree {cfg.pipeline_parallel_degree}: "
            "a pipeline does not run under DeepSpeed here; choose one of them"
        )
    Mesh.of_world(world, sp=sp)  # refuses an sp_size that does not divide the ranks
    shard = block.get("dp_shard_size")
    replicate = int(block.get("dp_replicate_size", "1") or 1)
    if block and shard is not None and int(shard) * replicate * sp != world:
        raise ValueError(
            f"the accelerate config's parallelism_config_dp_shard_size is {shard}: with sp_size {sp} on {world} "
            f"ranks it must be {world // sp // replicate} (dp_shard_size x dp_replicate_size x sp_size = ranks)"
        )
    attention = block.get("sp_attn_implementation", "None")
    if attention not in ("None", *ULYSSES_ATTENTION):
        raise ValueError(
            f"parallelism_config_sp_attn_implementation: {attention}; Ulysses wraps {', '.join(ULYSSES_ATTENTION)} "
            "(eager attention builds a full mask over the sequence): set sdpa, or remove the key"
        )
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % sp:
        raise ValueError(
            f"sp_size {sp} does not divide the model's {heads} attention heads (each rank attends with heads / sp "
            f"heads): choose an sp_size that divides {heads}"
        )
    if kv % sp and sp % kv:
        raise ValueError(
            f"the model's {kv} key-value heads are neither a multiple nor a divisor of sp_size {sp} (DeepSpeed "
            "Ulysses splits or replicates them): choose such an sp_size"
        )
    if cfg.block_size % sp:
        raise ValueError(
            f"--block_size {cfg.block_size} is not divisible by sp_size {sp}: each rank holds block_size / sp "
            f"positions; pass a multiple of {sp}"
        )


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


def gradient_divisor(mesh: Mesh, zero_stage: int, zero: dict) -> int:
    """What the gradient reduction divides each summed gradient by, on the launch's `mesh`: with sp (Ulysses) or cp
    (ring context) ranks a sequence, dp groups of them, the data-parallel count without either. DeepSpeed 0.19.8 under
    Ulysses (`zero` the config's zero_optimization): ZeRO-3's reduce-scatter (`reduce_scatter`, true by default) by
    every rank of the sequence-and-data-parallel group (runtime/comm/coalesced_collectives.py:
    `reduce_scatter_coalesced` pre-divides by the group's size); ZeRO-1 and 2, and ZeRO-3 without reduce_scatter,
    by that count over sp (runtime/zero/stage_1_and_2.py `average_tensor`, stage3.py
    `__avg_scatter_contiguous_grads`: `world_size / sequence_parallel_size`). FSDP2 under ring context parallelism
    reduce-scatters over accelerate's flattened dp_shard x cp mesh, averaging over all of its ranks."""
    if mesh.cp > 1:
        return mesh.dp * mesh.cp
    if mesh.sp > 1 and zero_stage == 3 and zero.get("reduce_scatter", True):
        return mesh.dp * mesh.sp
    return mesh.dp


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


def accelerator_parallelism_config(mesh: Mesh, env: Environment):
    """The accelerate `ParallelismConfig` that turns Ulysses on in `prepare` for a launch whose degree came from
    the DeepSpeed JSON (no accelerate YAML block): the launch's mesh, sp over consecutive ranks, the rest
    data-parallel. None where the YAML's own block is in force (accelerate reads it) or without sequence
    parallelism."""
    if mesh.sp == 1 or env.block is not None:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(
        dp_shard_size=mesh.dp, sp_size=mesh.sp, sp_backend="deepspeed",
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    )  # fmt: skip
