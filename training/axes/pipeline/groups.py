"""The process groups of a mesh's axes, for the runtimes that build their own (the pipeline's); accelerate and
DeepSpeed build theirs from the same degrees."""

from __future__ import annotations

import torch.distributed as dist


def new_groups(rank: int, groups: list[list[int]]) -> dist.ProcessGroup | None:
    """`rank`'s process group among `groups` (each a list of ranks; `Mesh.groups` gives an axis's), or None where
    `rank` is in none of them. Collective: every rank creates every group, in the order given, as `dist.new_group`
    requires."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)  # collective
        if rank in ranks:
            mine = group
    return mine
