"""A measured case on a few CPU ranks: `world` spawned processes (gloo) that each run `target(rank, world, *args)`
and put one result on a queue, collected by rank. Used by the activation measurements of Ulysses
(training/measure/ulysses.py) and tensor parallelism (training/measure/tensor_memory.py)."""

from __future__ import annotations

import os
import socket

import torch.multiprocessing as mp

from model import ShardGPTConfig


def config_for(preset: str, block: int) -> ShardGPTConfig:
    """The preset, with positions for `block` tokens."""
    base = ShardGPTConfig.from_preset(preset)
    return ShardGPTConfig.from_preset(preset, max_position_embeddings=max(block, base.max_position_embeddings))


def join(rank: int, world: int, port: int) -> None:
    """A spawned rank's environment for torch.distributed: the case's port on this host, one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")  # fmt: skip


def run_ranks(target, world: int, *args, what: str = "case") -> dict:
    """Each rank's result of `target(rank, world, port, queue, *args)`, which puts (rank, result) on `queue`; a rank
    that exits with an error fails the case (`what` names it)."""
    with socket.socket() as s:  # a free port for this case's process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode:
            raise RuntimeError(f"{what}: a rank exited with {p.exitcode}")
    return results
