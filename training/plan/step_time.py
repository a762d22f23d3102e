"""A training step's time for each layout of a cluster, predicted before renting it: compute, exposed communication,
the pipeline bubble and offload transfers, then tokens/s and MFU, ranked over every layout that fits in memory.

A layout is a data-parallel strategy (DDP, FSDP, ZeRO-1/2/3, ZeRO with CPU offload) and explicit degrees whose
product is the GPU count: tensor parallelism (tp, innermost), Ulysses sequence parallelism (sp), pipeline stages (pp,
outermost, GPipe or 1F1B with M micro batches a step), data parallelism (dp); the mesh of
`training/parallel/strategy.py`. Only the layouts recipes/train.py runs are enumerated (`Layout.runs_here`: tensor
parallelism as ZeRO-1 AutoTP, a pipeline under DDP or FSDP2, Ulysses under ZeRO, none combined); `any_layout` adds
Megatron-LM's (tensor parallelism with DDP, tensor x pipeline, ZeRO-1 under a pipeline), which published runs used.

The cost model, per step and GPU:

- compute, on the busiest GPU (`compute_seconds`): the matrix multiplies' FLOPs at the GPU kind's efficiency, plus
  the memory-bound kernels' bytes at its HBM bandwidth (`memory_bound_bytes_per_token`: norms, activations,
  residuals, the loss's softmax, attention scores where they are written out). FLOPs per token are PaLM's 6 N + 12 L h
  T (`training/flops.flops_per_token`), a forward more with activation checkpointing. A GPU runs its stage's layers
  over its replica's tokens, split over tp and sp, except the hidden-wide kernels, which every tensor-parallel rank
  runs whole (REPLICATED_SHARE); under a pipeline the last stage sets the pace: its share of the layers rounded up,
  plus the head and the loss. The efficiency and the memory-bound accesses are calibrated once, on llm-foundry's
  single-node runs (`training/plan/hardware.py`, `published.calibrate`).
- communication, on the ring cost model (nccl-tests' PERFORMANCE.md): an all-reduce of S bytes over n ranks takes
  S/B x 2(n-1)/n, a reduce-scatter, an all-gather or an all-to-all S/B x (n-1)/n, a point-to-point S/B; B is the
  bandwidth per rank of the links the group spans (`Cluster.link_bandwidth`: NVLink inside a node; across nodes the NICs
  of the group's ranks in each node, on which NCCL runs its rings side by side). Each data-parallel call also pays
  NCCL's ring latency (`ring_latency`), which grows with the ranks: what makes per-layer gathers over a thousand ranks
  slow. Volumes: the data-parallel strategies' from `training/plan/communication.expected_payloads` (measured to the
  byte on CPU ranks) on the slice of the model a rank holds, gradients reduced in fp32 (`communication_data_type` of the
  shipped JSONs, DDP's fp32 gradients under autocast; FSDP2 in bf16) and parameters gathered in bf16; Ulysses'
  all-to-alls from `training/plan/communication.ulysses_payloads`; tensor parallelism's four all-reduces of a micro
  batch's activations per layer (two in the forward, two in the backward: Shoeybi et al. 2019, section 3; two more when
  checkpointing recomputes the forward); a pipeline's activations and their gradients, point to point between
  neighbouring stages, split over the tensor-parallel ranks (Narayanan et al. 2021, section 4.1's scatter/gather).
- overlap, as each strategy overlaps (`OVERLAP`): what is hidden is at most the compute it runs beside; the rest is
  exposed. Tensor- and sequence-parallel collectives and pipeline sends sit on the critical path (exposed).
- the bubble of GPipe and 1F1B: (P - 1) / (M + P - 1) of the step, i.e. compute x (P - 1) / M; interleaving v stages
  on each rank divides it by v (Huang et al. 2019; Narayanan et al. 2021, sections 2.2 and 2.2.2).
- offload over PCIe: ZeRO-Offload's gradients down and updated parameters up, a rank's partition each step, and with
  parameters offloaded (ZeRO-3) the partition fetched before every forward and backward. The gradients' copy runs
  beside the backward; the rest is exposed. The CPU's Adam step is not modelled (a weakness: docs/strategies.md).

What is not modelled: the host (Python, kernel launches: what bounds small models, docs/benchmarks.md), a matrix
efficiency that changes with the matrices' sizes (the memory-bound term carries the size trend), NCCL reaching less
than the links' bandwidth, zero-bubble schedules, the CPU's Adam step under offload.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, replace

from model import ShardGPTConfig
from training.flops import flops_per_token
from training.parallel.strategy import Strategy
from training.plan.communication import ModelShape, expected_payloads, ulysses_payloads
from training.plan.hardware import Cluster
from training.plan.memory.activations import activation_bytes, layer_activation_bytes, logits_bytes
from training.plan.memory.layout import repo_json
from training.plan.memory.planner import predict, zero_paper
from training.plan.memory.stages import PIPELINE_SCHEDULES, in_flight

# The data-parallel strategies a layout can use, by `Strategy.name`; those a pipeline or tensor parallelism combines
# with anywhere (Megatron-LM's DDP, DeepSpeed's ZeRO-1 under its pipeline and AutoTP, FSDP2 under torch's pipeline).
DP_STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero2-offload-cpu", "zero3-offload-cpu")
WITH_PIPELINE = ("ddp", "fsdp", "zero1")
WITH_TENSOR_PARALLEL = ("ddp", "zero1")
DEEPSPEED = ("zero1", "zero2", "zero3", "zero2-offload-cpu", "zero3-offload-cpu")
WITH_SEQUENCE_PARALLEL = DEEPSPEED  # Ulysses runs under DeepSpeed (training/parallel/sequence.py)
# Of those, what recipes/train.py runs (training/parallel/strategy.py's checks refuse the rest): a pipeline under one
# process's optimizer, DDP or FSDP2, never a DeepSpeed engine (`check_pipeline_with_deepspeed`); tensor parallelism
# as DeepSpeed AutoTP under ZeRO-1 only, with no pipeline (accelerate's FSDP2 x TP: `check_parallelism_config_tp`);
# Ulysses under DeepSpeed only, without AutoTP (`deepspeed_config.sequence_parallel_size`) or a pipeline
# (`check_sequence_parallel`).
PIPELINE_HERE = ("ddp", "fsdp")
TENSOR_PARALLEL_HERE = ("zero1",)
MICRO_BATCHES = (1, 2, 4, 8, 16)  # micro batch sizes tried, in sequences
# Pipeline schedules tried, with the stages each rank holds: the memory planner's two, and interleaved 1F1B at 2
# stages a rank (training/parallel/pipeline.py's default; more divide the bubble further and send more).
SCHEDULES = tuple((s, 1) for s in PIPELINE_SCHEDULES) + (("Interleaved1F1B", 2),)
ACTIVATION_BYTES = 2  # bf16 activations

# Memory-bound work, counted in reads and writes of 2-byte elements per token over a forward and a backward, at the
# GPU's HBM bandwidth (a forward is a third of them; activation checkpointing runs it twice):
# - ELEMENTWISE_ACCESSES per hidden unit per layer: norms, activation functions, residual adds, rotary, casts; how
#   many depends on which kernels an implementation fuses, so it is calibrated with the matrix units' efficiency on
#   llm-foundry's single-node sweep (training/plan/hardware.py; `published.calibrate` solves both). Under tensor
#   parallelism its REPLICATED_SHARE runs whole on every rank.
# - VOCAB_ACCESSES per vocabulary entry: the loss's logits written (1), read, upcast and log-softmaxed in fp32
#   (1 + 2 + 2 + 2), their gradient in fp32 and cast back (2 + 2 + 1), read by the head's two gradient matmuls (2): 15.
# - Attention written out (`attn_implementation="eager"`, Megatron-LM 2021's kernels) per score (heads x sequence per
#   token and layer): the forward writes the scores (1), softmax reads and writes them (2), the value matmul reads
#   them (1); the backward reads the probabilities (1), writes their gradient (1), softmax's backward reads two and
#   writes one (3), the two matmuls read it (2). Dropout on the probabilities adds a read, a write and a one-byte mask
#   each way (2.5 + 2.5). FlashAttention (sdpa on GPUs) keeps scores on chip: none.
ELEMENTWISE_ACCESSES = 218.8
VOCAB_ACCESSES = 15
# Of ELEMENTWISE_ACCESSES, the share on hidden-wide tensors, which tensor parallelism does not split: a layer's
# forward reads and writes its two norms' (2 x 2) and its two residual adds' (2 x 3) per hidden unit, 10, against the
# MLP activation's 8 on the split inner width (GELU on 4h, or SwiGLU reading 2 x 8h/3 and writing 8h/3).
REPLICATED_SHARE = 10 / 18
SCORE_ACCESSES = {"forward": 4, "backward": 6}
DROPOUT_ACCESSES = {"forward": 2.5, "backward": 2.5}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

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

# Which collectives hide behind which compute, per strategy. "backward": behind the backward of the micro batch it
# belongs to (2/3 of its compute); "forward": behind its forward (1/3); None: exposed.
# - DDP buckets its gradients and all-reduces each bucket as soon as it is ready, during the backward (Li et al.,
#   "PyTorch Distributed", VLDB 2020, section 3.2.3); with accumulation it reduces once, in the last micro batch.
# - ZeRO-1/2 reduce gradients per bucket in the backward where `overlap_comm` is on (the shipped zero2.json; DeepSpeed
#   defaults it off for stages 1 and 2, so zero1.json's reduction waits); the updated partitions are all-gathered
#   after the optimizer step, with nothing to hide behind (ZeRO paper, section 7).
# - ZeRO-3 and FSDP prefetch the next layer's parameters during the current layer's forward and backward and
#   reduce-scatter gradients during the backward (DeepSpeed `overlap_comm`, FSDP's prefetch: Zhao et al. 2023, 3.3).
# - Under a pipeline the data-parallel reduction runs after the flush (training/parallel/pipeline.py; Megatron-LM 2021):
# exposed.
OVERLAP = {
    "ddp": {"all_reduce": "backward"},
    "zero1": {"all_reduce": None, "all_gather": None},
    "zero2": {"all_reduce": "backward", "all_gather": None},
    "zero3": {"all_gather": "forward+backward", "reduce_scatter": "backward"},
    "fsdp": {"all_gather": "forward+backward", "reduce_scatter": "backward"},
}
PER_MICRO_BATCH = {"zero2", "zero3", "fsdp"}  # reduce (and gather) every micro batch, not once per step
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")


@dataclass(frozen=True)
class Layout:
    """One way to lay a step out over the cluster's GPUs."""

    strategy: str  # one of DP_STRATEGIES
    dp: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    schedule: str = "1F1B"  # GPipe, 1F1B or Interleaved1F1B, with pp > 1
    micro_batch: int = 1  # sequences per micro batch per data-parallel rank
    micro_batches: int = 1  # M: micro batches per step (gradient accumulation, or the pipeline's)
    checkpointing: bool = False
    virtual_stages: int = 1  # stages each pipeline rank holds (Interleaved1F1B: 2 or more)

    def stage_layers(self, config: ShardGPTConfig) -> int:
        """Decoder layers on the largest pipeline stage: an equal share, rounded up where they do not split evenly."""
        return math.ceil(config.num_hidden_layers / self.pp)

    @property
    def memory_schedule(self) -> str:
        """The schedule the memory planner plans: an interleaved one as 1F1B's, which holds as many micro batches in
        flight (Narayanan et al. 2021, section 2.2.2) on as many layers a rank."""
        return "1F1B" if self.virtual_stages > 1 else self.schedule

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def typed(self) -> Strategy:
        """The data-parallel strategy, typed (over the data-parallel ranks)."""
        return Strategy.from_name(self.strategy, self.dp)

    @property
    def sharding(self) -> str:
        """How the strategy shards, as OVERLAP keys it: ddp, fsdp or zero1/2/3 (offloaded or not)."""
        typed = self.typed
        return f"zero{typed.zero_stage}" if typed.family == "deepspeed" else typed.family

    @property
    def runs_here(self) -> bool:
        """Whether recipes/train.py runs this layout (the module's PIPELINE_HERE, TENSOR_PARALLEL_HERE); Megatron-LM's
        layouts (tensor parallelism with DDP, tensor x pipeline, ZeRO under a pipeline) do not."""
        if self.pp > 1:
            return self.strategy in PIPELINE_HERE and self.tp == self.sp == 1
        if self.tp > 1:
            return self.strategy in TENSOR_PARALLEL_HERE and self.sp == 1
        return self.sp == 1 or self.strategy in DEEPSPEED

    @property
    def name(self) -> str:
        parts = [self.strategy, f"dp{self.dp}"] + [f"{k}{v}" for k, v in (("tp", self.tp), ("sp", self.sp)) if v > 1]
        if self.pp > 1:
            parts.append(f"pp{self.pp} {self.schedule}")
            parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts.append(f"micro {self.micro_batch} x{self.micro_batches}")
        return " ".join(parts) + (" ckpt" if self.checkpointing else "")


# ---------------------------------------------------------------------------------------------- the ring


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


def calls_per_step(family: str, kind: str, nbytes: float, shape: ModelShape, layers: int) -> int:
    """Calls of a data-parallel collective of `kind` carrying `nbytes` a step (one micro batch's, where it repeats)."""
    if family == "ddp":
        return math.ceil(nbytes / DDP_BUCKET_BYTES)
    if family in ("fsdp", "zero3") and kind == "all_gather":
        passes = max(1, round(nbytes / (ACTIVATION_BYTES * shape.parameters)))  # forward, backward re-gathers
        return passes * layers * (LINEARS_PER_LAYER if family == "zero3" else 1) + 1  # and the root
    if family == "fsdp":
        return layers + 1
    return math.ceil(shape.parameters / DEEPSPEED_BUCKET_ELEMENTS)


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The share of a GPipe or 1F1B step its pipeline idles, (P - 1) / (M + P - 1); interleaving v stages on each
    rank divides the idle time by v: (P - 1) / (v M + P - 1) (Narayanan et al. 2021, section 2.2.2)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


# ---------------------------------------------------------------------------------------------- one layout


def model_flops_per_token(config: ShardGPTConfig, seq_len: int) -> float:
    """PaLM's 6 N + 12 L h T: the model FLOPs MFU counts."""
    return flops_per_token(config, seq_len)


def memory_bound_bytes_per_token(config: ShardGPTConfig, seq_len: int, checkpointing: bool,
                                 attn_implementation: str = "sdpa") -> float:  # fmt: skip
    """HBM bytes per token of a step's memory-bound kernels (ELEMENTWISE_ACCESSES and its neighbours)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        known = ", ".join(ATTN_IMPLEMENTATIONS)
        raise ValueError(f"attn_implementation {attn_implementation!r}: choose one of {known}")
    forwards = 2 if checkpointing else 1  # the recomputed forward
    layer = ELEMENTWISE_ACCESSES * config.hidden_size * (forwards + 2) / 3
    if attn_implementation == "eager":
        dropout = getattr(config, "attention_dropout", 0.0) > 0  # a Llama config.json field; this model has none
        passes = {k: v + (DROPOUT_ACCESSES[k] if dropout else 0) for k, v in SCORE_ACCESSES.items()}
        layer += config.num_attention_heads * seq_len * (forwards * passes["forward"] + passes["backward"])
    return ACTIVATION_BYTES * (config.num_hidden_layers * layer + VOCAB_ACCESSES * config.vocab_size)


def compute_seconds(config: ShardGPTConfig, cluster: Cluster, layout: Layout, seq_len: int,
                    attn_implementation: str = "sdpa") -> float:  # fmt: skip
    """One step's compute on the busiest GPU: the matrix multiplies' FLOPs (PaLM's, one more forward with
    checkpointing) at the efficiency, and the memory-bound kernels' bytes at HBM bandwidth. Each GPU runs its stage's
    layers over its replica's tokens, split over tp (but the hidden-wide kernels, REPLICATED_SHARE) and sp; under a
    pipeline the busiest stage is the last, whose share of the layers is rounded up and which also runs the head and
    the loss (its step sets the pipeline's pace)."""
    tokens = layout.micro_batch * layout.micro_batches * seq_len / layout.sp  # a GPU's, of its replica's batch
    forwards = 2 if layout.checkpointing else 1
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_flops = 6 * vocab * h  # the head's matmul (tied to the embedding or not, it is one)
    layer_flops = (model_flops_per_token(config, seq_len) - head_flops) / layers
    head_bytes = ACTIVATION_BYTES * VOCAB_ACCESSES * vocab
    layer_bytes = (memory_bound_bytes_per_token(config, seq_len, layout.checkpointing, attn_implementation)
                   - head_bytes) / layers  # fmt: skip
    replicated = ACTIVATION_BYTES * REPLICATED_SHARE * ELEMENTWISE_ACCESSES * h * (forwards + 2) / 3
    stage = layout.stage_layers(config)
    flops = (stage * layer_flops + head_flops) * (forwards + 2) / 3 / layout.tp
    memory = stage * (layer_bytes / layout.tp + replicated * (1 - 1 / layout.tp))
    memory += head_bytes / layout.tp
    return tokens * (flops / (cluster.peak_flops * cluster.efficiency) + memory / cluster.hbm_bw)


def rank_shape(config: ShardGPTConfig, layout: Layout) -> ModelShape:
    """The slice of the model one rank's data-parallel traffic carries: the largest pipeline stage's layers (and the
    embedding, the norm and the head, on the first or last stage), 1/tp of every weight but the norms."""
    whole = ModelShape.of(config)
    h, embedding = config.hidden_size, config.vocab_size * config.hidden_size
    params, outside = whole.parameters, whole.outside_layers
    if layout.pp > 1:  # the last stage: its layers, the final norm and the head (a copy of a tied embedding)
        layer = (whole.parameters - whole.outside_layers) // config.num_hidden_layers
        outside = embedding + h
        params = layer * layout.stage_layers(config) + outside
    norms = (2 * layout.stage_layers(config) + 1) * h
    local = (params - norms) // layout.tp + norms
    return ModelShape(local, outside // layout.tp, 0, norms, norms)


def data_parallel_seconds(
    config: ShardGPTConfig, cluster: Cluster, layout: Layout
) -> list[tuple[str, float, str | None]]:
    """The data-parallel strategy's collectives in one step: (kind, seconds on the ring, the compute they run beside:
    "forward", "backward" or None). ZeRO-3's and FSDP's all-gathers split between the passes in proportion to what
    each gathers (the forward Psi, the backward the rest)."""
    if layout.dp == 1:
        return []
    shape = rank_shape(config, layout)
    family, strategy = layout.sharding, layout.typed
    if family == "zero3":
        # DeepSpeed keeps gathered parameters to the step's end while they fit its live-parameter limits (1e9 in
        # the shipped zero3.json); past them it re-gathers in the backward, the paper's 3 Psi (both measured).
        limit = 0 if shape.parameters > 1e9 else 10**9
        zero = {"stage3_max_live_parameters": limit, "stage3_max_reuse_distance": limit}
        strategy = replace(strategy, deepspeed={"zero_optimization": zero})
    m = layout.micro_batches

    def payloads(element: int, micro_batches: int) -> dict[str, int]:
        # The step's closed form; where there is none over several micro batches (ZeRO-3 re-gathering, past its
        # live-parameter limits), each micro batch's repeated.
        found = expected_payloads(strategy, shape, element, micro_batches)
        if found is None:
            found = {k: micro_batches * v for k, v in expected_payloads(strategy, shape, element).items()}
        return found

    reduction = ACTIVATION_BYTES if family == "fsdp" else 4  # gradients: FSDP2 reduces in bf16, the rest in fp32
    gathered, reduced = payloads(ACTIVATION_BYTES, m), payloads(reduction, m)  # parameters are gathered in bf16
    once = {**payloads(ACTIVATION_BYTES, 1), **{k: v for k, v in payloads(reduction, 1).items() if k in REDUCTIONS}}
    # The group spans a pipeline stage's ranks, tp x sp apart (tensor- and sequence-parallel ranks are innermost).
    bandwidth = cluster.link_bandwidth(layout.world // layout.pp, layout.tp * layout.sp)
    nodes = cluster.nodes_spanned(layout.world // layout.pp, layout.tp * layout.sp)
    layers = layout.stage_layers(config)
    out = []
    for kind in gathered:
        nbytes = reduced[kind] if kind in REDUCTIONS else gathered[kind]
        repeats = nbytes / once[kind]  # how often a step sends one micro batch's share: once, or every micro batch
        calls = repeats * calls_per_step(family, kind, once[kind], shape, layers)
        seconds = collective_seconds(kind, nbytes, layout.dp, bandwidth) + calls * ring_latency(kind, layout.dp, nodes)
        window = OVERLAP[family].get(kind) if layout.pp == 1 else None
        if window == "forward+backward":
            forward = min(1.0, repeats * ACTIVATION_BYTES * shape.parameters / nbytes)
            out += [(kind, forward * seconds, "forward"), (kind, (1 - forward) * seconds, "backward")]
        else:
            out.append((kind, seconds, window))
    return out


def exposed(by_window: dict[str | None, float], forward: float, backward: float) -> dict[str, float]:
    """What the compute beside them (`forward`, `backward` seconds) leaves exposed of the collectives' seconds
    `by_window`; those of one window share its link, one after another."""
    out = {"forward": max(0.0, by_window.get("forward", 0.0) - forward)}
    out["backward"] = max(0.0, by_window.get("backward", 0.0) - backward)
    out["after_backward"] = by_window.get(None, 0.0)
    return out


def offload_seconds(config: ShardGPTConfig, cluster: Cluster, layout: Layout, backward: float) -> float:
    """Exposed PCIe time of ZeRO-Offload: the gradient partition down (fp32, beside the backward), the updated bf16
    partition up, and with parameters offloaded the partition fetched before each forward and backward."""
    if not layout.typed.offloads:
        return 0.0
    partition = rank_shape(config, layout).parameters / layout.dp
    down = 4 * partition / cluster.pcie_bw
    up = ACTIVATION_BYTES * partition / cluster.pcie_bw
    fetch = 2 * layout.micro_batches * up if layout.typed.offload_param != "none" else 0.0
    return max(0.0, down - backward) + up + fetch


def predict_step(config: ShardGPTConfig, cluster: Cluster, layout: Layout, seq_len: int,
                 attn_implementation: str = "sdpa") -> dict:  # fmt: skip
    """One layout's step: seconds of compute, exposed communication by source, bubble and offload; tokens/s, MFU.
    `attn_implementation`: "sdpa" (FlashAttention's kernels on GPUs) or "eager" (scores written out)."""
    sequences = layout.dp * layout.micro_batch * layout.micro_batches
    tokens = sequences * seq_len
    model_flops = model_flops_per_token(config, seq_len)
    compute = compute_seconds(config, cluster, layout, seq_len, attn_implementation)
    per_micro = compute / layout.micro_batches  # one micro batch on one rank (its stage's share under a pipeline)
    forward, backward = per_micro / 3, 2 * per_micro / 3
    if layout.checkpointing:
        forward, backward = per_micro / 4, 3 * per_micro / 4  # the recomputed forward runs in the backward
    bubble = compute * (layout.pp - 1) / (layout.virtual_stages * layout.micro_batches)
    micro_tokens = layout.micro_batch * seq_len
    comm = {}
    # Data parallelism: the collectives of each window against the compute they can hide behind (the last micro
    # batch's, for DDP's once-a-step reduction; every micro batch's for the per-micro-batch ones).
    by_window: dict[str | None, float] = {}
    for _, seconds, window in data_parallel_seconds(config, cluster, layout):
        by_window[window] = by_window.get(window, 0.0) + seconds
    scale = layout.micro_batches if layout.sharding in PER_MICRO_BATCH else 1
    if by_window:
        for window, seconds in exposed(by_window, scale * forward, scale * backward).items():
            comm[f"dp_{window}"] = seconds
    if layout.tp > 1:
        size = ACTIVATION_BYTES * micro_tokens // layout.sp * config.hidden_size
        calls = (6 if layout.checkpointing else 4) * layout.stage_layers(config) * layout.micro_batches
        comm["tp_all_reduce"] = calls * all_reduce_seconds(size, layout.tp, cluster.link_bandwidth(layout.tp))
    if layout.sp > 1:
        strategy = Strategy.of("ddp", layout.world, sp=layout.sp)
        sent = ulysses_payloads(strategy, ModelShape.of(config), config, micro_tokens, 1, ACTIVATION_BYTES)
        repeats = layout.micro_batches * (1.5 if layout.checkpointing else 1)  # recompute repeats the forward's
        bandwidth = cluster.link_bandwidth(layout.tp * layout.sp)
        comm["sp_all_to_all"] = repeats * gather_seconds(sent["all_to_all"], layout.sp, bandwidth)
    if layout.pp > 1:
        size = ACTIVATION_BYTES * micro_tokens * config.hidden_size / layout.tp / layout.sp
        # Neighbouring stages are world / pp ranks apart; each rank sends to its own peer, on its own NIC.
        hop = cluster.link_bandwidth(layout.world, layout.world)
        # Interleaving sends each micro batch's activations v times as far round the ranks (Narayanan et al. 2021).
        sends = layout.virtual_stages * layout.micro_batches + layout.pp - 1
        comm["pp_send_recv"] = 2 * sends * size / hop
    offload = offload_seconds(config, cluster, layout, backward)
    communication = sum(comm.values())
    step = compute + bubble + communication + offload
    return {
        "layout": layout.name,
        "degrees": dataclasses.asdict(layout),
        "step_seconds": step,
        "compute_seconds": compute,
        "bubble_seconds": bubble,
        "communication_seconds": communication,
        "communication": comm,
        "offload_seconds": offload,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / step,
        "tokens_per_second_per_gpu": tokens / step / cluster.num_gpus,
        "mfu": model_flops * tokens / step / (cluster.num_gpus * cluster.peak_flops),
        "bubble_fraction": bubble_fraction(layout.pp, layout.micro_batches, layout.virtual_stages),
    }


# ---------------------------------------------------------------------------------------------- memory


class Memory:
    """Bytes one GPU of a layout needs at its peak, the memory planner's (`training/plan/memory/planner.predict`) where
    it models the layout (data parallelism with Ulysses, AutoTP under ZeRO-1, DDP's and FSDP2's pipelines); otherwise
    its pieces composed: the ZeRO paper's model states of the rank's slice (`zero_paper`), the activations of the
    micro batches a stage holds (`layer_activation_bytes`, `in_flight`) and the chunked loss's logits."""

    def __init__(self, config: ShardGPTConfig, seq_len: int):
        self.config, self.seq_len = config, seq_len
        self.cache: dict[Layout, tuple[float, str]] = {}

    def __call__(self, layout: Layout) -> tuple[float, str]:
        """(bytes, "planner" or "composed")."""
        if layout not in self.cache:
            self.cache[layout] = self._predict(layout)
        return self.cache[layout]

    def _predict(self, layout: Layout) -> tuple[float, str]:
        c, world = self.config, layout.world
        strategy = Strategy.from_name(layout.strategy, world).with_degrees(sp=layout.sp)
        ds = None
        if layout.tp > 1 and layout.sharding == "zero1" and layout.pp == 1:
            strategy, ds = strategy.with_degrees(tp=layout.tp), repo_json(Strategy.from_name("zero1-autotp", 2))
            ds["tensor_parallel"]["autotp_size"] = layout.tp
        planned = layout.tp == 1 and layout.pp == 1 or ds is not None
        planned |= layout.pp > 1 and layout.tp == 1 and layout.sharding in ("ddp", "fsdp")
        if layout.pp > 1:
            strategy = replace(strategy.with_degrees(pp=layout.pp), pp_schedule=layout.memory_schedule)
        if planned:
            try:
                row = predict(c, strategy, "bf16", layout.micro_batch, self.seq_len, layout.checkpointing,
                              ds_config=ds, micro_batches=layout.micro_batches)  # fmt: skip
                return float(row["total"]), "planner"
            except ValueError:  # a pipeline torch's schedules refuse (1F1B with M < P, layers that do not split)
                return math.inf, "planner"
        shape = rank_shape(c, layout)
        stage = {"ddp": 0, "fsdp": 3}.get(layout.sharding) or layout.typed.zero_stage
        states = zero_paper(shape.parameters, layout.dp, stage, "bf16")
        e, tokens = ACTIVATION_BYTES, layout.micro_batch * self.seq_len // layout.sp
        layers = layout.stage_layers(c)
        if layout.pp == 1:
            activations = activation_bytes(c, layout.micro_batch, self.seq_len, e, layout.checkpointing, layout.tp)
        else:
            per_layer = e * c.hidden_size if layout.checkpointing else layer_activation_bytes(c, e, layout.tp)
            held = in_flight(layout.memory_schedule, layout.pp, layout.micro_batches, 0)
            activations = held * layers * per_layer * tokens
            activations += layer_activation_bytes(c, e, layout.tp) * tokens if layout.checkpointing else 0
        return states + activations + logits_bytes(c, layout.micro_batch, self.seq_len, e) / layout.tp, "composed"


# ---------------------------------------------------------------------------------------------- enumeration


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_options(config: ShardGPTConfig, num_gpus: int, gpus_per_node: int, seq_len: int,
                   fixed: dict[str, int | None]) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """(tp, pp, sp, dp) with tp x pp x sp x dp = num_gpus: tp within a node and dividing the heads and key-value
    heads, pp dividing the layers, sp dividing the heads and the sequence and a multiple or divisor of the key-value
    heads (Ulysses, as training/parallel/sequence.py checks); `fixed` pins any of them."""
    heads, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    out = []
    for tp in divisors(num_gpus):
        if tp > gpus_per_node or heads % tp or kv % tp:
            continue
        for pp in divisors(num_gpus // tp):
            if pp > layers:  # stages of unequal layers too: Megatron-LM's and Llama 3's runs split them so
                continue
            for sp in divisors(num_gpus // (tp * pp)):
                if sp > 1 and (
                    tp > 1 or pp > 1 or heads % sp or kv % sp and sp % kv or seq_len % sp or sp > gpus_per_node
                ):
                    continue
                dp = num_gpus // (tp * pp * sp)
                degrees = dict(tp=tp, pp=pp, sp=sp, dp=dp)
                if all(fixed.get(k) in (None, v) for k, v in degrees.items()):
                    out.append((tp, pp, sp, dp))
    return out


def check_degrees(num_gpus: int, fixed: dict[str, int | None]) -> None:
    """Refuse, in one line, explicit degrees that cannot make `num_gpus`."""
    given = {k: v for k, v in fixed.items() if v is not None}
    if any(v < 1 for v in given.values()):
        raise ValueError(f"degrees must be at least 1: {given}")
    product = math.prod(given.values())
    spelled = " x ".join(f"{k} {v}" for k, v in given.items())
    if len(given) == 4 and product != num_gpus or num_gpus % product:
        raise ValueError(
            f"degrees {spelled} = {product} do not {'multiply to' if len(given) == 4 else 'divide'} the {num_gpus} "
            "GPUs: choose degrees whose product is the GPU count"
        )


def check_batch(global_batch: int, seq_len: int, options: list[tuple[int, int, int, int]], micro: int | None) -> None:
    """Refuse, in one line, a global batch that no layout's data-parallel ranks (x the pinned micro batch) divide."""
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global batch {global_batch} sequences of {seq_len} tokens: both must be at least 1")
    shares = sorted({dp * (micro or 1) for *_, dp in options})
    if not any(global_batch % share == 0 for share in shares):
        per = " x micro batch" if micro else ""
        raise ValueError(
            f"global batch {global_batch} sequences does not divide over data-parallel ranks{per} "
            f"({', '.join(map(str, shares))}): choose a multiple of one of them"
        )


def layouts(config: ShardGPTConfig, cluster: Cluster, global_batch: int, seq_len: int,
            fixed: dict | None = None, any_layout: bool = False) -> list[Layout]:  # fmt: skip
    """Every layout of the cluster for `global_batch` sequences a step (before the memory check) that recipes/train.py
    runs (`Layout.runs_here`), or with `any_layout` Megatron-LM's too. `fixed`: any of tp, pp, sp, dp (degrees),
    strategy, schedule, micro_batch, checkpointing pinned to a value."""
    fixed = fixed or {}
    degrees = {k: fixed.get(k) for k in ("tp", "pp", "sp", "dp")}
    check_degrees(cluster.num_gpus, degrees)
    options = degree_options(config, cluster.num_gpus, cluster.gpus_per_node, seq_len, degrees)
    if not options:
        raise ValueError(f"no layout of {cluster.num_gpus} GPUs has the degrees {degrees} for this model's "
                         f"{config.num_attention_heads} heads and {config.num_hidden_layers} layers")  # fmt: skip
    check_batch(global_batch, seq_len, options, fixed.get("micro_batch"))
    out = []
    for tp, pp, sp, dp in options:
        if global_batch % dp:
            continue
        names = WITH_PIPELINE if pp > 1 else WITH_TENSOR_PARALLEL if tp > 1 else DP_STRATEGIES
        if sp > 1:
            names = [n for n in names if n in WITH_SEQUENCE_PARALLEL]
        if tp > 1 and pp > 1:
            names = [n for n in names if n in WITH_TENSOR_PARALLEL]
        for name in names:
            for schedule, v in SCHEDULES if pp > 1 else (("1F1B", 1),):
                for micro in MICRO_BATCHES:
                    if (global_batch // dp) % micro:
                        continue
                    m = global_batch // dp // micro
                    even = config.num_hidden_layers % (pp * v) == 0
                    if v > 1 and (m % pp or pp * v > config.num_hidden_layers):
                        continue  # interleaving takes micro batches in rounds of P (torch's and Megatron-LM's)
                    for checkpointing in (False, True):
                        lay = Layout(name, dp, tp, pp, sp, schedule, micro, m, checkpointing, v)
                        if even or not lay.runs_here:  # recipes/train.py splits the layers evenly
                            out.append(lay)
    pinned = {k: v for k, v in fixed.items()
              if k in ("strategy", "schedule", "micro_batch", "checkpointing", "virtual_stages")}  # fmt: skip
    out = [lay for lay in out if all(getattr(lay, k) == v for k, v in pinned.items() if v is not None)]
    here = [lay for lay in out if lay.runs_here]
    if out and not here and not any_layout:
        pins = ", ".join(f"{k} {v}" for k, v in fixed.items() if v is not None)
        raise ValueError(
            f"no layout with {pins} runs in recipes/train.py (tensor parallelism only as ZeRO-1 AutoTP, a pipeline "
            "only under DDP or FSDP2 on stages of equal layers, Ulysses only under ZeRO, none of them combined): pin "
            "another, or pass --any_layout to predict Megatron-LM's layouts too"
        )
    return out if any_layout else here


def plan(config: ShardGPTConfig, cluster: Cluster, global_batch: int, seq_len: int, fixed: dict | None = None,
         any_layout: bool = False, attn_implementation: str = "sdpa") -> dict:  # fmt: skip
    """Every layout recipes/train.py runs (with `any_layout`, Megatron-LM's too) that fits the cluster's GPU memory,
    predicted and ranked by tokens/s (fastest first), each saying whether the script runs it (`runs_here`), with the
    inputs; `rejected` counts those that do not fit."""
    memory = Memory(config, seq_len)
    rows, rejected = [], 0
    smallest_too_large: dict[Layout, int] = {}  # memory grows with the micro batch: past one that does not fit, skip
    for lay in layouts(config, cluster, global_batch, seq_len, fixed, any_layout):
        key = replace(lay, micro_batch=0, micro_batches=0)
        if lay.micro_batch > smallest_too_large.get(key, math.inf):
            rejected += 1
            continue
        needed, source = memory(lay)
        if needed > cluster.memory_bytes:
            smallest_too_large[key] = min(lay.micro_batch, smallest_too_large.get(key, math.inf))
            rejected += 1
            continue
        row = predict_step(config, cluster, lay, seq_len, attn_implementation)
        row.update(memory_gb=needed / 1e9, memory_source=source, runs_here=lay.runs_here)
        rows.append(row)
    rows.sort(key=lambda r: (-r["tokens_per_second"], r["memory_gb"]))  # ties: the one that needs less memory
    inputs = dict(cluster=dataclasses.asdict(cluster), global_batch=global_batch, seq_len=seq_len,
                  any_layout=any_layout, attn_implementation=attn_implementation,
                  parameters=ModelShape.of(config).parameters,
                  model_flops_per_token=model_flops_per_token(config, seq_len))  # fmt: skip
    return {"inputs": inputs, "layouts": rows, "rejected_for_memory": rejected}


LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
)  # fmt: skip


def llama_config(path: str, **overrides) -> ShardGPTConfig:
    """A Llama config.json (transformers' LlamaConfig fields; model/configs/ holds Llama 3's) as this project's
    model, any field replaced by `overrides`."""
    with open(path) as f:
        fields = {**json.load(f), **overrides}
    missing = [k for k in LLAMA_FIELDS[:5] if k not in fields]
    if missing:
        raise ValueError(f"{path} is not a Llama config.json: it lacks {', '.join(missing)}")
    heads = fields["num_attention_heads"]
    if fields.get("head_dim", fields["hidden_size"] // heads) * heads != fields["hidden_size"]:
        raise ValueError(f"{path}: head_dim x num_attention_heads must equal hidden_size in this project's model")
    return ShardGPTConfig(**{k: fields[k] for k in LLAMA_FIELDS if k in fields})
