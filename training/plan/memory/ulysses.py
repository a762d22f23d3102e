"""The bytes a rank holds for its backward under Ulysses sequence parallelism, measured against the planner.

Each case runs `sp` processes (gloo) that build the model, register DeepSpeed's Ulysses attention as the training
script's `prepare` does (`UlyssesSPAttentionHF.register_with_transformers`), and take one training forward of the
same micro batch, each on its slice of the positions (the loader's: `data.loader`), counting the tensors autograd
saves (training/plan/memory/saved.py) until the backward. A rank's share of every per-token activation is 1/sp; the
attention's tensors after the all-to-all hold all positions of heads / sp heads, the same bytes. sp = 1 is one
process with the whole sequence. Collectives: the all-to-alls of each attention layer and the position gather.
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from data.loader import _shard
from model import ShardGPTConfig, ShardGPTForCausalLM
from training.plan.memory.activations import activation_bytes, saved_loss_bytes
from training.plan.memory.saved import HeldBytes


def _rank(rank: int, sp: int, port: int, preset: str, micro: int, block: int, dtype: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(sp), OMP_NUM_THREADS="1")  # fmt: skip
    config = config_for(preset, block)
    torch.manual_seed(0)  # the same weights and batch on every rank
    net = ShardGPTForCausalLM(config).to(getattr(torch, dtype)).train()
    if sp > 1:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed("gloo")  # collective
        UlyssesSPAttentionHF.register_with_transformers(net, "sdpa", sp, micro, seq_length_is_variable=True)
    tokens = torch.randint(0, config.vocab_size, (micro, block + 1))
    (batch,) = _shard(tokens[:, :-1], tokens[:, 1:], micro, 1, 1, 0, (sp, rank))
    counter = HeldBytes(net.parameters())
    with counter.saving():
        loss = net(**batch).loss  # collectives inside: the all-to-alls, the position gather
    held = counter.peak
    loss.backward()  # collectives inside: the all-to-alls' backward
    queue.put((rank, held))
    if sp > 1:
        torch.distributed.destroy_process_group()


def config_for(preset: str, block: int) -> ShardGPTConfig:
    """The preset, with positions for `block` tokens."""
    base = ShardGPTConfig.from_preset(preset)
    return ShardGPTConfig.from_preset(preset, max_position_embeddings=max(block, base.max_position_embeddings))


def measure(sp: int, preset: str, micro: int, block: int, dtype: str = "float32") -> dict:
    """One case: the most bytes any of the `sp` ranks held for its backward, beside the planner's figure for a rank
    that holds block / sp positions."""
    import socket

    with socket.socket() as s:  # a free port for this case's process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, sp, port, preset, micro, block, dtype, queue)) for r in range(sp)]
    for p in procs:
        p.start()
    held = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode:
            raise RuntimeError(f"sp={sp} block={block}: a rank exited with {p.exitcode}")
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
