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


# ---------------------------------------------------------------------------------------------- closed forms


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts, in elements, that decide what a data-parallel step moves."""

    parameters: int
    """Psi: every parameter element once (a tied embedding and head counted once)."""
    outside_layers: int
    """Elements outside the decoder layers (the embedding, the final norm, an untied head): FSDP2's root group."""
    tied_embedding: int = 0
    """The embedding's elements when the head shares it (used twice in each forward), else 0."""
    persistent: int = 0
    """Elements of parameters at most ZeRO-3's `stage3_param_persistence_threshold`, kept whole on every rank."""
    norms: int = 0
    """Elements of the RMSNorm weights, which tensor parallelism leaves whole on every rank."""

    @classmethod
    def of(cls, config, persistence_threshold: int = 0) -> ModelShape:
        """The shape of a ShardGPTConfig's model (a Llama: no biases, two RMSNorms per layer and a final one)."""
        h, layers = config.hidden_size, config.num_hidden_layers
        embedding = config.vocab_size * h
        head = 0 if config.tie_word_embeddings else embedding
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        attention = 2 * h * h + 2 * h * config.num_key_value_heads * head_dim  # q and o; k and v
        layer = attention + 3 * h * config.intermediate_size + 2 * h
        sizes = [embedding, head, h] + [h, h] * layers  # the norms: each layer's two and the final one
        persistent = sum(n for n in sizes if 0 < n <= persistence_threshold)
        return cls(layers * layer + embedding + head + h, embedding + head + h,
                   embedding if config.tie_word_embeddings else 0, persistent, (2 * layers + 1) * h)  # fmt: skip


def expected_payloads(strategy, shape: ModelShape, bytes_per_element: int = 4,
                      micro_batches: int = 1) -> dict[str, int] | None:  # fmt: skip
    """The payload bytes of each kind of collective that carries parameters or gradients, per rank and step of
    `micro_batches` micro batches, for a data-parallel strategy with the settings in force (`bytes_per_element`: the
    communication dtype's), measured to the byte on 2 and 4 CPU ranks. The loss's and the gradient norm's
    all-reduces (a few bytes) are not in it. None where no closed form is known here: tensor or pipeline parallelism,
    FSDP1 or ZeRO-3 with live-parameter limits below the model over several micro batches, and ZeRO-3 with limits
    between 0 and the model.

    - DDP: one all-reduce of the gradients, Psi, once a step (accelerate's `no_sync` skips the others).
    - FSDP2 (and FSDP1), FULL_SHARD: each decoder layer all-gathered in the forward and again in the backward, the
      root group (the parameters outside the layers) once, since it stays gathered after the forward (accelerate
      sets that for FSDP2; FSDP1's root unit does it by default): 2 Psi minus the root's, every micro batch; the
      gradients reduce-scattered, Psi, once a step (accelerate turns FSDP2's gradient sync off until the last).
      SHARD_GRAD_OP: all-gathers of Psi every micro batch, reduce-scatters of Psi. Hybrid (replicas > 1): the same
      within a replica's shard group, and each rank's reduce-scattered shard all-reduced across the replicas, Psi /
      shard_size (each weight's rows dividing by the shard count; FSDP2 pads the rest).
    - ZeRO-1/2: DeepSpeed's `use_multi_rank_bucket_allreduce` (default true) reduces each gradient bucket with an
      all-reduce, where the paper has a reduce-scatter; false: a reduce to each partition's owner. ZeRO-1 reduces
      once a step, ZeRO-2 every micro batch. Then an all-gather of the updated partitions, Psi.
    - ZeRO-3: the gradients reduce-scattered, Psi, every micro batch. With `stage3_max_live_parameters` and
      `stage3_max_reuse_distance` at least Psi, every gathered parameter stays until the micro batch ends: all-gathers
      of Psi less the persistent parameters each micro batch, and the persistent ones (whole on every rank) once a
      step. At 0 (one micro batch), each module's parameters are released after use and gathered again:
      in the forward and the backward, the tied embedding once more in each (it is the head too), and the
      persistent parameters never again.
    """
    psi, ds = shape.parameters, (strategy.deepspeed or {}).get("zero_optimization", {})
    m = micro_batches
    if strategy.tp_size > 1 or strategy.pp_size > 1 or strategy.sp_size > 1:
        return None
    if strategy.family == "ddp":
        elements = {"all_reduce": psi}
    elif strategy.family == "fsdp" and strategy.fsdp_sharding != "NO_SHARD":  # FSDP1 too: its root unit is kept
        if m > 1 and strategy.fsdp_version == 1:
            return None
        kept = strategy.fsdp_sharding == "SHARD_GRAD_OP"
        elements = {"all_gather": m * (psi if kept else 2 * psi - shape.outside_layers), "reduce_scatter": psi}
        if strategy.replicas > 1:
            elements["all_reduce"] = psi // strategy.shard_size
    elif strategy.family == "deepspeed" and strategy.zero_stage in (1, 2):
        reduction = "all_reduce" if ds.get("use_multi_rank_bucket_allreduce", True) else "reduce"
        elements = {reduction: (m if strategy.zero_stage == 2 else 1) * psi, "all_gather": psi}
    elif strategy.family == "deepspeed" and strategy.zero_stage == 3:
        live, reuse = (int(ds.get(k, 1e9)) for k in ("stage3_max_live_parameters", "stage3_max_reuse_distance"))
        if min(live, reuse) >= psi:
            gathered = m * (psi - shape.persistent) + shape.persistent
        elif live == reuse == 0 and m == 1:
            gathered = 2 * (psi - shape.persistent) + shape.persistent + 2 * shape.tied_embedding
        else:
            return None
        elements = {"all_gather": gathered, "reduce_scatter": m * psi}
    else:
        return None
    return {kind: n * bytes_per_element for kind, n in elements.items()}


def autotp_payloads(strategy, shape: ModelShape, split_modules: dict[str, int], micro_tokens: int, micro_batches: int,
                    hidden_size: int, bytes_per_element: int = 4) -> dict[str, int]:  # fmt: skip
    """The payload bytes per rank and step under DeepSpeed AutoTP with ZeRO-1 (ds_configs/autotp.json), measured to the
    byte on 2 and 4 CPU ranks with one micro batch per step. `split_modules`: the count of each style the model's plan
    split (strategy.json's `tensor_parallel.split_modules`); `micro_tokens`: a micro batch's sequences x block; fp32
    activations.

    - Each micro batch, in the forward, the partial outputs of every row-split module (o_proj, down_proj) and of the
      vocabulary-split embedding are all-reduced; in the backward, the partial input gradients of every column-split
      module (q, k, v, gate, up, the head). Each is micro_tokens x hidden.
    - The loss over the vocabulary-split logits (DeepSpeed's vocab-parallel cross entropy): 3 all-reduces of one
      value per token (the maximum, the target's logit, the sum of exponentials).
    - ZeRO-1 over the data-parallel ranks, on this rank's slice (1/tp of the split weights, the norms whole): an
      all-reduce of its gradients (`use_multi_rank_bucket_allreduce`, even over a single data-parallel rank) and, with
      more than one, an all-gather of the updated partitions.
    """
    activations = split_modules.get("rowwise", 0) + split_modules.get("embedding_rowwise", 0)
    activations += split_modules.get("colwise", 0) + split_modules.get("colwise_gather_output", 0)
    per_micro = activations * micro_tokens * hidden_size + 3 * micro_tokens
    local = (shape.parameters - shape.norms) // strategy.tp_size + shape.norms
    payloads = {"all_reduce": (micro_batches * per_micro + local) * bytes_per_element}
    if strategy.data_parallel_size > 1:
        payloads["all_gather"] = local * bytes_per_element
    return payloads


def ulysses_payloads(strategy, shape: ModelShape, config, micro_tokens: int, micro_batches: int,
                     bytes_per_element: int = 4) -> dict[str, int] | None:  # fmt: skip
    """The payload bytes per rank and step under DeepSpeed's Ulysses sequence parallelism (training/sequence.py),
    measured to the byte on 2 and 4 CPU ranks; None where the ZeRO stage has no closed form. `config`: the model's
    ShardGPTConfig; `micro_tokens`: a micro batch's sequences x block (whole sequences; each rank holds 1/sp of them).

    - Each micro batch and decoder layer, forward and backward: an all-to-all of this rank's q, k, v before the
      attention and one of its output after it (q and the output hidden wide, k and v key-value heads x head_dim),
      each over micro_tokens / sp positions; and, in the forward, an all-gather of the position ids (int64).
    - The ZeRO stage's own traffic over every rank, as without sequence parallelism (`expected_payloads`).
    """
    base = expected_payloads(strategy.with_degrees(sp=1), shape, bytes_per_element, micro_batches)
    if base is None:
        return None
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    local = micro_tokens // strategy.sp_size  # positions this rank holds
    exchanged = 2 * layers * local * (2 * h + 2 * config.num_key_value_heads * head_dim)  # forward and backward
    payloads = dict(base)
    payloads["all_to_all"] = micro_batches * exchanged * bytes_per_element
    payloads["all_gather"] = payloads.get("all_gather", 0) + micro_batches * layers * micro_tokens * 8
    return payloads


def step_payloads(strategy, shape: ModelShape, config, micro_tokens: int, micro_batches: int,
                  split_modules: dict[str, int] | None = None,
                  bytes_per_element: int = 4) -> dict[str, int] | None:  # fmt: skip
    """The closed form for any launch the training script runs: AutoTP's (`split_modules`: the count of each style the
    model's plan splits), Ulysses', or the data-parallel strategy's; None where there is none."""
    if strategy.tp_size > 1:
        hidden = config.hidden_size
        return autotp_payloads(strategy, shape, split_modules, micro_tokens, micro_batches, hidden, bytes_per_element)
    if strategy.sp_size > 1:
        return ulysses_payloads(strategy, shape, config, micro_tokens, micro_batches, bytes_per_element)
    return expected_payloads(strategy, shape, bytes_per_element, micro_batches)


def paper_volume(strategy, psi: int, bytes_per_element: int = 4) -> int | None:
    """The ZeRO paper's volume per rank and step (section 7) for `strategy`'s data-parallel sharding, in bytes:
    2 Psi for DDP, ZeRO-1 and ZeRO-2 (FSDP's SHARD_GRAD_OP), 3 Psi for ZeRO-3 (FSDP's FULL_SHARD), offloaded or not.
    None where the paper has no figure (tensor or pipeline parallelism, hybrid sharding)."""
    if strategy.tp_size > 1 or strategy.pp_size > 1 or strategy.sp_size > 1 or strategy.replicas > 1:
        return None
    if strategy.family == "ddp" or (strategy.family == "deepspeed" and strategy.zero_stage in (1, 2)):
        units = 2
    elif strategy.family == "deepspeed" and strategy.zero_stage == 3:
        units = 3
    elif strategy.family == "fsdp" and strategy.fsdp_sharding != "NO_SHARD":
        units = 3 if strategy.fsdp_sharding == "FULL_SHARD" else 2
    else:
        return None
    return units * psi * bytes_per_element
