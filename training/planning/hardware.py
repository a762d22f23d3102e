"""The GPUs and links a step-time prediction runs on: a table of known GPU kinds and a cluster built from one.

Peak FLOP/s are dense bf16 from the vendors' data sheets (`training/metrics.PEAK_FLOPS`). Bandwidths are per GPU and
per direction, what the ring formulas take (nccl-tests' PERFORMANCE.md): NVLink 4 on H100/H200 SXM is 900 GB/s
bidirectional (450 each way), NVLink 3 on A100 SXM 600 (300); between nodes one NIC per GPU, NDR InfiniBand 400 Gb/s
(50 GB/s) on DGX H100/H200 and HDR 200 Gb/s (25 GB/s) on DGX A100 (the machines of Megatron-LM 2021's runs).
Host-to-GPU: PCIe 5 x16 on H100/H200, measured 54.9 GB/s pinned on this project's H100 (docs/benchmarks.md, the
doctor); PCIe 4 x16 on A100, 32 GB/s on paper, 25 assumed (the same ~80% of paper as the H100's measurement).

`COMPUTE_EFFICIENCY`: the share of peak a training step's compute reaches when nothing waits for the network. Not fitted
to the runs the planner is checked against: taken from MosaicML llm-foundry's published benchmarks
(scripts/train/benchmarking/README.md, "7b, 2048 tokens, 8 GPUs, FULL_SHARD, no activation checkpointing"): MFU
64.23% on A100 80GB, 46.44% on H100 80GB (bf16) in one node, where NVLink hides FSDP's gathers. H200 has the H100's
compute and is given its figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.metrics import PEAK_FLOPS

GB = 1e9


@dataclass(frozen=True)
class GPUKind:
    """One kind of GPU and the links of the machines it usually comes in."""

    peak_flops: float
    """Dense bf16 FLOP/s."""
    memory_gb: float
    """Memory in GB (1e9 bytes), as the vendor counts it."""
    intra_node_gbps: float
    """GB/s per GPU per direction inside a node (NVLink)."""
    inter_node_gbps: float
    """GB/s per GPU per direction between nodes (one NIC per GPU)."""
    pcie_gbps: float
    """GB/s host to GPU (what offload moves over)."""
    efficiency: float
    """COMPUTE_EFFICIENCY for this kind (module docstring)."""


GPU_KINDS = {
    "h100": GPUKind(PEAK_FLOPS["H100"], 80, 450, 50, 54.9, 0.4644),
    "h200": GPUKind(PEAK_FLOPS["H200"], 141, 450, 50, 54.9, 0.4644),
    "a100-80gb": GPUKind(PEAK_FLOPS["A100"], 80, 300, 25, 25, 0.6423),
    "a100-40gb": GPUKind(PEAK_FLOPS["A100"], 40, 300, 25, 25, 0.6423),
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
    efficiency: float

    def link_bandwidth(self, span: int) -> float:
        """The bandwidth a group whose ranks lie within `span` consecutive ranks runs at: NVLink if they fit in one
        node, else the inter-node NIC (a ring that leaves the node is as slow as its slowest hop)."""
        return self.intra_node_bw if span <= self.gpus_per_node else self.inter_node_bw


def cluster(kind: str, num_gpus: int, gpus_per_node: int = 8, *, peak_tflops: float | None = None,
            memory_gb: float | None = None, intra_node_gbps: float | None = None,
            inter_node_gbps: float | None = None, pcie_gbps: float | None = None,
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
        pick(memory_gb, g.memory_gb) * GB, pick(intra_node_gbps, g.intra_node_gbps) * GB,
        pick(inter_node_gbps, g.inter_node_gbps) * GB, pick(pcie_gbps, g.pcie_gbps) * GB,
        pick(efficiency, g.efficiency),
    )  # fmt: skip
