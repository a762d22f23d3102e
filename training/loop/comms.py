"""What a training step sends: every collective this rank calls, by kind, counted in calls and bytes.

A `CommCounter` is a torch dispatch mode: every torch.distributed collective, whoever calls it (DDP's reducer from
C++ inside the backward, FSDP2's hooks, DeepSpeed through `deepspeed.comm`, DTensor's functional collectives), is
a `c10d::*` or `_c10d_functional::*` operator that passes through it. It counts each one's tensors and lets it run.
The dispatch mode and the group of an operator are torch internals, kept in training/compat.py (checked on 2.13).

Three numbers per collective, the convention of the ZeRO paper (Rajbhandari et al. 2020, section 7) and of
nccl-tests' PERFORMANCE.md; S is the collective's whole tensor in bytes, n the size of its process group:

- `payload_bytes`: S, the tensor the collective is about, whole: an all-reduce's buffer, an all-gather's output
  (every rank's shard), a reduce-scatter's or an all-to-all's input, a broadcast's or a reduce's buffer; a
  point-to-point's bytes sent plus received.
- `volume_bytes`: the paper's communication volume: 2S for an all-reduce (a reduce-scatter and an all-gather of S),
  S for every other collective, the bytes sent for point-to-point. The paper's "DDP moves 2Psi, ZeRO-3 3Psi" are
  these, in elements of Psi parameters.
- `wire_bytes`: what this rank sends on a ring: volume x (n - 1) / n for a collective, the bytes sent for
  point-to-point. Divided by the link's bandwidth, this is the collective's time on a ring (2S(n-1)/n / B for an
  all-reduce, S(n-1)/n / B for an all-gather or a reduce-scatter).

Barriers are counted in calls (their bytes are zero). Kinds: all_reduce, all_gather, reduce_scatter, all_to_all,
point_to_point, broadcast, reduce, gather, scatter, barrier.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor

from training.compat import TorchDispatchMode, collective_group_size

# What strategy.json's numbers mean, written beside them (the module docstring says it at length).
CONVENTION = (
    "per kind of collective, over one step: calls; payload_bytes, each call's whole tensor S (an all-gather's output, "
    "a reduce-scatter's input; point-to-point: sent plus received); volume_bytes, the ZeRO paper's (2S per all-reduce, "
    "S per other collective, point-to-point: sent); wire_bytes, what this rank sends on a ring of n ranks "
    "(volume x (n - 1) / n; point-to-point: sent)"
)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "point_to_point", "broadcast", "reduce",
         "gather", "scatter", "barrier")  # fmt: skip

# Operator name -> (kind, where the whole tensor S is). "first", "second": that argument's tensors; "first_xn",
# "second_xn": that argument holds one rank's share of S (x the group's size); "sent", "received": point-to-point.
OPERATORS = {
    "c10d::allreduce_": ("all_reduce", "first"),
    "c10d::allreduce_coalesced_": ("all_reduce", "first"),
    "_c10d_functional::all_reduce": ("all_reduce", "first"),
    "_c10d_functional::all_reduce_": ("all_reduce", "first"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "first"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "first"),
    "c10d::_allgather_base_": ("all_gather", "first"),
    "c10d::allgather_": ("all_gather", "first"),
    "c10d::allgather_coalesced_": ("all_gather", "first"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "first_xn"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "first_xn"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "first_xn"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "second"),
    "c10d::reduce_scatter_": ("reduce_scatter", "second"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "first"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "first"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "first"),
    "c10d::alltoall_base_": ("all_to_all", "second"),
    "c10d::alltoall_": ("all_to_all", "second"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "first"),
    # A custom operator that wraps a collective runs it below the mode, unseen: DeepSpeed's Ulysses exchange is one.
    "deepspeed::dim_zero_all_to_all": ("all_to_all", "first"),
    "c10d::send": ("point_to_point", "sent"),
    "_c10d_functional::isend": ("point_to_point", "sent"),
    "c10d::recv_": ("point_to_point", "received"),
    "c10d::recv_any_source_": ("point_to_point", "received"),
    "_c10d_functional::irecv": ("point_to_point", "received"),
    "c10d::broadcast_": ("broadcast", "first"),
    "_c10d_functional::broadcast": ("broadcast", "first"),
    "_c10d_functional::broadcast_": ("broadcast", "first"),
    "c10d::reduce_": ("reduce", "first"),
    "c10d::gather_": ("gather", "second_xn"),  # the output is filled on the root alone
    "c10d::scatter_": ("scatter", "first_xn"),
    "c10d::barrier": ("barrier", "none"),
    "c10d::monitored_barrier_": ("barrier", "none"),
}


@dataclass
class KindCount:
    """One kind of collective over the counted window (conventions: module docstring)."""

    calls: int = 0
    payload_bytes: int = 0
    """Sum of each call's whole tensor S (point-to-point: bytes sent plus received)."""
    volume_bytes: int = 0
    """The ZeRO paper's volume: 2S per all-reduce, S per other collective, bytes sent for point-to-point."""
    wire_bytes: int = 0
    """Bytes this rank sends on a ring: volume x (n - 1) / n per collective of n ranks (rounded down)."""


@dataclass
class Communication:
    """One rank's collectives over a counted window (a training step), by kind; kinds never called are absent."""

    kinds: dict[str, KindCount] = field(default_factory=dict)

    def add(self, kind: str, payload: int, volume: int, wire: int) -> None:
        count = self.kinds.setdefault(kind, KindCount())
        count.calls += 1
        count.payload_bytes += payload
        count.volume_bytes += volume
        count.wire_bytes += wire

    @property
    def volume_bytes(self) -> int:
        return sum(k.volume_bytes for k in self.kinds.values())

    @property
    def wire_bytes(self) -> int:
        return sum(k.wire_bytes for k in self.kinds.values())

    def to_dict(self) -> dict:
        kinds = {k: asdict(self.kinds[k]) for k in KINDS if k in self.kinds}
        return {"kinds": kinds, "volume_bytes": self.volume_bytes, "wire_bytes": self.wire_bytes}


class CommCounter(TorchDispatchMode):
    """Counts every collective called while it is active, on this thread and the autograd engine's (the mode is
    part of the thread-local state the backward runs under).

        with CommCounter() as counter:
            train_step(...)
        counter.record.to_dict()
    """

    def __init__(self):
        super().__init__()
        self.record = Communication()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # A DTensor (FSDP2's parameters, a tensor-parallel plan's) runs first and comes back here with the
            # collectives it lowers to (a norm's all-reduce); a mode would otherwise see the op, not them.
            return NotImplemented
        found = OPERATORS.get(func.name())
        if found is not None:
            self._count(*found, func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, kind: str, side: str, func, args, kwargs) -> None:
        n = collective_group_size(func, args, kwargs)
        if side == "none":
            self.record.add(kind, 0, 0, 0)
            return
        first = tensor_bytes(args[0])
        if side in ("sent", "received"):
            sent = first if side == "sent" else 0
            self.record.add(kind, first, sent, sent)
            return
        payload = first if side.startswith("first") else tensor_bytes(args[1])
        payload *= n if side.endswith("_xn") else 1
        volume = 2 * payload if kind == "all_reduce" else payload
        self.record.add(kind, payload, volume, volume * (n - 1) // n)


def tensor_bytes(value) -> int:
    """The bytes of every tensor in `value` (a tensor, or lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class StepCommunication:
    """The training loop's record of one step's collectives: `measured` is the step counted, `during(step)` counts
    it (and nothing else), `read()` gathers every rank's record once it is done."""

    def __init__(self, first_step: int, max_steps: int, profiled=lambda step: False):
        # The third step of the run, or its last if it has fewer: the first two do one-time work besides the
        # step's own (measured): DDP broadcasts its rebuilt bucket order at the start of the second, ZeRO-3 records
        # the order it fetches parameters in during the first and broadcasts it to check at the end of the second.
        # Not a step --profile records: the counting mode's dispatch would show in its trace and table.
        later = [s for s in range(first_step + 2, max_steps + 1) if not profiled(s)]
        self.measured = later[0] if later else min(first_step + 2, max_steps)
        if profiled(self.measured):
            self.measured = None  # every step the run has left is profiled: nothing is counted
        self.counter: CommCounter | None = None

    @contextlib.contextmanager
    def during(self, step: int) -> Iterator[None]:
        if step != self.measured:
            yield
            return
        with CommCounter() as self.counter:
            yield

    def read(self) -> dict:
        """Every rank's record of the measured step, rank by rank (collective: an all-gather of small objects, not
        counted), with the step and the world size."""
        mine = self.counter.record.to_dict()
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        ranks = [mine] * world
        if world > 1:
            torch.distributed.all_gather_object(ranks, mine)  # collective
        return {"step": self.measured, "world_size": world, "convention": CONVENTION, "per_rank": ranks}
