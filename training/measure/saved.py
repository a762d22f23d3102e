"""The bytes a rank holds for its backward, live: what its forwards saved (autograd's saved tensors) and what it
keeps besides (a pipeline stage's outputs), counted as they are taken and as they are released, with their peak.

Each storage counts once, whole, while anything holds it (a saved view keeps its whole storage alive), and the
parameters' storages not at all: the planner's activation formulas count the same (tests/recipes/test_plan_memory.py).
`torch.autograd.graph.saved_tensors_hooks` sees every tensor a forward saves, the model's own autograd Functions'
included (a DTensor counted by its local shard); the tensor is handed back to the backward unchanged, and its count
released when autograd drops it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what it holds in memory), any other tensor itself; a collective's output that
    torch has not waited for yet (its functional collectives' `AsyncCollectiveTensor`) once it has arrived."""
    from torch.distributed.tensor import DTensor

    from training.compat import arrived

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            tensor = tensor.to_local()
    return arrived(tensor)


class _Saved:
    """A saved tensor as autograd keeps it between forward and backward: freed with the graph's node."""

    __slots__ = ("tensor", "counter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, counter: HeldBytes):
        self.tensor, self.counter = tensor, counter
        self.key = counter.hold(tensor)

    def __del__(self):
        self.counter.release(self.key)


class HeldBytes:
    """Live bytes held for the backward (`now`) and their most since the last `reset` (`peak`)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self.skip = {_local(p).untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, list[int]] = {}  # storage address -> [holders, bytes]
        self.now = self.peak = 0

    def hold(self, tensor: torch.Tensor) -> int | None:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return None
        entry = self.storages.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return key

    def release(self, key: int | None) -> None:
        if key is None:
            return
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.storages[key]

    def keep_until_freed(self, tensor: torch.Tensor) -> None:
        """Count `tensor` until Python frees it (a pipeline stage's output, which the stage keeps for its backward)."""
        weakref.finalize(tensor, self.release, self.hold(tensor))

    def reset(self) -> None:
        self.peak = self.now

    def saving(self):
        """The context under which forwards' saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        # Detached: an op's saved output would otherwise keep its own node alive through the holder, a cycle that
        # only the backward breaks (a forward with none, as a schedule's shape inference, would never be freed).
        return _Saved(tensor.detach(), self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor


class PerOpPolicy:
    """torch's selective activation checkpointing with a per-op policy as torchtitan's (its `_save_list`): each
    checkpointed region keeps the outputs of attention, of the reduce-scatters and of every other matrix multiply of
    its forward (the first, third, ...), and recomputes everything else in the backward. `wrap` puts each module of
    a list under it; `kept` is the bytes of the outputs its forwards kept (a DTensor's by its local shard, each
    storage once), counted as the policy keeps them (its view of an op's output, `ctx.op_output`, is torch 2.13's).
    What the regions' checkpoints keep themselves (their inputs) autograd's hooks see: `HeldBytes.saving`."""

    def __init__(self):
        from training.compat import selective_kept_ops

        self.storages: dict[int, int] = {}
        self.saved = selective_kept_ops()

    def context(self):
        from collections import defaultdict

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        from training.compat import tensor_leaves

        count: dict[bool, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            if func == torch.ops.aten.mm.default:
                count[ctx.is_recompute] += 1
                keep = count[ctx.is_recompute] % 2 == 1
            else:
                keep = func in self.saved
            if keep and not ctx.is_recompute:
                for out in tensor_leaves(ctx.op_output):
                    if isinstance(out, torch.Tensor):
                        storage = _local(out).untyped_storage()
                        self.storages[storage.data_ptr()] = storage.nbytes()
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    @property
    def kept(self) -> int:
        return sum(self.storages.values())

    def wrap(self, modules: torch.nn.ModuleList) -> torch.nn.ModuleList:
        return torch.nn.ModuleList(_Checkpointed(module, self.context) for module in modules)


class _Checkpointed(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, context):
        super().__init__()
        self.module, self.context = module, context

    def forward(self, hidden, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.module, hidden, use_reentrant=False, context_fn=self.context, **kwargs)
