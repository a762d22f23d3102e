"""Published runs the step-time planner is calibrated on (one node) and checked against (everything else), as their
authors report them.

Calibration (`CALIBRATION`, `calibrate`): MosaicML llm-foundry's single-node sweep (scripts/train/benchmarking/
README.md): MPT 125M to 7B, 8 GPUs, sequence 2048, FSDP full shard, no activation checkpointing, on A100 80GB and
H100 80GB. It fixes three numbers: each GPU kind's matrix-unit efficiency and the memory-bound accesses per hidden unit
(training/plan/hardware.py, step_compute.ELEMENTWISE_ACCESSES).

Checked against, outside the calibration:
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21):
  GPT models (vocabulary 51,200, sequence 2048, activation recomputation, mixed precision) on DGX A100 80GB nodes of
  Selene (8 GPUs per node, NVLink 3, 8 HDR InfiniBand NICs per node), DDP over the data-parallel ranks, attention
  written out (2021's fused softmax, no FlashAttention) with Megatron-LM's default attention dropout 0.1. Throughput
  is TFLOP/s per GPU counted by the paper's equation 3, 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step, which
  includes the recomputed forward. Table 1 (weak scaling, tensor x pipeline x data parallelism) and Table 2 (175B,
  global batch 1536 fixed: ZeRO-3 without model parallelism against tensor x pipeline) as transcribed here.
- BigScience's BLOOM-176B (bigscience-workshop/bigscience, train/tr11-176B-ml/: the slurm script and README):
  Megatron-DeepSpeed on 48 nodes of Jean Zay (384 A100 80GB, 4 OmniPath links of 100 Gb/s a node: 6.25 GB/s a GPU),
  tp 4 x pp 12 x dp 8, micro batch 2, global batch 2048, full recomputation, bf16 with DeepSpeed's ZeRO-1-like
  optimizer, Megatron's default dropouts, vocabulary padded to 250,880; the log's "TFLOPs: 149.77" at 104.70 s per
  iteration, counted by equation 3.
- llm-foundry's runs across nodes: H100 80GB (`LLM_FOUNDRY_H100`) and A100 80GB / 40GB with "1600 Gbps node-node
  interconnect (RoCE)" (`LLM_FOUNDRY_A100`), each row's micro batch, accumulation and checkpointing, MFU in PaLM's
  convention (6N + 12 L h T per token, as the planner's).

The GPT and MPT shapes map onto this project's Llama-shaped model with the same matrices: a SwiGLU MLP of 8h/3 (three
matrices of h x 8h/3 hold GPT's two of h x 4h), key-value heads = heads, a tied head. Megatron-LM 2021's schedule is
taken as 1F1B with micro batches of one sequence (the paper tunes the micro batch per row and interleaves stages for
some runs: the planner models neither).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model import ShardGPTConfig
from training.flops import PEAK_FLOPS
from training.plan.hardware import cluster
from training.plan.ring import ACTIVATION_BYTES
from training.plan.step_compute import VOCAB_ACCESSES, model_flops_per_token
from training.plan.step_layout import Layout
from training.plan.step_time import predict_step

SEQ_LEN, VOCAB = 2048, 51200
ATTENTION_DROPOUT = 0.1  # Megatron-LM's default --attention-dropout, on scores written out (no FlashAttention then)


@dataclass(frozen=True)
class PublishedRun:
    source: str
    parameters: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    strategy: str = "ddp"
    vocab: int = VOCAB
    micro_batch: int = 1  # under a pipeline; without one, the whole per-rank batch
    inter_node_gbps: float | None = None  # the cluster's NIC per GPU, where it is not DGX A100's


MEGATRON_TABLE_1 = [
    PublishedRun("Megatron-LM 2021, Table 1", *row)
    for row in (
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
        ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
        ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
        ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    )
]
BLOOM = [
    PublishedRun("BLOOM-176B (BigScience)", "176B", 112, 14336, 70, 4, 12, 384, 2048, 149.77, "zero1", 250880, 2, 6.25)
]
MEGATRON_TABLE_2 = [
    PublishedRun("Megatron-LM 2021, Table 2", "175B", 96, 12288, 96, tp, pp, gpus, 1536, tflops, strategy)
    for strategy, tp, pp, gpus, tflops in (
        ("zero3", 1, 1, 384, 144), ("zero3", 1, 1, 768, 88), ("zero3", 1, 1, 1536, 44),
        ("ddp", 8, 12, 384, 153), ("ddp", 8, 12, 768, 149), ("ddp", 8, 12, 1536, 141),
    )
]  # fmt: skip


@dataclass(frozen=True)
class FSDPRun:
    parameters: str
    heads: int
    hidden: int
    layers: int
    gpus: int
    micro_batch: int
    accumulation: int
    checkpointing: bool
    mfu: float
    gpu: str = "h100"  # a GPU kind of training/plan/hardware.py
    source: str = "llm-foundry H100 benchmarks"


MPT_VOCAB = 50368
LLM_FOUNDRY_H100 = [
    FSDPRun(*row)
    for row in (
        ("1B", 16, 2048, 24, 64, 20, 1, False, 0.4085),
        ("3B", 20, 2560, 32, 64, 6, 3, False, 0.4080),
        ("13B", 40, 5120, 40, 64, 2, 1, False, 0.3986),
        ("30B", 56, 7168, 48, 8, 3, 21, True, 0.3811),
        ("30B", 56, 7168, 48, 32, 14, 3, True, 0.4392),
        ("70B", 64, 8192, 80, 32, 2, 16, True, 0.3615),
        ("70B", 64, 8192, 80, 64, 8, 4, True, 0.4257),
    )
]

# The A100 runs across nodes ("A100 80GB / 40GB with 1600 Gbps node-node interconnect (RoCE)": 8 x 200 Gb/s a node,
# the planner's 25 GB/s a GPU), FSDP full shard with bf16 reductions ("PURE"), activation checkpointing.
LLM_FOUNDRY_A100 = [
    FSDPRun(*row[1:], gpu=row[0], source="llm-foundry A100 benchmarks")
    for row in (
        ("a100-80gb", "70B", 64, 8192, 80, 64, 8, 4, True, 0.5333),
        ("a100-80gb", "70B", 64, 8192, 80, 32, 2, 16, True, 0.4856),
        ("a100-40gb", "70B", 64, 8192, 80, 128, 4, 1, True, 0.4891),
        ("a100-40gb", "70B", 64, 8192, 80, 64, 2, 1, True, 0.3587),
        ("a100-40gb", "30B", 56, 7168, 48, 128, 6, 1, True, 0.5225),
        ("a100-40gb", "30B", 56, 7168, 48, 32, 4, 1, True, 0.5174),
        ("a100-40gb", "13B", 40, 5120, 40, 128, 16, 1, True, 0.5193),
        ("a100-40gb", "13B", 40, 5120, 40, 64, 16, 1, True, 0.5204),
        ("a100-40gb", "7B", 32, 4096, 32, 128, 18, 1, True, 0.5014),
        ("a100-40gb", "7B", 32, 4096, 32, 64, 18, 1, True, 0.5073),
    )
]

# The calibration (training/plan/hardware.py): llm-foundry's single-node rows at sequence 2048 without activation
# checkpointing (8 GPUs, FSDP full shard; MPT shapes from scripts/train/yamls/pretrain/mpt-*.yaml), MFU as published.
CALIBRATION = [
    FSDPRun(*row[1:], gpu=row[0], source="llm-foundry single node (calibration)")
    for row in (
        ("a100-80gb", "125M", 12, 768, 12, 8, 40, 2, False, 0.4479),
        ("a100-80gb", "350M", 16, 1024, 24, 8, 32, 2, False, 0.5162),
        ("a100-80gb", "760M", 12, 1536, 24, 8, 24, 2, False, 0.5685),
        ("a100-80gb", "1B", 16, 2048, 24, 8, 14, 4, False, 0.5986),
        ("a100-80gb", "3B", 20, 2560, 32, 8, 10, 2, False, 0.6211),
        ("a100-80gb", "7B", 32, 4096, 32, 8, 6, 2, False, 0.6423),
        ("h100", "760M", 12, 1536, 24, 8, 24, 2, False, 0.3490),
        ("h100", "1B", 16, 2048, 24, 8, 14, 1, False, 0.4182),
        ("h100", "7B", 32, 4096, 32, 8, 6, 1, False, 0.4644),
    )
]


@dataclass(frozen=True)
class TunedRun:
    """A published run whose authors tuned what they do not state (the micro batch, the stages a rank holds,
    recomputation): predicted as the fastest layout the planner finds under what they do state (`compare_tuned`)."""

    source: str
    parameters: str
    config: ShardGPTConfig
    gpu: str  # a GPU kind of training/plan/hardware.py
    gpus: int
    batch: int  # sequences a step
    seq_len: int
    tokens_per_second_per_gpu: float
    stated: tuple[tuple[str, object], ...]  # the layout's pins (training/plan/layouts.layouts' `fixed`)
    # The stated layout ran in its GPUs, which the planner's memory model does not reproduce: its memory estimate is
    # reported beside the prediction, and rejects none of the layouts the run allows.
    memory_as_run: bool = False
    # GiB a GPU the source reports (torchtitan: the caching allocator's reserved peak), printed beside the planned.
    published_memory_gib: float | None = None

    @property
    def mfu(self) -> float:
        """PaLM's MFU against the H100 SXM's dense bf16 peak, both sources' convention."""
        return self.tokens_per_second_per_gpu * model_flops_per_token(self.config, self.seq_len) / PEAK_FLOPS["H100"]


def megatron_gpt(heads: int, hidden: int, layers: int, vocab: int, seq_len: int,
                 attention_dropout: float = 0.0) -> ShardGPTConfig:  # fmt: skip
    """Megatron-LM's GPT (or MosaicML's MPT) as this project's model, the same matrices: GELU's two h x 4h matrices
    held by SwiGLU's three of h x 8h/3, a head tied to the embedding (Megatron's default), key-value heads = heads."""
    return ShardGPTConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=round(8 * hidden / 3),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=seq_len, attention_dropout=attention_dropout)  # fmt: skip


# Megatron-Core's weak scaling on H100s (NVIDIA/Megatron-LM README, "Training Speed and Scalability", its model
# table, 2024): GPT models, vocabulary 131,072, sequence 4096, data parallelism 48 throughout, per-GPU teraFLOP/s as
# published (PaLM's count: 408.8 is the 1.7B's 41% of 989). Stated: `--overlap-grad-reduce --overlap-param-gather`
# (the distributed optimizer: `zero1` under Megatron-Core's runtime), `--tp-comm-overlap` (which needs sequence
# parallelism), pipeline communication overlapped; not stated: the micro batch, the interleaving, recomputation.
MEGATRON_CORE_H100 = [
    TunedRun(
        "Megatron-Core H100 (README)",
        name,
        config,
        "h100",
        tp * pp * 48,
        batch,
        4096,
        tflops * 1e12 / model_flops_per_token(config, 4096),
        (("tp", tp), ("pp", pp), ("dp", 48), ("strategy", "zero1"), ("stack", "megatron-core"), ("tp_overlap", tp > 1)),
    )  # fmt: skip
    for name, heads, hidden, layers, tp, pp, batch, tflops in (
        ("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
    )
    for config in [megatron_gpt(heads, hidden, layers, 131072, 4096)]
]


def llama(name: str) -> ShardGPTConfig:
    """A Llama 3 shape of model/configs/ (Llama 3.1's are the same matrices)."""
    from training.paths import ROOT
    from training.plan.layouts import llama_config

    return llama_config(str(ROOT / "model" / "configs" / f"{name}.json"))


# torchtitan on H100s (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1, 3, 4 and 5): Llama 3.1
# at sequence 8192 on Meta's 96 GB HBM2e H100s ("h100-hbm2e"), tokens/s per GPU as published, turned into MFU by PaLM's
# count against the SXM peak (the page's own convention: 8B at 33-39%). FSDP2 (with TP: torchtitan's SequenceParallel on
# the norms, Megatron's sequence parallelism); "selective" activation checkpointing as torchtitan's per-op policy
# (step_compute.selective_recomputed_gemms, activations.selective_layer_bytes), "full" as full; torch.compile, fp8
# (torchao's float8 linears) and async TP where stated. Its pipelines as torchtitan at the benchmarks' commit 9dec370
# runs them where the page states nothing more: the local batch split into as many micro batches as stages
# (pipelining_utils.py's `pipeline_parallel_microbatches` default: 8 of 4 sequences for the 405B's local 32),
# interleaving at two stages a rank, and FSDP2 keeping each stage's parameters gathered from a micro batch's forward to
# its backward (parallelize_llama.py: `reshard_after_forward = False` when pp is on: "fsdp-shard-grad-op"). Each row's
# "Memory(GiB)" is torchtitan's logged `max_reserved_gib` (the caching allocator's reserved peak, torchtitan/metrics.py
# at 9dec370): printed beside the planner's, not checked. It holds what the planner does not model otherwise: the loss's
# whole logits (train.py's uncompiled `cross_entropy(pred.flatten(0, 1).float(), labels)`, compiling it "causes CUDA
# errors" there: the (tokens, vocabulary) logits in bf16 and fp32 and log-softmax's fp32 output, 21 GB for the 8B's
# 16,384 tokens: planned as `whole_loss`), the allocator's cached blocks and, under a pipeline, each stage's gradients
# accumulated unsharded in fp32 until the last micro batch (torch's pipelining syncs them only there). From April 2025
# torchtitan compiles its loss, still on the whole logits (components/loss.py at 820504e and e7c0cae: `compiled_loss`,
# the bf16 logits and their gradient).
def torchtitan_run(parameters: str, model: str, gpus: int, batch: int, degrees: dict, full: bool,
                   options: tuple[str, ...], tokens_per_second: float, memory_gib: float | None = None,
                   source: str = "torchtitan H100 (benchmarks)", gpu: str = "h100-hbm2e",
                   whole_loss: bool = False, compiled_loss: bool = False) -> TunedRun:  # fmt: skip
    """One of torchtitan's runs: FSDP2 with the stated degrees and options, Megatron's sequence parallelism with its
    tensor parallelism, full or selective recomputation; `whole_loss`: its loss on the whole logits, uncompiled or
    (`compiled_loss`) compiled."""
    options = options + ("whole_loss",) if whole_loss else options
    options = options + ("compiled_loss",) if compiled_loss else options
    sequence = {"sequence_parallel": True} if degrees.get("tp", 1) > 1 else {}
    strategy = "fsdp-shard-grad-op" if degrees.get("pp", 1) > 1 else "fsdp"
    stated = {"strategy": strategy, "checkpointing": full, "selective": not full, **degrees, **sequence,
              **dict.fromkeys(options, True)}  # fmt: skip
    return TunedRun(source, parameters, llama(model), gpu, gpus, batch, 8192, tokens_per_second, tuple(stated.items()),
                    published_memory_gib=memory_gib)  # fmt: skip


EIGHT_B = {"dp": 8, "micro_batch": 2}
EIGHT_B_128 = {"dp": 128, "micro_batch": 2}
SEVENTY_B = {"dp": 32, "tp": 8, "micro_batch": 16}
FOUR_OH_FIVE_B = {"dp": 8, "tp": 8, "pp": 8, "micro_batch": 4}
TORCHTITAN_H100 = [
    torchtitan_run(*row, whole_loss=True)
    for row in (
        ("8B", "llama-3-8b", 8, 16, EIGHT_B, False, (), 5762, 82.4),
        ("8B", "llama-3-8b", 8, 16, EIGHT_B, False, ("compiled",), 6667, 77.0),
        ("8B", "llama-3-8b", 8, 16, EIGHT_B, False, ("compiled", "fp8"), 8532, 76.8),
        ("8B", "llama-3-8b", 128, 256, EIGHT_B_128, False, (), 5605, 67.0),
        ("8B", "llama-3-8b", 128, 256, EIGHT_B_128, False, ("compiled",), 6514, 62.0),
        ("8B", "llama-3-8b", 128, 256, EIGHT_B_128, False, ("compiled", "fp8"), 8380, 61.8),
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled", "fp8"), 829, 71.9),
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled", "fp8", "tp_overlap"), 876, 67.6),
        ("405B", "llama-3.1-405b", 512, 256, {**FOUR_OH_FIVE_B, "schedule": "1F1B"}, True,
         ("compiled", "fp8", "tp_overlap"), 100, 82.5),
        ("405B", "llama-3.1-405b", 512, 256, {**FOUR_OH_FIVE_B, "schedule": "Interleaved1F1B", "virtual_stages": 2},
         True, ("compiled", "fp8", "tp_overlap"), 128, 72.7),
    )
]  # fmt: skip

# torchtitan's later runs, added to the check (none of them to the calibration):
# - async TP against plain TP (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, June 2025): the same Grand Teton
#   H100s; Llama 3.1 70B on 256 GPUs (FSDP 32 x TP 8, local batch 16, full recomputation) and 8B on 64 (FSDP 8 x TP 8,
#   local batch 12, torchtitan's per-op selective recomputation), compiled, bf16 and fp8 tensorwise, each without and
#   with async TP. Its fp8 rowwise rows are left out: the planner models tensorwise scaling's casts only.
# - Trainy on WhiteFiber's H200s (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md, June 2025): Llama 3.1 8B,
#   FSDP over 4 and 8 nodes (32 and 64 GPUs, 400 Gb/s a GPU), local batch 2, compiled, fp8 tensorwise with float8
#   all-gathers, llama3_8b.toml's selective ("op") recomputation at its commit e7c0cae.
#   Both on the whole logits, compiled (`components/loss.py` at 820504e and e7c0cae: `cross_entropy` on `pred.float()`,
#   `torch.compile`d with the model): `whole_loss` and `compiled_loss` (the bf16 logits kept and their gradient).
# - torchao's float8 training table (torchao/float8/README.md, pytorch/ao pull request 1793, March 2025): Llama 3 8B
#   on 8 H100s, torchtitan 0.0.2 with torch 2.7.0a0, FSDP2, local batch 1, sequence 8192, compiled, per-op selective
#   recomputation, bf16 and fp8 tensorwise with float8 all-gathers (its rowwise row left out, as above). Taken as Meta's
#   H100s: torchao's own roofline (torchao/testing/training/roofline_utils.py) gives its H100 "2.4 TB per second,
#   custom to Meta's H100 variant". torchtitan's loss then still ran uncompiled on the whole logits
#   (torchtitan/components/loss.py at 0da8901, 2025-03-10; compiled from 2025-04-02): `whole_loss`. Its
#   peak memory printed beside the planner's.
EIGHT_B_TP8 = {"dp": 8, "tp": 8, "micro_batch": 12}
TORCHTITAN_2025 = [
    torchtitan_run(*row, source="torchtitan async TP (2025)", whole_loss=True, compiled_loss=True)
    for row in (
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled",), 597.3),
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled", "tp_overlap"), 652.4),
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled", "fp8"), 809.8),
        ("70B", "llama-3-70b", 256, 512, SEVENTY_B, True, ("compiled", "fp8", "tp_overlap"), 942.4),
        ("8B", "llama-3-8b", 64, 96, EIGHT_B_TP8, False, ("compiled",), 4378),
        ("8B", "llama-3-8b", 64, 96, EIGHT_B_TP8, False, ("compiled", "tp_overlap"), 4809.4),
        ("8B", "llama-3-8b", 64, 96, EIGHT_B_TP8, False, ("compiled", "fp8"), 5078.1),
        ("8B", "llama-3-8b", 64, 96, EIGHT_B_TP8, False, ("compiled", "fp8", "tp_overlap"), 5570.1),
    )
] + [
    torchtitan_run("8B", "llama-3-8b", gpus, 2 * gpus, {"dp": gpus, "micro_batch": 2}, False, ("compiled", "fp8"),
                   tokens_per_second, memory_gib, source="Trainy H200 (torchtitan benchmarks)", gpu="h200",
                   whole_loss=True, compiled_loss=True)
    for gpus, tokens_per_second, memory_gib in ((32, 10938, 47.96), (64, 10753, 46.97))
] + [
    torchtitan_run("8B", "llama-3-8b", 8, 8, {"dp": 8, "micro_batch": 1}, False, options, tokens_per_second,
                   memory_gib, source="torchao float8 (README)", whole_loss=True)
    for options, tokens_per_second, memory_gib in ((("compiled",), 6150, 47.65), (("compiled", "fp8"), 7689.5, 47.77))
]  # fmt: skip


# Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4): H100s, tp 8 x pp 16, sequence 8192, 16M
# tokens a step, BF16 TFLOP/s per GPU as published; gradients and optimizer states sharded over the data-parallel
# ranks with the parameters whole (the distributed optimizer), an interleaved schedule they tuned, communication
# overlapped (Megatron-Core's runtime, the nearest modelled). No activation checkpointing: section 3.3.2 says its
# pipeline's memory work (a layer fewer on the first and last stages, each stage's input and output freed once used)
# let it pre-train at 8K tokens without. The planner's memory model puts that layout well past 80 GB (each rank's
# micro batches in flight of its layers whole), so the rows are checked as run (`memory_as_run`). The
# context-parallel row (sequence 131,072) is left out: the planner has no context parallelism.
LLAMA3_405B = [
    TunedRun(
        "Llama 3 405B (Table 4)",
        "405B",
        config,
        "h100",
        gpus,
        2048,
        8192,
        tflops * 1e12 / model_flops_per_token(config, 8192),
        (
            ("tp", 8),
            ("pp", 16),
            ("dp", gpus // 128),
            ("strategy", "zero1"),
            ("stack", "megatron-core"),
            ("checkpointing", False),
            ("selective", False),
        ),
        memory_as_run=True,
    )  # fmt: skip
    for gpus, tflops in ((8192, 430), (16384, 400))
    for config in [llama("llama-3.1-405b")]
]


def compare_tuned(runs: list[TunedRun]) -> list[dict]:
    """Each run's predicted MFU: the fastest layout that fits its GPUs under what it states, beside the published."""
    from training.plan.layouts import plan

    out = []
    for run in runs:
        gpus = cluster(run.gpu, run.gpus, memory_gib=math.inf if run.memory_as_run else None)
        result = plan(run.config, gpus, run.batch, run.seq_len, dict(run.stated), True)
        if not result["layouts"]:
            raise ValueError(f"{run.source} {run.parameters}: no layout under {dict(run.stated)} fits its GPUs")
        best = result["layouts"][0]
        seconds = {k: best[k] for k in ("step_seconds", "bubble_seconds", "communication_seconds")}
        error = best["tokens_per_second_per_gpu"] / run.tokens_per_second_per_gpu - 1
        out.append(dict(source=run.source, parameters=run.parameters, layout=best["layout"], gpus=run.gpus,
                        gpu=run.gpu, published_mfu=run.mfu, predicted_mfu=run.mfu * (1 + error), error=error,
                        memory_gib=best["memory_gib"], memory_as_run=run.memory_as_run,
                        published_memory_gib=run.published_memory_gib, **seconds))  # fmt: skip
    return out


def calibrate() -> dict[str, float]:
    """The matrix units' efficiency per GPU kind and ELEMENTWISE_ACCESSES, solved by least squares (relative error)
    from CALIBRATION: on one node, nothing exposed, 1 / MFU = 1 / efficiency + peak x memory-bound seconds per model
    FLOP (step_compute.compute_seconds), linear in (1 / efficiency of each kind, ELEMENTWISE_ACCESSES)."""
    kinds = sorted({run.gpu for run in CALIBRATION})
    rows, targets = [], []
    for run in CALIBRATION:
        config, gpus = gpt_config(run, MPT_VOCAB), cluster(run.gpu, run.gpus)
        per_flop = gpus.peak_flops / (model_flops_per_token(config, SEQ_LEN) * gpus.hbm_bw)  # per HBM byte
        y = 1 / run.mfu - per_flop * ACTIVATION_BYTES * VOCAB_ACCESSES * config.vocab_size
        per_access = per_flop * ACTIVATION_BYTES * config.hidden_size * config.num_hidden_layers
        rows.append([float(run.gpu == k) / y for k in kinds] + [per_access / y])
        targets.append([1.0])
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64))
    *inverse, accesses = solution.solution.flatten().tolist()
    return {**{k: 1 / u for k, u in zip(kinds, inverse, strict=True)}, "elementwise_accesses": accesses}


def gpt_config(run: PublishedRun | FSDPRun, vocab: int = VOCAB, attention_dropout: float = 0.0) -> ShardGPTConfig:
    """The run's GPT (or MPT) as this project's model: the same matrices (module docstring, `megatron_gpt`)."""
    return megatron_gpt(run.heads, run.hidden, run.layers, vocab, SEQ_LEN, attention_dropout)


def megatron_flops(run: PublishedRun) -> float:
    """FLOPs of one step by the paper's equation 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    b, s, l, h = run.batch, SEQ_LEN, run.layers, run.hidden
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + run.vocab / (16 * l * h))


def run_layout(run: PublishedRun) -> Layout:
    """The run's layout: its degrees, its micro batch under a pipeline (one sequence where the table is silent; the
    whole share of the batch otherwise, one micro batch a step), activation checkpointing on, under the runtime of
    2021 (Megatron-LM's and Megatron-DeepSpeed's: step_layout.STACKS)."""
    dp = run.gpus // (run.tp * run.pp)
    micro = run.micro_batch if run.pp > 1 else run.batch // dp
    return Layout(
        run.strategy, dp, run.tp, run.pp, 1, "1F1B", micro, run.batch // (dp * micro), True, stack="megatron-lm-2021"
    )


def compare(runs: list[PublishedRun]) -> list[dict]:
    """Each run's predicted TFLOP/s per GPU (the paper's FLOPs over the predicted step), beside the published."""
    out = []
    for run in runs:
        layout = run_layout(run)
        config = gpt_config(run, run.vocab, attention_dropout=ATTENTION_DROPOUT)
        gpus = cluster("a100-80gb", run.gpus, inter_node_gbps=run.inter_node_gbps)
        row = predict_step(config, gpus, layout, SEQ_LEN, attn_implementation="eager")
        predicted = megatron_flops(run) / row["step_seconds"] / run.gpus / 1e12
        seconds = {k: row[k] for k in ("step_seconds", "bubble_seconds", "communication_seconds")}
        out.append(dict(source=run.source, parameters=run.parameters, layout=layout.name, sharding=layout.sharding,
                        gpus=run.gpus, batch=run.batch, published_tflops=run.tflops_per_gpu, predicted_tflops=predicted,
                        error=predicted / run.tflops_per_gpu - 1, **seconds))  # fmt: skip
    return out


def compare_mfu(runs: list[FSDPRun]) -> list[dict]:
    """Each FSDP run's predicted MFU on its GPUs, beside the published."""
    out = []
    for run in runs:
        layout = Layout("fsdp", run.gpus, micro_batch=run.micro_batch, micro_batches=run.accumulation,
                        checkpointing=run.checkpointing)  # fmt: skip
        row = predict_step(gpt_config(run, MPT_VOCAB), cluster(run.gpu, run.gpus), layout, SEQ_LEN)
        seconds = {k: row[k] for k in ("step_seconds", "communication_seconds")}
        out.append(dict(source=run.source, parameters=run.parameters, layout=layout.name, gpus=run.gpus, gpu=run.gpu,
                        published_mfu=run.mfu, predicted_mfu=row["mfu"], error=row["mfu"] / run.mfu - 1,
                        **seconds))  # fmt: skip
    return out
