"""The global gradient norm, summed in float64 under every strategy, and clipping by it.

torch's float32 norm kernel on CPU (`linalg.vector_norm`) adds the squares one after another, not in a cascade
(pytorch issues 151761 and 169237): on a tied embedding's gradient, most of whose rows hold only the head's tiny
gradient, it reads about 2e-4 low, and FSDP2, which norms two half shards, about half as low. DeepSpeed sums its norm
in float64 (`get_norm_dtype`, deepspeed/runtime/zero/stage_1_and_2.py) and gets the true value. Every other engine
here (one process, DDP, FSDP1 and FSDP2, pipelines, the HF Trainer's non-DeepSpeed path) norms with `grad_norm`
below, so that every strategy logs and clips by the same number, to float64's precision.

Each rank sums the squares of the gradient elements it holds, in float64, chunk by chunk (a float64 copy of a chunk,
never of a whole gradient: an embedding of 128K x 4096 would need 4 GiB for one); then the sums are added over the
ranks that hold different elements: a DTensor's sharded mesh dimensions (FSDP2's shards, tensor-parallel slices),
FSDP1's flat-parameter shards, a pipeline's stages. A dimension a gradient is replicated over is counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

CHUNK = 1 << 24  # elements a float64 copy holds at once: 128 MiB


def local_squares(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of `grad`'s elements on this rank, in float64 (a 0-dim tensor on its device)."""
    flat = grad.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for chunk in flat.split(CHUNK):
        total += torch.linalg.vector_norm(chunk, 2, dtype=torch.float64).square()
    return total


def grad_norm(parameters, device: torch.device, sharded_group: dist.ProcessGroup | None = None,
              across: dist.ProcessGroup | None = None) -> torch.Tensor:  # fmt: skip
    """The 2-norm of every gradient of `parameters` taken as one vector, in float64, the same on every rank: a
    0-dim tensor on `device`, where the collectives run (gradients offloaded to the host are summed there first).

    A DTensor gradient's squares are added over the mesh dimensions it is sharded on (collective: one all-reduce
    per mesh and set of sharded dimensions, in the parameters' order, which every rank shares). A plain gradient is
    whole on this rank (one process, DDP) unless `sharded_group` is given: then each rank holds a shard (FSDP1's
    flat parameters) and their squares are added over it (collective). `across`: the ranks that hold other
    parameters (a pipeline's stages), over which the total is added last (collective)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if not isinstance(grad, DTensor):
            total += local_squares(grad).to(device)
    if sharded_group is not None:
        dist.all_reduce(total, group=sharded_group)  # collective: FSDP1's shards
    by_layout: dict[tuple, torch.Tensor] = {}  # (mesh, its sharded dimensions) -> squares held here
    for grad in grads:
        if not isinstance(grad, DTensor):
            continue
        if any(p.is_partial() for p in grad.placements):
            raise RuntimeError(f"a gradient is still partial over its mesh {grad.placements}: it was never reduced")
        # Every dimension a gradient is not replicated over holds different elements: Shard, and FSDP2's strided
        # shard of a tensor-parallel slice (torch 2.13's `_StridedShard`, whose `is_shard()` is False).
        key = (grad.device_mesh, tuple(d for d, p in enumerate(grad.placements) if not p.is_replicate()))
        squares = local_squares(grad.to_local()).to(device)
        by_layout[key] = by_layout[key] + squares if key in by_layout else squares
    for (mesh, dims), squares in by_layout.items():
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))  # collective: the shards along this dimension
        total += squares
    if across is not None:
        dist.all_reduce(total, group=across)  # collective: the other stages' parameters
    return total.sqrt()


def clip_(parameters, max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient of `parameters` by min(1, max_norm / (total + 1e-6)), as torch's `clip_grad_norm_`
    does; nothing when `max_norm` is 0 or less (clipping off, the norm still measured)."""
    if max_norm <= 0:
        return
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in parameters:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
