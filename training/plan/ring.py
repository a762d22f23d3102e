"""The ring cost model of a collective (nccl-tests' PERFORMANCE.md): its time on the ring from its bytes, its group's
size and the links' bandwidth, NCCL's latency per call, the calls a strategy makes per step, and the pipeline
bubble's share of a step.
"""

from __future__ import annotations

import math

from training.plan.communication import ModelShape

ACTIVATION_BYTES = 2  # bf16 activations

# Each collective call also pays NCCL's latency on its ring (src/graph/tuning.cc, Simple protocol, the figures
# torch/_inductor/comm_analysis.py ports): a base per launch, and a hop per ring step, NVLink's inside a node and the
# network's between nodes (n - 1 steps for an all-gather or a reduce-scatter, nodes - 1 of them between nodes; twice
# both for an all-reduce). Calls per step: DDP's buckets (bucket_cap_mb 25), DeepSpeed's (the shipped JSONs' 5e8
# element buckets), FSDP's units (a decoder layer each, and the root), ZeRO-3's modules (every linear layer's
# parameters are fetched on their own: seven a decoder layer here).
NCCL_BASE_LATENCY = 8.4e-6
NCCL_NVLINK_HOP = 3.4e-6
NCCL_NET_HOP = 14e-6
DDP_BUCKET_BYTES = 25 * 2**20
DEEPSPEED_BUCKET_ELEMENTS = 5e8
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
# DeepSpeed 0.3's ZeRO-3 (what Megatron-LM 2021's Table 2 ran: training/plan/step_layout.STACKS) made a call of its own
# for every parameter it gathered and every gradient it reduce-scattered (deepspeed/runtime/zero/
# partition_parameters.py at v0.3.14: `_allgather_param`, `_reduce_scatter_gradient`, one per tensor): a Megatron GPT
# layer's twelve tensors (the weight and bias of its two layer norms, of the fused query-key-value projection, of
# attention's output projection and of the MLP's two linear layers) and, outside the layers, the word and position
# embeddings and the final layer norm's weight and bias.
GPT_TENSORS_PER_LAYER = 12
GPT_TENSORS_OUTSIDE = 4


def all_reduce_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: S/B x 2(n-1)/n."""
    return nbytes / bandwidth * 2 * (n - 1) / n if n > 1 else 0.0


def gather_seconds(nbytes: float, n: int, bandwidth: float) -> float:
    """Ring reduce-scatter, all-gather or all-to-all of `nbytes` (the whole tensor) over `n` ranks: S/B x (n-1)/n."""
    return nbytes / bandwidth * (n - 1) / n if n > 1 else 0.0


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float) -> float:
    """A collective of `kind` (training/loop/comms.KINDS) on the ring."""
    if kind == "all_reduce":
        return all_reduce_seconds(nbytes, n, bandwidth)
    return gather_seconds(nbytes, n, bandwidth)


def ring_latency(kind: str, n: int, nodes: int) -> float:
    """NCCL's latency for one call of `kind` on a ring of `n` ranks over `nodes` nodes (the module's constants)."""
    if n < 2:
        return 0.0
    twice = 2 if kind == "all_reduce" else 1
    steps, between = twice * (n - 1), twice * (nodes - 1)
    return NCCL_BASE_LATENCY + (steps - between) * NCCL_NVLINK_HOP + between * NCCL_NET_HOP


def calls_per_step(family: str, kind: str, nbytes: float, shape: ModelShape, layers: int,
                   per_tensor: bool = False) -> int:  # fmt: skip
    """Calls of a data-parallel collective of `kind` carrying `nbytes` a step (one micro batch's, where it repeats);
    `per_tensor`: ZeRO-3 as DeepSpeed 0.3 ran it, a call per GPT tensor (GPT_TENSORS_PER_LAYER)."""
    passes = max(1, round(nbytes / (ACTIVATION_BYTES * shape.parameters)))  # forward, backward re-gathers
    if per_tensor and family == "zero3":
        passes = passes if kind == "all_gather" else 1
        return passes * (layers * GPT_TENSORS_PER_LAYER + GPT_TENSORS_OUTSIDE)
    if family == "ddp":
        return math.ceil(nbytes / DDP_BUCKET_BYTES)
    if family in ("fsdp", "zero3") and kind == "all_gather":
        return passes * layers * (LINEARS_PER_LAYER if family == "zero3" else 1) + 1  # and the root
    if family == "fsdp":
        return layers + 1
    return math.ceil(shape.parameters / DEEPSPEED_BUCKET_ELEMENTS)


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a GPipe or 1F1B step its pipeline idles, (P - 1) / (M + P - 1); interleaving v stages on each
    rank divides the idle time by v: (P - 1) / (v M + P - 1) (Narayanan et al. 2021, section 2.2.2)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)
