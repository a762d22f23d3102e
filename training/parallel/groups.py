"""The process groups of a mesh's axes, for the runtimes that build their own (the pipeline's); accelerate and
DeepSpeed build theirs from the same degrees."""

from __future__ import annotations

import torch.distributed as dist

from training.parallel.mesh import Mesh


def new_groups(mesh: Mesh, rank: int, *axes: str) -> dist.ProcessGroup:
    """`rank`'s process group along `axes` (several: flattened). Collective: every rank creates every group of the
    axes, in the mesh's order, as `dist.new_group` requires."""
    mine = None
    for ranks in mesh.groups(*axes):
        group = dist.new_group(ranks)  # collective
        if rank in ranks:
            mine = group
    return mine
