"""A training step's time for each layout of a cluster, predicted before renting it: compute, exposed communication,
the pipeline bubble and offload transfers, then tokens/s and MFU, ranked over every layout that fits in memory.

A layout is a data-parallel strategy (DDP, FSDP, ZeRO-1/2/3, ZeRO with CPU offload) and explicit degrees whose
product is the GPU count: tensor parallelism (tp, innermost), Ulysses sequence parallelism (sp), pipeline stages (pp,
outermost, GPipe or 1F1B with M micro batches a step), data parallelism (dp); the mesh of
`training/strategy.py`. Only the layouts recipes/train.py runs are enumerated (`Layout.runs_here`, from the
axes table: tensor parallelism as AutoTP under ZeRO or under FSDP2, a pipeline under DDP or FSDP2 with tensor
parallelism inside its stages, Ulysses under ZeRO); `any_layout` adds what published runs used: Megatron-Core's
runtime (its DDP and distributed optimizer with tensor and pipeline parallelism, Megatron's sequence parallelism) and
torchtitan's FSDP2 x TP with sequence parallelism; selective recomputation, TP overlap and fp8 as options.

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
- overlap, as each strategy's runtime overlaps (`OVERLAP`, `STACKS`): what is hidden is at most the compute it runs
  beside; the rest is exposed. Tensor- and sequence-parallel collectives and pipeline sends sit on the critical path
  (exposed), but for TP overlap (one chunk in tp exposed) and Megatron-Core's overlapped sends.
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
from dataclasses import replace

from model import ShardGPTConfig
from training.plan.communication import ModelShape, expected_payloads, ulysses_payloads
from training.plan.hardware import Cluster
from training.plan.ring import (
    ACTIVATION_BYTES,
    all_reduce_seconds,
    bubble_fraction,
    calls_per_step,
    collective_seconds,
    gather_seconds,
    ring_latency,
)
from training.plan.step_compute import (
    compute_seconds,
    model_flops_per_token,
    rank_shape,
)
from training.plan.step_layout import Layout
from training.strategy import Strategy

# Which collectives hide behind which compute, per strategy. "backward": behind the backward of the micro batch it
# belongs to (2/3 of its compute); "forward": behind its forward (1/3); None: exposed.
# - DDP buckets its gradients and all-reduces each bucket as soon as it is ready, during the backward (Li et al.,
#   "PyTorch Distributed", VLDB 2020, section 3.2.3); with accumulation it reduces once, in the last micro batch.
# - ZeRO-1/2 reduce gradients per bucket in the backward where `overlap_comm` is on (the shipped zero2.json; DeepSpeed
#   defaults it off for stages 1 and 2, so zero1.json's reduction waits); the updated partitions are all-gathered
#   after the optimizer step, with nothing to hide behind (ZeRO paper, section 7).
# - ZeRO-3 and FSDP prefetch the next layer's parameters during the current layer's forward and backward and
#   reduce-scatter gradients during the backward (DeepSpeed `overlap_comm`, FSDP's prefetch: Zhao et al. 2023, 3.3).
# - Under a pipeline the data-parallel reduction runs after the flush (training/axes/pipeline/; Megatron-LM 2021;
#   torch's pipelining syncs FSDP2's gradients after the last backward only): exposed. FSDP2's gathers still run ahead
#   of each unit's use inside the stage, in every micro batch's forward and backward.
OVERLAP = {
    "ddp": {"all_reduce": "backward"},
    "zero1": {"all_reduce": None, "all_gather": None},
    "zero2": {"all_reduce": "backward", "all_gather": None},
    "zero3": {"all_gather": "forward+backward", "reduce_scatter": "backward"},
    "fsdp": {"all_gather": "forward+backward", "reduce_scatter": "backward"},
}
PER_MICRO_BATCH = {"zero2", "zero3", "fsdp"}  # reduce (and gather) every micro batch, not once per step

# Megatron-LM 2021's ZeRO-3 comparison (its Table 2) ran DeepSpeed's ZeRO-3 of spring 2021 (DeepSpeed 0.3.x,
# "integrated into our codebase using the DeepSpeed Python library"), whose runtime differs from today's: each
# parameter's all-gather first synchronizes the whole device (`torch.cuda.synchronize()` in
# `partition_parameters._allgather_param`, v0.3.14; "the async version is not async at all, because each all_gather
# calls torch.cuda.synchronize()": deepspeedai/DeepSpeed pull request 1188, June 2021), so neither the gathers nor
# the gradients' reduce-scatters queued before them overlap the compute; the gradients are reduce-scattered as they
# are held, in fp16 (`_reduce_scatter_gradient` of `param.grad`). Under "megatron-lm-2021" ZeRO-3 is modelled so.
# Whatever the version, past its live-parameter limits ZeRO-3 releases a module's parameters after each use, so a
# recomputed forward (activation checkpointing) gathers them once more.
# Tensor-parallel overlap (Megatron's `--tp-comm-overlap` through Transformer Engine's userbuffers; torchtitan's
# async TP): each GEMM beside a collective is cut into tp chunks and each chunk's transfer runs beside another
# chunk's GEMM (Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition"); one chunk's
# transfer in tp stays exposed, and the rest hides up to the layer's matrix compute.
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")


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
    megatron = layout.stack == "megatron-core"
    # DeepSpeed 0.3's ZeRO-3, as Megatron-LM 2021 ran it (STACKS above): nothing overlapped, fp16 gradients.
    deepspeed_2021 = layout.stack == "megatron-lm-2021" and family == "zero3"

    def payloads(element: int, micro_batches: int) -> dict[str, int]:
        # The step's closed form; where there is none over several micro batches (ZeRO-3 re-gathering, past its
        # live-parameter limits), each micro batch's repeated. Megatron-Core's distributed optimizer: a
        # reduce-scatter of the gradients and an all-gather of the parameters, Psi each, once a step.
        if megatron and family == "zero1":
            return {"reduce_scatter": element * shape.parameters, "all_gather": element * shape.parameters}
        found = expected_payloads(strategy, shape, element, micro_batches)
        if found is None:
            found = {k: micro_batches * v for k, v in expected_payloads(strategy, shape, element).items()}
        if family == "zero3" and limit == 0 and layout.checkpointing:
            # released after each use, a decoder layer's parameters are gathered again by its recomputed forward
            layers = shape.parameters - shape.outside_layers - (shape.norms - config.hidden_size)
            found["all_gather"] += micro_batches * element * layers
        return found

    # Gradients: FSDP2 and Megatron-Core reduce in bf16, DeepSpeed 0.3's ZeRO-3 in fp16, the rest in fp32.
    reduction = ACTIVATION_BYTES if family == "fsdp" or megatron or deepspeed_2021 else 4
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
        calls = repeats * calls_per_step(family, kind, once[kind], shape, layers, per_tensor=deepspeed_2021)
        seconds = collective_seconds(kind, nbytes, layout.dp, bandwidth) + calls * ring_latency(kind, layout.dp, nodes)
        # Under a pipeline the reductions wait for the last backward; FSDP2 still gathers each unit ahead of its use
        # (OVERLAP above).
        prefetched = family == "fsdp" and kind == "all_gather"
        window = OVERLAP[family].get(kind) if layout.pp == 1 or prefetched else None
        if megatron:  # each bucket reduced as it is ready; the parameters gathered during the first forward
            window = "backward" if kind in REDUCTIONS else "forward"
        if deepspeed_2021:  # each gather waits for the device, the reductions before it with it: all exposed
            window = None
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
        # Two all-reduces a layer and micro batch in each forward (recomputed ones too); in the backward two, or one
        # per column-split module in this project's runtime (STACKS); under sequence parallelism each is an
        # all-gather and a reduce-scatter of the same ring bytes (Korthikanti et al. 2022, section 4.2.2), the
        # column-split modules' input gathered once for all of them (torch's SequenceParallel does the same). Their
        # input gathered again in the backward (Megatron's layout of the saved activations, half an all-reduce's ring
        # bytes a region) runs beside the weight gradients' compute in Megatron-LM (Korthikanti et al. 2022, 4.2.2) and
        # after it here (training/axes/tensor/plan.save_sequence_shards): exposed, but where checkpointing's
        # recomputation gathers in its place or a compiled layer keeps the gathered input; selective recomputation
        # gathers it again, compiled or not: torch's per-op policy (torchtitan's `_save_list`, models/llama3/
        # parallelize_llama.py) keeps the reduce-scatters' outputs but not the all-gathers', so the recomputed
        # forward runs the gathers again before the backward. With fp8 under sequence parallelism every all-gather
        # carries the float8 cast, a byte an element, and the reduce-scatters bf16 (torchao's Float8ColwiseParallel,
        # Float8RowwiseParallel and PrepareFloat8ModuleInput, torchtitan's tensorwise TP: the inputs cast before they
        # are gathered, the output gradients cast before the backward gathers them).
        size = ACTIVATION_BYTES * micro_tokens // layout.sp * config.hidden_size
        styles = list(config.base_model_tp_plan.values())
        per_module = layout.stack == "shardgpt" and not layout.sequence_parallel  # SP gathers each input once
        backward = styles.count("colwise") if per_module else styles.count("rowwise")
        gathered = 0.5 if layout.fp8 and layout.sequence_parallel else 1.0  # a gather's bytes against bf16's
        pair = (gathered + 1) / 2  # an all-gather and a reduce-scatter against an all-reduce's ring bytes
        per_layer = pair * ((2 if layout.checkpointing else 1) * styles.count("rowwise") + backward)
        kept = layout.checkpointing or (layout.compiled and not layout.selective)
        if layout.stack == "shardgpt" and layout.sequence_parallel and not kept:
            per_layer += gathered * styles.count("rowwise") / 2
        calls = per_layer * layout.stage_layers(config) * layout.micro_batches
        seconds = calls * all_reduce_seconds(size, layout.tp, cluster.link_bandwidth(layout.tp))
        if layout.tp_overlap:  # one chunk in tp exposed, the rest hidden up to the compute (TP_OVERLAP above)
            seconds = seconds / layout.tp + max(0.0, seconds * (1 - 1 / layout.tp) - compute)
        comm["tp_gather_scatter" if layout.sequence_parallel else "tp_all_reduce"] = seconds
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
        seconds = 2 * sends * size / hop
        if layout.stack == "megatron-core" and layout.virtual_stages > 1:  # overlap_p2p_comm: beside the compute
            seconds = max(0.0, seconds - compute)
        comm["pp_send_recv"] = seconds
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
