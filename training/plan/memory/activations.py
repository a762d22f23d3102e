"""Activations, logits and temporary buffers per rank: the formulas of docs/memory.md, for a micro batch, with
and without activation checkpointing, and the buffers each strategy adds for a step (gradient buckets, gathered
parameters, AdamW's temporaries).
"""

from __future__ import annotations

import math

from model import ShardGPTConfig
from training.plan.memory.layout import BYTES, Layout, offload_device
from training.plan.memory.states import Item, zero3_groups, zero12_partitions
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- activations


def activation_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, checkpointing: bool,
                     tp: int = 1, sp: int = 1, sequence_parallel: bool = False,
                     gathered: bool = False) -> int:  # fmt: skip
    """Tensors autograd saves for the backward (not the loss's: see `saved_loss_bytes`), at the start of the
    backward.

    Per decoder layer and token, with h hidden, g = key/value heads x head_dim, f ffn, a heads, e bytes of
    the compute dtype:
      e (6h + 2g + 4f) + 8h + 4a + 8
    = each RMSNorm: its fp32 input (4h), 1/rms (4), the normalised input and the output (2 e h);
      attention: q after rotary and the output (2 e h), k after rotary and v with their own heads (2 e g:
      SDPA reads grouped-query heads itself, `enable_gqa`), saved by SDPA (flash and memory-efficient
      kernels keep no T x T matrix) and its fp32 log-sum-exp (4a); o_proj reads SDPA's output itself;
      MLP: gate and up outputs, silu(gate) and the product (4 e f).
    Once per forward: the token ids (8), the final norm (4h + 4 + e h: the chunked loss keeps no copy of its
    output) per token; rotary cos and sin (2 e head_dim) per position, shared by the batch.
    With activation checkpointing each layer keeps only its input (e h per token) and one layer at a time
    is recomputed in the backward with all of its activations.
    Under tensor parallelism (`tp` ranks) each rank attends with a/tp heads and computes f/tp of the MLP, so
    q, the attention output, k, v, the log-sum-exp and the MLP's four tensors are 1/tp as large; the norms'
    tensors stay whole: e (4h + (2h + 2g + 4f) / tp) + 8h + 4a / tp + 8 (measured to the byte at tp 2 and 4:
    training/measure/tensor_memory.py). Under Megatron's sequence parallelism (`sequence_parallel`) the norms' tensors
    and a layer's input are on sequence shards of the tp ranks too, and so are the column-split projections' inputs
    (Megatron's layout: gathered again in the backward, training/axes/tensor/plan.save_sequence_shards); torch's
    DTensor styles keep them whole (`gathered`: a compiled layer, and the layer being recomputed under activation
    checkpointing: `layer_activation_bytes`).
    Under Ulysses sequence parallelism (`sp` ranks) a rank holds seq_len / sp positions of each sequence
    (`ulysses_layer_bytes`), and rotary's cos and sin are per sample (the loader passes each slice's positions).
    """
    c = config
    tokens = micro_batch * seq_len // sp
    layer = layer_activation_bytes(c, e, tp, sequence_parallel, gathered) if sp == 1 else ulysses_layer_bytes(c, e, sp)
    once = 8 + final_norm_bytes(c, e)
    split = tp if sequence_parallel else 1  # a layer's input, on a sequence shard under sequence parallelism
    kept = e * c.hidden_size // split if checkpointing else layer  # per layer: its input only, or all it saves
    # the one layer being recomputed in the backward, in torch's layout (the recomputation gathers its inputs whole)
    torch_layout = layer_activation_bytes(c, e, tp, sequence_parallel, gathered=True) if sp == 1 else layer
    recomputed = torch_layout if checkpointing else 0
    rotary = rotary_bytes(c, seq_len, e) if sp == 1 else rotary_bytes(c, tokens, e)
    return (c.num_hidden_layers * kept + recomputed + once) * tokens + rotary


def ulysses_layer_bytes(config: ShardGPTConfig, e: int, sp: int) -> int:
    """What one decoder layer saves per position a rank holds under Ulysses over `sp` ranks: the layer's own
    (`layer_activation_bytes`), where after the all-to-all each rank attends over all positions with heads / sp
    query heads (q, the output and the log-sum-exp: the same bytes) and kv / sp key-value heads, or one head
    replicated when sp exceeds kv (k and v: 2 e head_dim max(kv, sp) per position held); plus o_proj's input, the
    output traded back to this rank's positions (e h), a tensor apart from the one SDPA saved."""
    kv = config.num_key_value_heads
    replicated = 2 * e * config.head_dim * (max(kv, sp) - kv)
    return layer_activation_bytes(config, e) + replicated + e * config.hidden_size


def layer_activation_bytes(config: ShardGPTConfig, e: int, tp: int = 1, sequence_parallel: bool = False,
                           gathered: bool = False) -> int:  # fmt: skip
    """What one decoder layer saves per token: e (4h + (2h + 2g + 4f) / tp) + 8h + 4a / tp + 8 (`activation_bytes`).

    With Megatron's sequence parallelism the norms' tensors are on sequence shards too. Each column-split projection
    (q, k, v; gate, up) saves its input, the norm's output, which the region's all-gather made whole. Megatron-LM
    saves the shard and gathers it again in the backward (Korthikanti et al. 2022, section 4.2.2), and so does this
    project's runtime (training/axes/tensor/plan.save_sequence_shards): all of it over tp, (e (6h + 2g + 4f) + 8h +
    4a + 8) / tp, their sbh (34 / t + 5as / ht) for a GPT layer. torch's DTensor styles save the gathered input
    (`gathered`: a compiled layer, a recomputed one): e (2h + (4h + 2g + 4f) / tp) + (8h + 4a + 8) / tp. Both
    measured to the byte at tp 2 and 4 (training/measure/tensor_memory.py)."""
    h, f, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    g = config.num_key_value_heads * config.head_dim
    if sequence_parallel and gathered:
        return (e * (4 * h + 2 * g + 4 * f) + 8 * h + 4 * a + 8) // tp + 2 * e * h
    if sequence_parallel:
        return (e * (6 * h + 2 * g + 4 * f) + 8 * h + 4 * a + 8) // tp
    return e * (4 * h + (2 * h + 2 * g + 4 * f) // tp) + 8 * h + 4 * a // tp + 8


def selective_layer_bytes(config: ShardGPTConfig, e: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """What one decoder layer keeps per token under torch's per-op selective recomputation as torchtitan's policy
    runs it (`_save_list`: the outputs of attention, of the reduce-scatters and of every other matrix multiply are
    kept, everything else recomputed): the layer's input (what the checkpoint keeps: a sequence shard under sequence
    parallelism), q, v and gate (the first, third and fifth matrix multiplies, over tp), the down projection's output
    (the seventh: whole, under tensor parallelism the partial sum before its reduction), attention's output with its
    fp32 log-sum-exp (over tp) and, under sequence parallelism, the two reduce-scatters' outputs (sequence shards):
    e (2h + (q + g + f) / tp) + (e q + 4a) / tp without sequence parallelism, q = a x head_dim. Measured to the byte
    on CPU at tp 1, and at tp 2 with and without sequence parallelism (training/measure/tensor_memory.py's `selective`:
    the policy's kept outputs and the checkpoint's input, per layer and token; tests/recipes/test_plan_memory.py)."""
    h, f, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    q, g = a * config.head_dim, config.num_key_value_heads * config.head_dim
    split = tp if sequence_parallel else 1
    kept = e * h // split + e * (q + g + f) // tp + e * h + (e * q + 4 * a) // tp
    return kept + (2 * e * h // tp if sequence_parallel and tp > 1 else 0)


def final_norm_bytes(config: ShardGPTConfig, e: int) -> int:
    """What the final norm saves per token: its fp32 input, 1/rms and its normalised input (4h + 4 + e h)."""
    return 4 * config.hidden_size + 4 + e * config.hidden_size


def rotary_bytes(config: ShardGPTConfig, seq_len: int, e: int) -> int:
    """Rotary cos and sin, (1, T, head_dim) each, computed once per forward and shared by the batch and layers."""
    return 2 * e * config.head_dim * seq_len


LOSS_CHUNK = 1024  # tokens per chunk of the model's chunked cross-entropy (`ShardGPTLMHead.chunk_size`)


def logits_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, tp: int = 1) -> int:
    """The chunked cross-entropy at its largest, in the forward's last chunk (the model's `ChunkedCrossEntropy`;
    the (tokens, vocab) logits never exist): what it saves for the backward (`saved_loss_bytes`), plus one
    chunk's fp32 logits (turned into their gradient in place) and that gradient in the compute dtype,
    (4 + e) x chunk x vocab, and the chunk's (vocab, hidden) weight-gradient product before it is added. Over `tp`
    vocabulary shards (training/axes/tensor/vocab.vocab_parallel_cross_entropy) a tp-th of every vocabulary-wide
    tensor."""
    return saved_loss_bytes(config, micro_batch, seq_len, e, tp) + loss_chunk_bytes(config, micro_batch, seq_len, e, tp)


def loss_chunk_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, tp: int = 1) -> int:
    """One chunk of the chunked cross-entropy at work (`logits_bytes` without what it saves): its fp32 logits and
    their gradient in the compute dtype, (4 + e) x chunk x vocab, and its weight-gradient product, e x vocab x
    hidden; the vocabulary a tp-th over `tp` shards."""
    chunk = min(LOSS_CHUNK, micro_batch * seq_len)
    v, h = config.vocab_size // tp, config.hidden_size
    return (4 + e) * chunk * v + e * v * h


def whole_logits_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, compiled: bool = False) -> int:
    """The loss without chunks, on the whole (tokens, vocab) logits in the compute dtype upcast to fp32 (the model's
    when tensor parallelism replaced its head, DeepSpeed AutoTP's vocabulary-parallel layer; torchtitan's): eager,
    the logits, the fp32 log-probabilities cross-entropy saves and their fp32 gradient, (e + 8) x tokens x vocab at
    most; compiled, inductor's fused kernels save the logits themselves (and a log-sum-exp a token) and write their
    gradient in the compute dtype, 2e x tokens x vocab. What each saves is measured on CPU
    (tests/recipes/test_plan_memory.py: 4 and e bytes an entry)."""
    per_entry = 2 * e if compiled else e + 8
    return per_entry * micro_batch * seq_len * config.vocab_size


def saved_loss_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, tp: int = 1) -> int:
    """What the chunked loss saves from its forward for the backward: the gradient of the hidden states (e bytes
    per token and hidden unit) and the fp32 gradient of the head's weight (4 x vocab x hidden), of its vocabulary
    rows over `tp` shards."""
    return e * micro_batch * seq_len * config.hidden_size + 4 * (config.vocab_size // tp) * config.hidden_size


# ---------------------------------------------------------------------------------------------- temporaries


def temporaries(lay: Layout, strategy: Strategy, world: int, precision: str, zero: dict | None) -> list[Item]:
    """Buffers that exist only for part of a step, at their largest; summed as if they coincided."""
    e = BYTES[precision]
    items: list[Item] = []
    largest_param = max(lay.numels)
    if strategy.family == "ddp":
        if precision != "fp32":
            items.append(Item("buffers", "autocast_weight_copies", e * lay.psi))  # saved for the backward
        return items
    if strategy.family == "fsdp":
        root = sum(lay.numels[i] for i in lay.root)
        if strategy.fsdp_sharding == "SHARD_GRAD_OP":  # every unit stays unsharded from its forward to its backward
            items.append(Item("buffers", "unsharded_params", e * lay.psi))
        else:  # the root unit stays gathered (FSDP2 never reshards the root), plus a layer and its prefetch
            items.append(Item("buffers", "unsharded_params", e * (root + 2 * lay.layer_numel)))
        # Unsharded gradients: the tied lm_head/embedding's from the first op of the backward to the last,
        # one layer's at a time, and its reduce-scatter input (reduce dtype = compute dtype).
        items.append(Item("buffers", "unsharded_grads", e * (root + 2 * lay.layer_numel)))
        return items
    bucket = int(zero["reduce_bucket_size"])
    stage = int(zero["stage"])
    if stage in (1, 2):
        parts = zero12_partitions(lay, world, 0)
        buffers = 2 if zero["overlap_comm"] else 1
        items.append(Item("buffers", "reduce_buckets", buffers * bucket * e))
        if offload_device(zero, "offload_optimizer") != "none":
            items.append(Item("buffers", "offload_grad_staging", e * largest_param))
            items.append(Item("buffers", "offload_grad_staging", e * largest_param, "host"))
            return items
        if stage == 1:  # the partition's copy is filled while the whole gradients still exist
            kept = max(sum(k for _, _, k in zero12_partitions(lay, world, r)) for r in {0, world - 1})
            items.append(Item("buffers", "grads_in_partition", e * kept))
        else:  # a gradient larger than a bucket is reduced on its own
            items.append(Item("buffers", "grads_in_flight", e * largest_param if largest_param > bucket else 0))
        # The step flattens a group's gradient partition and converts it to fp32.
        largest_part = max(p for _, p, _ in parts)
        items.append(Item("buffers", "fp32_grad_partition", (4 + (e if e != 4 else 0)) * largest_part))
        return items
    # ZeRO-3: one reduce bucket, the module being computed gathered whole plus the prefetch bucket, its
    # whole gradient before the reduce-scatter, and the step's fp32 copy of a sub-group's gradients.
    items.append(Item("buffers", "reduce_buckets", bucket * e))
    gathered = lay.largest_module + int(zero["stage3_prefetch_bucket_size"])
    items.append(Item("buffers", "gathered_params", e * gathered))
    items.append(Item("buffers", "grads_in_flight", e * lay.largest_module))
    if offload_device(zero, "offload_optimizer") == "none":  # flattened in the accumulation dtype, then fp32
        largest_sub = max(zero3_groups(lay, world, zero["sub_group_size"]))
        g = zero["grad_accum_bytes"]
        items.append(Item("buffers", "fp32_grad_partition", (g + (4 if g != 4 else 0)) * largest_sub))
    if offload_device(zero, "offload_param") == "nvme":
        swap = zero["offload_param"]
        items.append(Item("buffers", "param_swap_buffers", e * swap["buffer_count"] * swap["buffer_size"], "host"))
    if offload_device(zero, "offload_optimizer") == "nvme":
        largest_sub = max(zero3_groups(lay, world, zero["sub_group_size"]))
        count = zero["offload_optimizer"].get("buffer_count", 4)
        items.append(Item("buffers", "optimizer_swap_buffers", 4 * count * largest_sub, "host"))
    return items


def adam_temporaries(lay: Layout, strategy: Strategy, world: int, zero: dict | None, e: int) -> Item:
    """torch's unfused AdamW (the training script fuses it only on GPUs) steps one tensor at a time and holds two
    fp32 temporaries of its size (sqrt of exp_avg_sq, and that divided by the bias correction; measured on CPU):
    the largest tensor it steps is a parameter (DDP), a local shard (FSDP), a group's flat fp32 partition
    (ZeRO-1/2) or a sub-group's (ZeRO-3). DeepSpeed's CPU Adam (offload) updates in place."""
    if strategy.family == "deepspeed" and strategy.offloads:
        return Item("buffers", "adam_temporaries", 0)
    if strategy.family == "ddp":
        largest = max(lay.numels)
    elif strategy.family == "fsdp":
        largest = max(math.ceil(rows / world) * (n // rows) for n, rows in zip(lay.numels, lay.rows, strict=True))
    elif strategy.zero_stage in (1, 2) and strategy.tp_size == 1:  # (AutoTP's ZeRO-1: the sub-group bound below)
        # Before the step DeepSpeed frees the partition's gradients (counted as grads) and, in bf16/fp16, their
        # flattened copy in the model dtype (part of fp32_grad_partition): Adam's temporaries take their place.
        _, part, kept = max(zero12_partitions(lay, world, 0), key=lambda g: g[1])
        freed = e * kept + (e * part if e != 4 else 0)
        return Item("buffers", "adam_temporaries", max(0, 8 * part - freed))
    else:
        largest = max(zero3_groups(lay, world, zero["sub_group_size"]))
    return Item("buffers", "adam_temporaries", 8 * largest, "host" if strategy.offloads else "gpu")
