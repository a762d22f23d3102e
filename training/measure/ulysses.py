"""The bytes a rank holds for its backward under Ulysses sequence parallelism, measured against the planner.

Each case runs `sp` processes (gloo) that build the model, register DeepSpeed's Ulysses attention as the training
script's `prepare` does (`UlyssesSPAttentionHF.register_with_transformers`), and take one training forward of the
same micro batch, each on its slice of the positions (the loader's: `data.loader`), counting the tensors autograd
saves (training/measure/saved.py) until the backward. A rank's share of every per-token activation is 1/sp; the
attention's tensors after the all-to-all hold all positions of heads / sp heads, the same bytes. sp = 1 is one
process with the whole sequence. Collectives: the all-to-alls of each attention layer and the position gather.
"""

from __future__ import annotations

import torch

from data import rank_micro_batches
from model import ShardGPTForCausalLM
from training.measure.saved import HeldBytes
from training.measure.spawned import config_for, join, run_ranks
from training.plan.memory.activations import activation_bytes, saved_loss_bytes


def _rank(rank: int, sp: int, port: int, queue, preset: str, micro: int, block: int, dtype: str) -> None:
    join(rank, sp, port)
    config = config_for(preset, block)
    torch.manual_seed(0)  # the same weights and batch on every rank
    net = ShardGPTForCausalLM(config).to(getattr(torch, dtype)).train()
    if sp > 1:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed("gloo")  # collective
        UlyssesSPAttentionHF.register_with_transformers(net, "sdpa", sp, micro, seq_length_is_variable=True)
    tokens = torch.randint(0, config.vocab_size, (micro, block + 1))
    (batch,) = rank_micro_batches(tokens[:, :-1], tokens[:, 1:], micro, 1, 1, 0, (sp, rank))
    counter = HeldBytes(net.parameters())
    with counter.saving():
        loss = net(**batch).loss  # collectives inside: the all-to-alls, the position gather
    held = counter.peak
    loss.backward()  # collectives inside: the all-to-alls' backward
    queue.put((rank, held))
    if sp > 1:
        torch.distributed.destroy_process_group()


def measure(sp: int, preset: str, micro: int, block: int, dtype: str = "float32") -> dict:
    """One case: the most bytes any of the `sp` ranks held for its backward, beside the planner's figure for a rank
    that holds block / sp positions."""
    held = run_ranks(_rank, sp, preset, micro, block, dtype, what=f"sp={sp} block={block}")
    plan = predicted(preset, micro, block, sp, dtype)
    worst = max(held.values())
    return {"sp": sp, "preset": preset, "micro_batch": micro, "block_size": block, "dtype": dtype,
            "held_bytes": worst, "held_per_rank": [held[r] for r in range(sp)], "planned_bytes": plan,
            "error": worst / plan - 1}  # fmt: skip


def predicted(preset: str, micro: int, block: int, sp: int, dtype: str) -> int:
    """The planner's activations plus the loss's saved tensors for a rank's block / sp positions."""
    config, e = config_for(preset, block), torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    seq = block // sp
    return activation_bytes(config, micro, block, e, False, sp=sp) + saved_loss_bytes(config, micro, seq, e)
