"""A step's compute on the busiest GPU of a layout (training/plan/step_layout.py), for the step-time planner: the
matrix multiplies' FLOPs at the GPU kind's efficiency (PaLM's 6 N + 12 L h T a token, `training/flops.py`), and the
memory-bound kernels' bytes at its HBM bandwidth (norms, activations, residuals, the loss's softmax, attention scores
where they are written out), with fp8's casts and selective recomputation's re-run GEMMs; the model's slice a rank
holds (`rank_shape`)."""

from __future__ import annotations

from model import ShardGPTConfig
from training.flops import flops_per_token
from training.plan.communication import ModelShape
from training.plan.hardware import Cluster
from training.plan.ring import ACTIVATION_BYTES
from training.plan.step_layout import Layout

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
# Counted from the eager kernels of this model's layer, the same accesses come to 219 (forward 73: each RMSNorm's
# upcast, square, mean, scale, downcast and weight 18 x 2, rotary on q and k 18, SwiGLU on 8h/3 13.3, two residual adds
# 6; a backward twice that): the calibration's figure. torch.compile fuses each chain into one kernel that reads its
# inputs and writes its outputs once: forward 20 (each norm with the residual add before it 4 x 2, rotary 4, SwiGLU
# 3 x 8/3), backward 25.3 (norms 4 x 2, rotary 4, SwiGLU 5 x 8/3): 45.3, counted, not fitted.
COMPILED_ELEMENTWISE_ACCESSES = 45.3
VOCAB_ACCESSES = 15
# Of ELEMENTWISE_ACCESSES, the share on hidden-wide tensors, which tensor parallelism does not split: a layer's
# forward reads and writes its two norms' (2 x 2) and its two residual adds' (2 x 3) per hidden unit, 10, against the
# MLP activation's 8 on the split inner width (GELU on 4h, or SwiGLU reading 2 x 8h/3 and writing 8h/3).
REPLICATED_SHARE = 10 / 18
SCORE_ACCESSES = {"forward": 4, "backward": 6}
DROPOUT_ACCESSES = {"forward": 2.5, "backward": 2.5}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# fp8: the decoder layers' linear layers at the GPU's dense fp8 peak (FP8_SPEEDUP x bf16's on H100/H200: 1979 and
# 989 TFLOP/s in the data sheet), at the same share of it; attention and the head stay bf16 (torchtitan's float8
# converts the layers' nn.Linear, not the output head; FlashAttention in bf16). Dynamic tensorwise scaling casts each
# GEMM's operands per token (`fp8_cast_accesses`): a linear layer's input in the forward and its output's gradient in
# the backward, each read for its amax and read again and written in fp8 (2.5 two-byte accesses an element), and
# both again in the transposed layout the weight's gradient GEMM takes (1.5); q, k and v each cast their (shared)
# input, as gate and up do.
# Selective recomputation as torch's selective activation checkpointing runs it (torchtitan's "op" policy,
# `_custom_policy` with `_save_list` in parallelize_llama.py, the same at 9dec370, 820504e and e7c0cae): the outputs
# of attention, of the reduce-scatters and of every other `aten.mm` of a layer's forward are kept (the count's odd
# ones: q, v, gate and down in the forward's order q, k, v, o, gate, up, down), the rest of the forward runs again in
# the backward: every memory-bound kernel and the even GEMMs, k, o and up (`selective_recomputed_gemms`; o's output
# rebuilds the residual the second norm takes, compiled or not).
FP8_SPEEDUP = 2.0


def model_flops_per_token(config: ShardGPTConfig, seq_len: int) -> float:
    """PaLM's 6 N + 12 L h T: the model FLOPs MFU counts."""
    return flops_per_token(config, seq_len)


def memory_bound_bytes_per_token(config: ShardGPTConfig, seq_len: int, checkpointing: bool,
                                 attn_implementation: str = "sdpa", compiled: bool = False) -> float:  # fmt: skip
    """HBM bytes per token of a step's memory-bound kernels (ELEMENTWISE_ACCESSES, or compiled its fused count, and
    its neighbours)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        known = ", ".join(ATTN_IMPLEMENTATIONS)
        raise ValueError(f"attn_implementation {attn_implementation!r}: choose one of {known}")
    forwards = 2 if checkpointing else 1  # the recomputed forward
    layer = elementwise_accesses(compiled) * config.hidden_size * (forwards + 2) / 3
    if attn_implementation == "eager":
        dropout = getattr(config, "attention_dropout", 0.0) > 0  # a Llama config.json field; this model has none
        passes = {k: v + (DROPOUT_ACCESSES[k] if dropout else 0) for k, v in SCORE_ACCESSES.items()}
        layer += config.num_attention_heads * seq_len * (forwards * passes["forward"] + passes["backward"])
    return ACTIVATION_BYTES * (config.num_hidden_layers * layer + VOCAB_ACCESSES * config.vocab_size)


def elementwise_accesses(compiled: bool) -> float:
    """Memory-bound accesses per hidden unit and layer over a forward and a backward, eager or compiled."""
    return COMPILED_ELEMENTWISE_ACCESSES if compiled else ELEMENTWISE_ACCESSES


def compute_seconds(config: ShardGPTConfig, cluster: Cluster, layout: Layout, seq_len: int,
                    attn_implementation: str = "sdpa") -> float:  # fmt: skip
    """One step's compute on the busiest GPU: the matrix multiplies' FLOPs (PaLM's, one more forward with
    checkpointing) at the efficiency, and the memory-bound kernels' bytes at HBM bandwidth. Each GPU runs its stage's
    layers over its replica's tokens, split over tp (but the hidden-wide kernels, REPLICATED_SHARE, unless Megatron's
    sequence parallelism splits them over the sequence) and sp; under a pipeline the busiest stage is the last, whose
    share of the layers is rounded up and which also runs the head and the loss (its step sets the pipeline's pace).
    With fp8 the layers' linear layers run at FP8_SPEEDUP x the peak, plus their casts."""
    tokens = layout.micro_batch * layout.micro_batches * seq_len / layout.sp  # a GPU's, of its replica's batch
    forwards = 2 if layout.checkpointing else 1
    passes = (forwards + 2) / 3
    recomputed = layout.checkpointing or layout.selective  # the memory-bound kernels' forward runs twice
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_flops = 6 * vocab * h  # the head's matmul (tied to the embedding or not, it is one)
    layer_flops = (model_flops_per_token(config, seq_len) - head_flops) / layers
    head_bytes = ACTIVATION_BYTES * VOCAB_ACCESSES * vocab
    layer_bytes = (memory_bound_bytes_per_token(config, seq_len, recomputed, attn_implementation,
                                                layout.compiled) - head_bytes) / layers  # fmt: skip
    replicated = ACTIVATION_BYTES * REPLICATED_SHARE * elementwise_accesses(layout.compiled) * h * (3 + recomputed) / 3
    if layout.fp8:
        layer_bytes += ACTIVATION_BYTES * fp8_cast_accesses(config)
    stage = layout.stage_layers(config)
    gemms = 6 * layer_parameters(config)  # a layer's linear layers, what fp8 speeds up
    linear = gemms / FP8_SPEEDUP if layout.fp8 else gemms
    flops = (stage * (layer_flops - gemms + linear) + head_flops) * passes
    if layout.selective:  # the policy's even GEMMs of the forward again
        flops += stage * selective_recomputed_gemms(config) * linear / 3
    flops /= layout.tp
    split = layout.tp if layout.sequence_parallel else 1  # what the hidden-wide kernels split over
    memory = stage * (layer_bytes / layout.tp + replicated * (1 / split - 1 / layout.tp))
    memory += head_bytes / layout.tp
    return tokens * (flops / (cluster.peak_flops * cluster.efficiency) + memory / cluster.hbm_bw)


def layer_gemms(config: ShardGPTConfig) -> dict[str, int]:
    """A decoder layer's linear layers in its forward's order, each one's matrix elements."""
    h, f = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, g = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"q": h * q, "k": h * g, "v": h * g, "o": q * h, "gate": h * f, "up": h * f, "down": f * h}


def selective_recomputed_gemms(config: ShardGPTConfig) -> float:
    """The share of a layer's linear FLOPs that selective recomputation runs again: the even GEMMs of its forward
    (the second, fourth and sixth: k, o and up), for Llama 3 8B 36.5%, where a GEMM of every two would be half."""
    sizes = list(layer_gemms(config).values())  # in the forward's order
    return sum(sizes[1::2]) / sum(sizes)


def fp8_cast_accesses(config: ShardGPTConfig) -> float:
    """Two-byte accesses per token and layer of fp8's casts (FP8_SPEEDUP above): the linear layers' inputs (q, k, v
    each of h, o of h, gate and up each of h, down of f: 6h + f) and their outputs' gradients (q and o of h, k and v
    of g, gate and up of f, down of h: 3h + 2g + 2f), 2.5 + 1.5 accesses an element each."""
    h, f = config.hidden_size, config.intermediate_size
    g = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    return (2.5 + 1.5) * ((6 * h + f) + (3 * h + 2 * g + 2 * f))


def layer_parameters(config: ShardGPTConfig) -> int:
    """One decoder layer's matrix elements (its linear layers'; the norms apart)."""
    return ModelShape.of(config).matrices // config.num_hidden_layers


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
