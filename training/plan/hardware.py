"""The GPUs and links a step-time prediction runs on: a table of known GPU kinds and a cluster built from one.

Peak FLOP/s are dense bf16 from the vendors' data sheets (`training/flops.PEAK_FLOPS`). Bandwidths are per GPU and
per direction, what the ring formulas take (nccl-tests' PERFORMANCE.md): NVLink 4 on H100/H200 SXM is 900 GB/s
bidirectional (450 each way), NVLink 3 on A100 SXM 600 (300); between nodes one NIC per GPU, NDR InfiniBand 400 Gb/s
(50 GB/s) on DGX H100/H200 and HDR 200 Gb/s (25 GB/s) on DGX A100 (the machines of Megatron-LM 2021's runs).
Host-to-GPU: PCIe 5 x16 on H100/H200, measured 54.9 GB/s pinned on this project's H100 (docs/benchmarks.md, the
doctor); PCIe 4 x16 on A100, 32 GB/s on paper, 25 assumed (the same ~80% of paper as the H100's measurement).

HBM bandwidth, what memory-bound kernels (norms, activations, residuals, the loss's softmax, attention scores written
out) run at: the data sheets' 3.35 TB/s (H100 SXM), 4.8 (H200), 2.039 (A100 80GB SXM), 1.555 (A100 40GB).

`efficiency`: the share of peak the matrix multiplies reach (attention's included, FlashAttention's kernels); the
memory-bound work is counted apart, at HBM bandwidth (training/plan/step_compute.py's ELEMENTWISE_ACCESSES). Both
are calibrated once, on one node, on MosaicML llm-foundry's published single-node sweep (scripts/train/benchmarking/
README.md: MPT 125M to 7B, 8 GPUs, sequence 2048, FSDP full shard, no activation checkpointing, where NVLink hides
FSDP's gathers): `training/plan/published.calibrate` solves them, tests/training/test_step_time.py checks that
these figures are its solution. Every run the planner is checked against (other GPU counts, networks, checkpointing,
other stacks and papers) lies outside that calibration. H200 has the H100's compute and is given its figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.flops import PEAK_FLOPS

GB = 1e9
H100_NVL_PEAK = 835e12  # H100 NVL's dense bf16 (its data sheet: 1,671 with sparsity), at 350-400 W
H100_500W_PEAK = H100_NVL_PEAK + (PEAK_FLOPS["H100"] - H100_NVL_PEAK) * (500 - 400) / (700 - 400)
# `training/plan/published.calibrate()`'s solution (module docstring); the memory-bound count beside them is
# step_compute.ELEMENTWISE_ACCESSES.
H100_EFFICIENCY = 0.5708
A100_EFFICIENCY = 0.7702


@dataclass(frozen=True)
class GPUKind:
    """One kind of GPU and the links of the machines it usually comes in."""

    peak_flops: float
    """Dense bf16 FLOP/s."""
    memory_gib: float
    """Memory in GiB, as the driver reports its total (nvidia-smi's MiB / 1024): what the memory check compares the
    planners' bytes with."""
    intra_node_gbps: float
    """GB/s per GPU per direction inside a node (NVLink)."""
    inter_node_gbps: float
    """GB/s per GPU per direction between nodes (one NIC per GPU)."""
    pcie_gbps: float
    """GB/s host to GPU (what offload moves over)."""
    hbm_gbps: float
    """GB/s of the GPU's own memory (what memory-bound kernels run at)."""
    efficiency: float
    """The matrix multiplies' share of peak (module docstring)."""


# Memory totals as nvidia-smi reports them: H100 SXM 81,559 MiB (this project's lent H100: docs/benchmarks.md), H200
# 143,771 MiB, A100 80GB 81,920 MiB, A100 40GB 40,960 MiB.
GPU_KINDS = {
    "h100": GPUKind(PEAK_FLOPS["H100"], 81559 / 1024, 450, 50, 54.9, 3350, H100_EFFICIENCY),
    "h200": GPUKind(PEAK_FLOPS["H200"], 143771 / 1024, 450, 50, 54.9, 4800, H100_EFFICIENCY),
    "a100-80gb": GPUKind(PEAK_FLOPS["A100"], 80, 300, 25, 25, 2039, A100_EFFICIENCY),
    "a100-40gb": GPUKind(PEAK_FLOPS["A100"], 40, 300, 25, 25, 1555, A100_EFFICIENCY),
    # Meta's Grand Teton H100s (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md): 96 GB of HBM2e at 2.4
    # TB/s, 400 Gb/s RDMA a GPU, run at a 500 W power limit; "the actual peak TFLOPs number is between SXM and NVL"
    # (989 and 835 dense bf16 TFLOP/s at 700 and 400 W), taken linear in the power between them: 886.
    "h100-hbm2e": GPUKind(H100_500W_PEAK, 96e9 / 2**30, 450, 50, 54.9, 2400, H100_EFFICIENCY),
}


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one kind, `gpus_per_node` to a node; every figure of the kind overridable."""

    kind: str
    num_gpus: int
    gpus_per_node: int
    peak_flops: float
    memory_bytes: float
    intra_node_bw: float  # bytes/s per GPU per direction
    inter_node_bw: float
    pcie_bw: float
    hbm_bw: float
    efficiency: float

    def link_bandwidth(self, span: int, stride: int = 1) -> float:
        """The bandwidth per rank of a group whose ranks lie `stride` apart within `span` consecutive ranks: NVLink if
        they fit in one node; across nodes, the NICs of the group's ranks in a node together (NCCL runs a ring per NIC
        and every group of the node at once, each on its own ranks' NICs: k ranks a node cross on k NICs), at most
        NVLink's, since each ring also passes through the node."""
        if span <= self.gpus_per_node:
            return self.intra_node_bw
        in_node = max(1, self.gpus_per_node // stride)
        return min(self.intra_node_bw, in_node * self.inter_node_bw)

    def nodes_spanned(self, span: int, stride: int = 1) -> int:
        """How many nodes a group whose ranks lie `stride` apart within `span` consecutive ranks spans."""
        return max(1, math.ceil(span / max(stride, self.gpus_per_node)))


def cluster(kind: str, num_gpus: int, gpus_per_node: int = 8, *, peak_tflops: float | None = None,
            memory_gib: float | None = None, intra_node_gbps: float | None = None,
            inter_node_gbps: float | None = None, pcie_gbps: float | None = None, hbm_gbps: float | None = None,
            efficiency: float | None = None) -> Cluster:  # fmt: skip
    """The cluster of `num_gpus` GPUs of `kind` (a key of GPU_KINDS), any figure replaced by the one given."""
    if kind not in GPU_KINDS:
        raise ValueError(f"unknown GPU kind {kind!r}: known kinds are {', '.join(GPU_KINDS)} (or override its figures)")
    if num_gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"--num_gpus {num_gpus} and --gpus_per_node {gpus_per_node} must be at least 1")
    g = GPU_KINDS[kind]

    def pick(given, default):
        return default if given is None else given

    return Cluster(
        kind, num_gpus, min(gpus_per_node, num_gpus), pick(peak_tflops and peak_tflops * 1e12, g.peak_flops),
        pick(memory_gib, g.memory_gib) * 2**30, pick(intra_node_gbps, g.intra_node_gbps) * GB,
        pick(inter_node_gbps, g.inter_node_gbps) * GB, pick(pcie_gbps, g.pcie_gbps) * GB,
        pick(hbm_gbps, g.hbm_gbps) * GB, pick(efficiency, g.efficiency),
    )  # fmt: skip
