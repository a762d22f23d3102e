"""Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): each sequence split over `sp` ranks.

Each rank of a sequence-parallel group holds block_size / sp consecutive positions of the same sequences (the
loader slices them: `data.ShardedLoader`, `sequence_parallel_size`); its embeddings, norms, MLPs and loss see only
those. Attention needs every position: DeepSpeed's `UlyssesSPAttentionHF`, registered with transformers' attention
interface, exchanges the q, k and v of the local positions for all positions of heads / sp heads (an all-to-all),
attends, and exchanges back (an all-to-all). The degree comes from the launch's configuration: an accelerate YAML's
`parallelism_config` block (`parallelism_config_sp_size`, `parallelism_config_sp_backend: deepspeed`), or the
DeepSpeed JSON's own `sequence_parallel_size` under the `deepspeed` launcher and torchrun. Either way accelerate's
`prepare` registers the attention and hands DeepSpeed its groups.

The loss, done so that the gradients are the one process's: each rank's loss is the sum of its positions'
cross-entropy over the targets of the whole global batch (the loader's `num_items_in_batch`, as without sequence
parallelism), so the ranks' losses add up to the global batch's mean. DeepSpeed then averages each gradient over
the sequence-and-data-parallel ranks, dividing by a count that depends on the ZeRO stage (`Strategy.gradient_divisor`);
the
step multiplies the loss by that count. The recipe in DeepSpeed's tutorial, accelerate's docs and the HF Trainer
(every rank computes the sequence's whole loss from the gathered per-rank losses) makes each rank's gradient sp
times its share: right where DeepSpeed divides by the world (ZeRO-3's reduce-scatter) and sp times too large where it
divides by world / sp (ZeRO-1 and 2).

Imported only by a launch whose sequence-parallel degree is above 1: its launch checks, and what it reads back as in
force. The loss divisor is the strategy's (`Strategy.gradient_divisor`); the parallelism config that turns it on
where the JSON gives the degree is the ZeRO family's (training/core/zero.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import torch

from training.axes.table import AXES, composes
from training.mesh import Mesh

if TYPE_CHECKING:
    from model import ShardGPTConfig
    from training.config import RunConfig
    from training.environment import Environment
    from training.strategy import Strategy

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


def verify_ulysses(engine, unwrapped: torch.nn.Module, strategy: Strategy,
                   refuse: Callable[[str], NoReturn]) -> dict:  # fmt: skip
    """Ulysses in force as asked: the engine's sequence-parallel size, this rank's place in DeepSpeed's groups (the
    loader's slice and shard), and transformers' attention for the model's implementation replaced by DeepSpeed's
    all-to-all wrapper (without it each rank would attend within its own slice only)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = strategy.sp_size
    if engine.sequence_parallel_size != sp:
        refuse(f"the engine splits sequences over {engine.sequence_parallel_size} ranks")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups

    rank = torch.distributed.get_rank()
    place = (groups.get_sequence_parallel_rank(), groups.get_sequence_data_parallel_world_size() // sp)
    if place != (strategy.sequence_parallel_rank(rank), strategy.data_parallel_size):
        refuse(f"rank {rank} holds slice {place[0]} of the sequences among {place[1]} data-parallel groups")
    implementation = unwrapped.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if getattr(attention, "__name__", "") != "uattn_wrapper":
        refuse(f"transformers' {implementation} attention is not DeepSpeed's Ulysses wrapper")
    return {"size": sp, "data_parallel_size": strategy.data_parallel_size, "attention": implementation}
