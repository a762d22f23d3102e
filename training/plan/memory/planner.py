"""The planner's model: the memory one rank needs to train shardgpt under each strategy, before any GPU is rented.

Per rank: parameters, gradients, optimizer states (fp32 master copies and Adam's moments), activations, logits
and temporary buffers; for offload, host RAM and NVMe. `predict()` returns them as a dict; `recipes/plan_memory.py`
prints them.

Model states (parameters, gradients, optimizer states) are counted exactly as DDP, FSDP2 and DeepSpeed 0.19
allocate them for this model, tensor by tensor: DeepSpeed's flat buffers and their alignment, the ZeRO-1/2
gradient partition that holds every gradient touching a rank's partition whole, ZeRO-3's persistent small
parameters, FSDP2's padded shards, DDP's gradient buckets, Adam's step counters. `training/plan/memory/ledger.py`
counts the same on 2 CPU ranks, and `tests/recipes/test_memory.py` checks that both agree to the byte.
Activations, logits and temporaries follow the formulas in docs/memory.md.

Tensor parallelism (DeepSpeed AutoTP, `zero1-autotp`): every module of the model's tp plan holds 1/tp of its
weight on each rank (q, k, v, gate, up and the vocabulary-parallel embedding and tied head by rows, o and down by
columns), the norms stay whole; ZeRO-1 then partitions that local model over the world / tp data-parallel ranks.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import sys
from dataclasses import dataclass

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.adamw import param_groups
from training.config import RunConfig
from training.parallel.deepspeed_config import (
    autotp_size,
    cpu_capped,
    gradient_reduction_dtype,
    load_json,
    resolve_deepspeed,
)
from training.parallel.mesh import Mesh
from training.parallel.schedules import check_pipeline, stage_layers
from training.parallel.strategy import Strategy
from training.paths import ROOT

# The strategies the planner models, by name (`Strategy.name`); each ZeRO one with the repo's JSON for it.
STRATEGIES = (
    "ddp", "fsdp", "fsdp-shard-grad-op", "fsdp-offload", "zero1", "zero2", "zero2-offload-cpu", "zero3",
    "zero3-offload-cpu", "zero3-offload-nvme", "zero1-autotp",
)  # fmt: skip
DS_CONFIGS = {
    "zero1": "zero1.json", "zero2": "zero2.json", "zero2-offload-cpu": "zero2_offload.json", "zero3": "zero3.json",
    "zero3-offload-cpu": "zero3_offload_cpu.json", "zero3-offload-nvme": "zero3_offload_nvme.json",
    "zero1-autotp": "autotp.json",
}  # fmt: skip
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30


# ---------------------------------------------------------------------------------------------- the model


@dataclass
class Layout:
    """The parameters as the training script builds them: sizes in `named_parameters()` order, the optimizer's
    groups (decay / no decay, indices into `numels`), FSDP's units and the modules ZeRO-3 gathers."""

    config: ShardGPTConfig
    names: list[str]
    numels: list[int]
    rows: list[int]  # dim 0, which FSDP2 shards
    groups: list[list[int]]
    root: list[int]  # the FSDP root unit: parameters outside every decoder layer
    layer_numel: int  # one decoder layer (every layer has the same shape)
    largest_module: int  # the most parameters one module owns (ZeRO-3 gathers module by module)

    @property
    def psi(self) -> int:
        return sum(self.numels)


_LAYOUTS: dict[tuple[str, bool, int], Layout] = {}  # by the config's JSON: the step-time planner asks hundreds of times


def layout(config: ShardGPTConfig, decay_embeddings: bool = False, tp: int = 1) -> Layout:
    """The whole model's layout, or with `tp` > 1 one tensor-parallel rank's: its slice of every split weight."""
    key = (config.to_json_string(use_diff=False), decay_embeddings, tp)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _build_layout(config, decay_embeddings, tp)
    return copy.deepcopy(_LAYOUTS[key])


def _build_layout(config: ShardGPTConfig, decay_embeddings: bool, tp: int) -> Layout:
    with torch.device("meta"):  # shapes only: no memory, fast for any size
        net = ShardGPTForCausalLM(config)
    named = list(net.named_parameters())  # tied lm_head / embedding listed once, as DeepSpeed and DDP see them
    index = {id(p): i for i, (_, p) in enumerate(named)}
    groups = [[index[id(p)] for p in g["params"]] for g in param_groups(net, 0.1, decay_embeddings)]
    root = [i for i, (name, _) in enumerate(named) if ".layers." not in f".{name}"]
    shapes = [tensor_parallel_shape(name, tuple(p.shape), net.tp_plan, tp) for name, p in named]
    layer = sum(math.prod(s) for (name, _), s in zip(named, shapes, strict=True) if name.startswith("model.layers.0."))
    by_module: dict[str, int] = {}
    for (name, _), shape in zip(named, shapes, strict=True):
        module = name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + math.prod(shape)
    return Layout(
        config, [n for n, _ in named], [math.prod(s) for s in shapes], [s[0] for s in shapes],
        [g for g in groups if g], root, layer, max(by_module.values()),
    )  # fmt: skip


def tensor_parallel_shape(name: str, shape: tuple[int, ...], plan: dict[str, str], tp: int) -> tuple[int, ...]:
    """What one of `tp` ranks holds of parameter `name`: a module of the plan keeps 1/tp of its rows ("colwise",
    the vocabulary-parallel embedding and head) or of its columns ("rowwise"); the rest (the norms) stays whole."""
    module = name.rpartition(".")[0]
    style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern)), None)
    if tp == 1 or style is None:
        return shape
    dim = 1 if style == "rowwise" else 0
    if shape[dim] % tp:
        raise ValueError(f"{name} has {shape[dim]} {'columns' if dim else 'rows'}, which {tp} ranks cannot split")
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def tensor_parallel_size(strategy: Strategy, ds_config: dict | None = None) -> int:
    """Ranks each layer is split over: under AutoTP the DeepSpeed JSON's `tensor_parallel.autotp_size` (the repo's
    for the strategy when `ds_config` is None); 1 for the data-parallel strategies."""
    if strategy.tp_size == 1:
        return 1
    return autotp_size(ds_config if ds_config is not None else repo_json(strategy))


def repo_json(strategy: Strategy) -> dict:
    """The repo's DeepSpeed JSON for a ZeRO strategy the planner models."""
    return load_json(ROOT / "ds_configs" / DS_CONFIGS[strategy.name])


# ---------------------------------------------------------------------------------------------- DeepSpeed config


def zero_config(strategy: Strategy, config: ShardGPTConfig, world: int, precision: str, micro_batch: int,
                ds_config: dict | None = None, bf16_gradient_reduction: bool = False,
                cpu_ranks: bool = False) -> dict:  # fmt: skip
    """The `zero_optimization` section in force: `ds_config` (the repo's JSON for `strategy` when None) with its "auto"
    values filled exactly as the training script fills them (`training/parallel/deepspeed_config.resolve_deepspeed`),
    plus `grad_accum_bytes`: the bytes per element of `data_types.grad_accum_dtype`, in which ZeRO-3 keeps its
    gradient partitions (the training script sets it to fp32, or bf16 under --bf16_gradient_reduction)."""
    if ds_config is None:  # the repo's JSON, as a launch would resolve it (a launch's own is resolved already)
        ds_config = repo_json(strategy)
        if cpu_ranks:
            zero = ds_config["zero_optimization"]
            zero.update(cpu_capped(zero))
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype", "auto")
    if accum == "auto":
        accum = gradient_reduction_dtype(precision == "bf16", bf16_gradient_reduction)
    accum_bytes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[accum]
    zero = copy.deepcopy(ds_config.get("zero_optimization") or {})
    # Offload sections are read as they are: resolving them would check that nvme_path exists here.
    offload = {k: zero.pop(k) for k in ("offload_optimizer", "offload_param") if k in zero}
    if "auto" in zero.values():
        cfg = RunConfig(per_device_train_batch_size=micro_batch, bf16=precision == "bf16", fp16=precision == "fp16")
        zero = resolve_deepspeed({"zero_optimization": zero}, cfg, world, config.hidden_size, "(planner)")
        zero = zero["zero_optimization"]
    zero.update(offload)
    stage = int(zero.get("stage", 0))
    zero.setdefault("overlap_comm", stage == 3)  # DeepSpeed's defaults (runtime/zero/config.py)
    zero.setdefault("contiguous_gradients", True)
    zero.setdefault("reduce_bucket_size", 500_000_000)
    zero.setdefault("allgather_bucket_size", 500_000_000)
    zero.setdefault("sub_group_size", 1_000_000_000)
    zero.setdefault("stage3_prefetch_bucket_size", 50_000_000)
    zero.setdefault("stage3_param_persistence_threshold", 100_000)
    zero.setdefault("stage3_model_persistence_threshold", sys.maxsize)
    zero["grad_accum_bytes"] = accum_bytes
    return zero


def offload_device(zero: dict, key: str) -> str:
    return (zero.get(key) or {}).get("device", "none")


# ---------------------------------------------------------------------------------------------- model states


@dataclass
class Item:
    category: str  # params, master_params, grads, optimizer_states, buffers
    label: str  # the same labels as recipes/measure/measure_memory.py
    nbytes: int
    where: str = "gpu"  # gpu, host or nvme


def adam(items: list[Item], numel: int, tensors: int, where: str) -> None:
    """torch AdamW: fp32 exp_avg and exp_avg_sq per element, and a 4-byte fp32 step counter per tensor."""
    items.append(Item("optimizer_states", "adam.exp_avg", 4 * numel, where))
    items.append(Item("optimizer_states", "adam.exp_avg_sq", 4 * numel, where))
    items.append(Item("optimizer_states", "adam.step", 4 * tensors, where))


def ddp_states(lay: Layout) -> list[Item]:
    """Whole fp32 weights (accelerate's mixed precision autocasts, the weights stay fp32), whole fp32
    gradients, and the reducer's own flat gradient buckets: accelerate leaves `gradient_as_bucket_view` at
    torch's default False, so buckets are copies, not views, of the gradients."""
    psi = lay.psi
    items = [Item("params", "weights", 4 * psi), Item("grads", "param.grad", 4 * psi)]
    items.append(Item("grads", "ddp_buckets", 4 * psi))
    adam(items, psi, len(lay.numels), "gpu")
    return items


def fsdp_states(lay: Layout, world: int, rank: int, offload: bool) -> list[Item]:
    """FSDP2: each parameter's dim 0 in chunks of ceil(rows / world); a rank keeps its chunk padded to full
    size for parameters and for the reduce-scatter's gradient output (cast to fp32), while Adam's moments
    are shaped like the unpadded local shard."""
    where = "host" if offload else "gpu"
    padded = local = 0
    for numel, rows in zip(lay.numels, lay.rows, strict=True):
        chunk = math.ceil(rows / world)
        per_row = numel // rows
        padded += chunk * per_row
        local += max(0, min(chunk, rows - rank * chunk)) * per_row
    items = [Item("params", "local_shards", 4 * padded, where), Item("grads", "local_shards", 4 * padded, where)]
    adam(items, local, len(lay.numels), where)
    return items


def zero12_partitions(lay: Layout, world: int, rank: int) -> list[tuple[int, int, int]]:
    """Per optimizer group: (aligned flat size, partition size, elements of the gradients kept whole in this
    rank's partition). The flat buffer is padded to a multiple of 2 x world; a parameter whose elements
    overlap the partition [rank x P, (rank + 1) x P) has its whole gradient copied into the partition buffer."""
    out = []
    for group in lay.groups:
        numel = sum(lay.numels[i] for i in group)
        align = 2 * world
        aligned = math.ceil(numel / align) * align
        part = aligned // world
        lo, hi, at, kept = rank * part, (rank + 1) * part, 0, 0
        for i in group:
            n = lay.numels[i]
            if lo <= at < hi or at < lo < at + n:
                kept += n
            at += n
        pad = max(0, hi - max(lo, numel)) if rank == world - 1 else 0  # zeros after the last gradient
        out.append((aligned, part, kept + pad))
    return out


def zero12_states(lay: Layout, world: int, rank: int, e: int, stage: int, offload: bool,
                  accum: int = 2) -> list[Item]:  # fmt: skip
    """DeepSpeedZeroOptimizer: the model's weights become views of one flat buffer per group (model dtype),
    and this rank keeps an fp32 copy of its partition for the optimizer, also in fp32 training.
    Gradients: ZeRO-1 keeps every whole gradient until the end of the backward (the peak), ZeRO-2 only
    the gradients touching its partition. With CPU offload the partition copies live in host RAM, and the
    device keeps a flat gradient partition in the accumulation dtype (`accum` bytes, data_types.grad_accum_dtype)
    that the reduction writes into."""
    parts = zero12_partitions(lay, world, rank)
    flat = sum(a for a, _, _ in parts)
    part = sum(p for _, p, _ in parts)
    items = [Item("params", "bit16_flat", e * flat)]
    if offload:
        items += [
            Item("params", "bit16_offload_buffer", e * part, "host"),
            Item("master_params", "fp32_partitions", 4 * part, "host"),
            Item("grads", "fp32_partition.grad", 4 * part, "host"),
            Item("grads", "averaged_gradients", accum * part),
        ]
        adam(items, part, len(parts), "host")
        return items
    items.append(Item("master_params", "fp32_partitions", 4 * part))
    if stage == 1:
        items.append(Item("grads", "param.grad", e * lay.psi))
    else:
        items.append(Item("grads", "grads_in_partition", e * sum(k for _, _, k in parts)))
    adam(items, part, len(parts), "gpu")
    return items


def zero3_groups(lay: Layout, world: int, sub_group_size: int) -> list[int]:
    """Partition elements of each ZeRO-3 sub-group: a group is split once its partitions reach sub_group_size."""
    out = []
    for group in lay.groups:
        acc = 0
        for j, i in enumerate(group):
            acc += math.ceil(lay.numels[i] / world)
            if acc >= sub_group_size or j == len(group) - 1:
                out.append(acc)
                acc = 0
    return out


def persistent(lay: Layout, zero: dict) -> list[int]:
    """Parameters ZeRO-3 keeps whole on every rank: at most stage3_param_persistence_threshold elements."""
    keep, total = [], 0
    for i, n in enumerate(lay.numels):
        if n + total > zero["stage3_model_persistence_threshold"]:
            continue
        if n <= zero["stage3_param_persistence_threshold"]:
            keep.append(i)
            total += n
    return keep


def zero3_states(lay: Layout, world: int, e: int, zero: dict) -> list[Item]:
    """DeepSpeedZeroOptimizer_Stage3: each parameter's ceil(numel / world) elements in one flat buffer, the
    small persistent parameters also whole, an fp32 master copy of the partition (kept even in fp32: the
    check that would reuse fp32 partitions compares a torch.device with a device name and never matches),
    one flat gradient partition buffer in `data_types.grad_accum_dtype` (fp32 unless --bf16_gradient_reduction),
    and Adam's moments per sub-group."""
    param_where = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[offload_device(zero, "offload_param")]
    opt_where = {"none": "gpu", "cpu": "host", "nvme": "nvme"}[offload_device(zero, "offload_optimizer")]
    part = sum(math.ceil(n / world) for n in lay.numels)
    subs = zero3_groups(lay, world, zero["sub_group_size"])
    # Persistent parameters are gathered into buffers padded to a multiple of world, as every ZeRO-3 gather.
    # On one rank the partition is the whole parameter and DeepSpeed keeps no second copy.
    whole = sum(world * math.ceil(lay.numels[i] / world) for i in persistent(lay, zero)) if world > 1 else 0
    # With parameters on NVMe DeepSpeed still keeps the first offload_param.max_in_cpu elements (default 1e9)
    # of the partition in host memory for good, and swaps only the rest.
    in_cpu = min(part, int(zero["offload_param"].get("max_in_cpu", 10**9))) if param_where == "nvme" else 0
    items = [
        Item("params", "partitions_in_cpu", e * in_cpu, "host"),
        Item("params", "partitions", e * (part - in_cpu), param_where),
        Item("params", "persistent_whole", e * whole),
        Item("master_params", "fp32_partitions", 4 * part, opt_where),
        Item("grads", "grad_partitions", zero["grad_accum_bytes"] * part, "gpu" if opt_where == "gpu" else "host"),
    ]
    if opt_where != "gpu":  # offload keeps an fp32 gradient buffer per sub-group for the CPU Adam
        items.append(Item("grads", "fp32_partition.grad", 4 * part, opt_where))
    adam(items, part, len(subs), opt_where)
    return items


def model_states(lay: Layout, strategy: Strategy, world: int, rank: int, precision: str,
                 zero: dict | None) -> list[Item]:  # fmt: skip
    """What rank `rank` holds for parameters, gradients and optimizer states at its model-state peak (the
    moment recipes/measure/measure_memory.py reports: the end of the backward for ZeRO-1, the optimizer step's start
    otherwise). `lay`, `world`: the tensor-parallel slice's layout, the data-parallel ranks."""
    e = BYTES[precision]
    if strategy.family == "ddp":
        return ddp_states(lay)
    if strategy.family == "fsdp":
        return fsdp_states(lay, world, rank, offload=strategy.offloads)
    if strategy.zero_stage in (1, 2):
        offload = offload_device(zero, "offload_optimizer") != "none"
        return zero12_states(lay, world, rank, e, int(zero["stage"]), offload, zero["grad_accum_bytes"])
    return zero3_states(lay, world, e, zero)


def bytes_by_category(items: list[Item], where: str = "gpu") -> dict[str, int]:
    out = dict.fromkeys(("params", "master_params", "grads", "optimizer_states"), 0)
    for it in items:
        if it.where == where and it.category in out:
            out[it.category] += it.nbytes
    return out


# ---------------------------------------------------------------------------------------------- activations


def activation_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, checkpointing: bool,
                     tp: int = 1, sp: int = 1) -> int:  # fmt: skip
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
    tensors stay whole: e (4h + (2h + 2g + 4f) / tp) + 8h + 4a / tp + 8 (the formula; not measured under TP).
    Under Ulysses sequence parallelism (`sp` ranks) a rank holds seq_len / sp positions of each sequence
    (`ulysses_layer_bytes`), and rotary's cos and sin are per sample (the loader passes each slice's positions).
    """
    c = config
    tokens = micro_batch * seq_len // sp
    layer = layer_activation_bytes(c, e, tp) if sp == 1 else ulysses_layer_bytes(c, e, sp)
    once = 8 + final_norm_bytes(c, e)
    kept = e * c.hidden_size if checkpointing else layer  # per layer: its input only, or everything it saves
    recomputed = layer if checkpointing else 0  # the one layer being recomputed in the backward
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


def layer_activation_bytes(config: ShardGPTConfig, e: int, tp: int = 1) -> int:
    """What one decoder layer saves per token: e (4h + (2h + 2g + 4f) / tp) + 8h + 4a / tp + 8 (`activation_bytes`)."""
    h, f, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    g = config.num_key_value_heads * config.head_dim
    return e * (4 * h + (2 * h + 2 * g + 4 * f) // tp) + 8 * h + 4 * a // tp + 8


def final_norm_bytes(config: ShardGPTConfig, e: int) -> int:
    """What the final norm saves per token: its fp32 input, 1/rms and its normalised input (4h + 4 + e h)."""
    return 4 * config.hidden_size + 4 + e * config.hidden_size


def rotary_bytes(config: ShardGPTConfig, seq_len: int, e: int) -> int:
    """Rotary cos and sin, (1, T, head_dim) each, computed once per forward and shared by the batch and layers."""
    return 2 * e * config.head_dim * seq_len


LOSS_CHUNK = 1024  # tokens per chunk of the model's chunked cross-entropy (`ShardGPTLMHead.chunk_size`)


def logits_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int) -> int:
    """The chunked cross-entropy at its largest, in the forward's last chunk (the model's `ChunkedCrossEntropy`;
    the (tokens, vocab) logits never exist): what it saves for the backward (`saved_loss_bytes`), plus one
    chunk's fp32 logits (turned into their gradient in place) and that gradient in the compute dtype,
    (4 + e) x chunk x vocab, and the chunk's (vocab, hidden) weight-gradient product before it is added."""
    chunk = min(LOSS_CHUNK, micro_batch * seq_len)
    v, h = config.vocab_size, config.hidden_size
    return saved_loss_bytes(config, micro_batch, seq_len, e) + (4 + e) * chunk * v + e * v * h


def whole_logits_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int) -> int:
    """The loss without chunks, which the model computes when tensor parallelism replaced its head (DeepSpeed
    AutoTP's vocabulary-parallel layer): the (tokens, vocab) logits in the compute dtype, and transformers'
    cross-entropy's fp32 log-probabilities and their gradient, at most (e + 8) x tokens x vocab (an upper bound:
    not measured)."""
    return (e + 8) * micro_batch * seq_len * config.vocab_size


def saved_loss_bytes(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int) -> int:
    """What the chunked loss saves from its forward for the backward: the gradient of the hidden states (e bytes
    per token and hidden unit) and the fp32 gradient of the head's weight (4 x vocab x hidden)."""
    return e * micro_batch * seq_len * config.hidden_size + 4 * config.vocab_size * config.hidden_size


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


# ---------------------------------------------------------------------------------------------- prediction


def predict(config: ShardGPTConfig, strategy: Strategy, precision: str = "bf16", micro_batch: int = 1,
            seq_len: int = 2048, activation_checkpointing: bool = False, ds_config: dict | None = None,
            rank: int | None = None, decay_embeddings: bool = False,
            bf16_gradient_reduction: bool = False, cpu_ranks: bool = False,
            micro_batches: int = 1) -> dict:  # fmt: skip
    """Bytes one GPU needs, by category, for `strategy` on its `world_size` GPUs.

    Returns params, grads, optimizer_states (fp32 master copies + Adam), activations, logits, temporary and
    total on the GPU; model_states (params + grads + optimizer_states on the GPU); host_ram and nvme per GPU
    (offload); detail (every item, by label and place) and the inputs. `rank`: one rank's figures (ZeRO-1/2
    and FSDP differ slightly between ranks); default the largest over ranks. `ds_config`: a DeepSpeed JSON
    (dict) instead of the repo's ds_configs/ file for the strategy. `cpu_ranks`: the ranks are CPU processes, as
    in the test suite (torch's unfused AdamW steps there, and the repo's JSONs have their buckets capped, as
    training caps them: `training/parallel/deepspeed_config.py`'s CPU_BUCKETS).

    A pipeline (`strategy.pp_size` > 1, GPipe or 1F1B, `micro_batches` per step: --gradient_accumulation_steps)
    is planned stage by stage (`pipeline_stages`): the figures of its largest stage, and every stage's in "stages".
    """
    world_size = strategy.world_size
    if strategy.pp_size > 1:
        stages = pipeline_stages(config, strategy, precision, micro_batch, seq_len, micro_batches,
                                 activation_checkpointing, decay_embeddings, cpu_ranks)  # fmt: skip
        return {**max(stages, key=lambda stage: stage["total"]), "stages": stages}
    sp, asked = strategy.sp_size, strategy.name  # Ulysses: ZeRO partitions over every rank, each holds T / sp
    strategy = strategy.with_degrees(sp=1)
    if strategy.name not in STRATEGIES:
        raise ValueError(f"the planner does not model {strategy.name}; choose one of {', '.join(STRATEGIES)} or all")
    if seq_len % sp:
        raise ValueError(f"seq_len {seq_len} is not divisible by sequence-parallel size {sp}")
    if precision not in BYTES:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(BYTES)}")
    if world_size < 1 or micro_batch < 1 or seq_len < 1:
        raise ValueError("world_size, micro_batch and seq_len must be at least 1")
    tp = tensor_parallel_size(strategy, ds_config)
    Mesh.of_world(world_size, tp=tp)  # refuses a tensor-parallel size that does not divide the ranks
    whole, lay = layout(config, decay_embeddings), layout(config, decay_embeddings, tp)
    dp = world_size // tp  # ZeRO and the optimizer see one tensor-parallel slice over the data-parallel ranks
    zero = None
    if strategy.family == "deepspeed":
        zero = zero_config(strategy, config, dp, precision, micro_batch, ds_config, bf16_gradient_reduction, cpu_ranks)
    ranks = [rank // tp] if rank is not None else _ranks_to_check(strategy, dp)
    states = max((model_states(lay, strategy, dp, r, precision, zero) for r in ranks),
                 key=lambda items: sum(it.nbytes for it in items if it.where == "gpu"))  # fmt: skip
    temps = temporaries(lay, strategy, dp, precision, zero)
    if cpu_ranks:  # torch's unfused AdamW
        temps.append(adam_temporaries(lay, strategy, dp, zero, BYTES[precision]))
    e = BYTES[precision]
    gpu = bytes_by_category(states)
    out = {
        "params": gpu["params"],
        "grads": gpu["grads"],
        "optimizer_states": gpu["master_params"] + gpu["optimizer_states"],
        "activations": activation_bytes(config, micro_batch, seq_len, e, activation_checkpointing, tp, sp),
        "logits": logits_bytes(config, micro_batch, seq_len // sp, e)
        if tp == 1
        else whole_logits_bytes(config, micro_batch, seq_len, e),
        "temporary": sum(it.nbytes for it in temps if it.where == "gpu"),
    }
    out["model_states"] = out["params"] + out["grads"] + out["optimizer_states"]
    out["total"] = out["model_states"] + out["activations"] + out["logits"] + out["temporary"]
    out["host_ram"] = sum(it.nbytes for it in states + temps if it.where == "host")
    # Under DDP and ZeRO-1/2 every rank builds the model in fp32 in host RAM before `accelerator.prepare` moves
    # it. Under ZeRO-3 (inside zero.Init) and FSDP2 (on the meta device, then sharded and initialised one tensor
    # at a time) a rank holds its partition and the one module or tensor being built (training/parallel/build.py).
    partitioned = strategy.zero_stage == 3 or strategy.family == "fsdp"
    out["host_ram_at_start"] = 4 * (
        math.ceil(whole.psi / world_size) + whole.largest_module if partitioned else whole.psi
    )
    if strategy.zero_stage == 3 and offload_device(zero, "offload_param") == "nvme":
        # zero.Init swaps each partition out to NVMe as soon as it is built: the host keeps the parameter swap
        # buffers, the max_in_cpu share and the module being built.
        kept = ("partitions_in_cpu", "param_swap_buffers")
        out["host_ram_at_start"] = 4 * whole.largest_module + sum(
            it.nbytes for it in states + temps if it.label in kept
        )
    out["nvme"] = sum(it.nbytes for it in states + temps if it.where == "nvme")
    out["detail"] = {f"{it.where}:{it.category}.{it.label}": it.nbytes for it in states + temps if it.nbytes}
    out["inputs"] = dict(strategy=asked, world_size=world_size, precision=precision, micro_batch=micro_batch,
                         seq_len=seq_len, activation_checkpointing=activation_checkpointing, psi=whole.psi,
                         tensor_parallel_size=tp, sequence_parallel_size=sp)  # fmt: skip
    return out


def _ranks_to_check(strategy: Strategy, world: int) -> list[int]:
    if (strategy.zero_stage in (1, 2) and not strategy.offloads) or strategy.family == "fsdp":
        return list(range(world)) if world <= 64 else [0, world - 1]  # the differences sit at the ends
    return [0]


# ---------------------------------------------------------------------------------------------- pipeline stages

# The schedules whose activations the planner models. The interleaved and zero-bubble ones hold several stages per
# rank and order their micro batches differently (their split backwards too): not modelled.
PIPELINE_SCHEDULES = ("GPipe", "1F1B")


def in_flight(schedule: str, pp: int, micro_batches: int, stage: int) -> int:
    """Micro batches whose activations stage `stage` of `pp` holds at once, at most: GPipe runs every forward before
    any backward (M); under 1F1B stage s runs P - s forwards before its first backward, then one forward per
    backward (min(M, P - s)). Measured with torch's schedules: tests/training/test_bubble.py."""
    if schedule == "GPipe":
        return micro_batches
    if schedule == "1F1B":
        return min(micro_batches, pp - stage)
    raise ValueError(f"the planner models {' and '.join(PIPELINE_SCHEDULES)}'s activations, not {schedule}'s")


def stage_layout(lay: Layout, num_stages: int, stage: int) -> Layout:
    """The parameters stage `stage` keeps (training/parallel/pipeline.keep_stages): its decoder layers, the embedding on
    the
    first stage, the final norm and the head on the last, where a tied head is a second copy of the embedding."""
    config = lay.config
    layers = tuple(f"model.layers.{i}." for i in stage_layers(config.num_hidden_layers, num_stages, stage))
    first, last = stage == 0, stage == num_stages - 1

    def kept(name: str) -> bool:
        if name == "model.embed_tokens.weight":
            return first or (last and config.tie_word_embeddings)
        if name in ("model.norm.weight", "lm_head.weight"):
            return last
        return name.startswith(layers)

    keep = [i for i, name in enumerate(lay.names) if kept(name)]
    new = {old: j for j, old in enumerate(keep)}
    by_module: dict[str, int] = {}
    for i in keep:
        module = lay.names[i].rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + lay.numels[i]
    groups = [[new[i] for i in group if i in new] for group in lay.groups]
    return Layout(
        config, [lay.names[i] for i in keep], [lay.numels[i] for i in keep], [lay.rows[i] for i in keep],
        [g for g in groups if g], [new[i] for i in lay.root if i in new], lay.layer_numel, max(by_module.values()),
    )  # fmt: skip


def stage_held(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, checkpointing: bool, schedule: str,
               pp: int, micro_batches: int, stage: int, hidden: int = 4) -> tuple[int, int]:  # fmt: skip
    """What stage `stage` holds for its backward at its peak: (activations, the chunked loss's saved gradients).

    Per micro batch in flight (`in_flight`): its layers' saved tensors (`layer_activation_bytes` per layer and
    token; with activation checkpointing the layer's input), the rotary cos and sin the stage computed for it, and
    on the last stage the final norm's and the loss's saved tensors, on the others the output torch's PipelineStage
    keeps until the micro batch's backward (h per token in the hidden states' dtype, `hidden` bytes). Once: the
    first stage's token ids, 8 bytes per token of the whole step (the schedule's micro batches are views of the
    step's ids, whose storage any of them keeps), and with checkpointing the one layer being recomputed.
    Measured to the byte on the model's own stages (tests/training/test_bubble.py), fp32."""
    c = config
    tokens = micro_batch * seq_len
    first, last = stage == 0, stage == pp - 1
    layer = layer_activation_bytes(c, e)
    per_layer = e * c.hidden_size if checkpointing else layer
    per_micro = len(stage_layers(c.num_hidden_layers, pp, stage)) * per_layer * tokens + rotary_bytes(c, seq_len, e)
    per_micro += (final_norm_bytes(c, e) if last else hidden * c.hidden_size) * tokens
    n = in_flight(schedule, pp, micro_batches, stage)
    once = (8 * tokens * micro_batches if first else 0) + (layer * tokens if checkpointing else 0)
    return n * per_micro + once, n * saved_loss_bytes(c, micro_batch, seq_len, e) if last else 0


def models_pipeline(strategy: Strategy) -> bool:
    """Whether `pipeline_stages` plans `strategy`: one stage per rank under GPipe or 1F1B, each stage one process,
    DDP or FSDP2 (full shard or shard-grad-op), as training/parallel/pipeline.py runs them."""
    if strategy.family == "fsdp" and (strategy.fsdp_version != 2 or strategy.offloads or strategy.replicas > 1):
        return False
    return (strategy.family in ("single", "ddp", "fsdp") and strategy.tp_size == 1
            and strategy.pp_stages_per_rank == 1 and strategy.pp_schedule in PIPELINE_SCHEDULES)  # fmt: skip


def pipeline_stages(config: ShardGPTConfig, strategy: Strategy, precision: str, micro_batch: int, seq_len: int,
                    micro_batches: int, checkpointing: bool = False, decay_embeddings: bool = False,
                    cpu_ranks: bool = False) -> list[dict]:  # fmt: skip
    """Bytes one rank of each pipeline stage needs, by category as `predict`'s, for a pipeline of
    `strategy.pp_size` stages, one per rank, under GPipe or 1F1B (`strategy.pp_schedule`), `micro_batches` a step.

    Model states as training/parallel/pipeline.py keeps them: a stage's parameters whole on each of its ranks, with one
    all-reduce of a flat copy of its gradients where pipelines run side by side (ddp-pp: no DDP reducer, so no
    buckets), or FSDP2-sharded over the stage's data-parallel ranks (fsdp-pp: FSDP's shards, units and prefetch,
    the stage's embedding, norm and head its root unit). Activations: `stage_held`. Besides, torch's PipelineStage
    allocates at its first step one receive buffer per micro batch for the activations (every stage but the
    first) and one for their gradients (every stage but the last), micro x T x h each (`_prepare_forward_infra`,
    torch 2.13; from its source, not measured); the in-flight micro batches' saved layer inputs are those buffers
    in fp32, counted twice here (4h of a layer's tens of h per token).
    """
    pp, schedule = strategy.pp_size, strategy.pp_schedule
    sharded = strategy.family == "fsdp"
    if not models_pipeline(strategy):
        raise ValueError(
            f"the planner does not model {strategy.name} ({schedule}): it plans pipelines of one stage per rank "
            f"under {' or '.join(PIPELINE_SCHEDULES)}, each stage one process, DDP or FSDP2 (single-pp, ddp-pp, "
            "fsdp-pp, fsdp-shard-grad-op-pp)"
        )
    if precision not in BYTES or micro_batch < 1 or seq_len < 1:
        raise ValueError(f"precision {precision!r} (one of {', '.join(BYTES)}), micro_batch and seq_len at least 1")
    check_pipeline(schedule, pp, 1, micro_batches, config.num_hidden_layers)
    e = BYTES[precision]
    hidden = e if sharded else 4  # FSDP2's bf16 parameters compute in bf16; autocast keeps the residual stream fp32
    whole = layout(config, decay_embeddings)
    tokens, v, h = micro_batch * seq_len, config.vocab_size, config.hidden_size
    stages = []
    for stage in range(pp):
        lay = stage_layout(whole, pp, stage)
        states, temps = stage_states(lay, strategy, precision, cpu_ranks)
        boundaries = (stage > 0) + (stage < pp - 1)
        temps.append(Item("buffers", "pipeline_receive_buffers", boundaries * micro_batches * tokens * h * hidden))
        activations, loss = stage_held(config, micro_batch, seq_len, e, checkpointing, schedule, pp, micro_batches,
                                       stage, hidden)  # fmt: skip
        chunk = min(LOSS_CHUNK, tokens)
        gpu = bytes_by_category(states)
        row = {
            "params": gpu["params"],
            "grads": gpu["grads"],
            "optimizer_states": gpu["master_params"] + gpu["optimizer_states"],
            "activations": activations,
            "logits": loss + ((4 + e) * chunk * v + e * v * h if stage == pp - 1 else 0),
            "temporary": sum(it.nbytes for it in temps),
            "held_for_backward": activations + loss,
        }
        row["model_states"] = row["params"] + row["grads"] + row["optimizer_states"]
        row["total"] = row["model_states"] + row["activations"] + row["logits"] + row["temporary"]
        # Every rank builds the whole model from the seed before it keeps its stage (training/parallel/pipeline.py).
        row.update(host_ram=0, host_ram_at_start=4 * whole.psi, nvme=0)
        row["detail"] = {f"{it.where}:{it.category}.{it.label}": it.nbytes for it in states + temps if it.nbytes}
        row["inputs"] = dict(
            strategy=strategy.name, world_size=strategy.world_size, precision=precision, micro_batch=micro_batch,
            seq_len=seq_len, activation_checkpointing=checkpointing, psi=whole.psi, tensor_parallel_size=1,
            pipeline_schedule=schedule, micro_batches=micro_batches, stage=stage, stage_psi=lay.psi,
            layers=list(stage_layers(config.num_hidden_layers, pp, stage)),
            micro_batches_in_flight=in_flight(schedule, pp, micro_batches, stage),
        )  # fmt: skip
        stages.append(row)
    return stages


def stage_states(lay: Layout, strategy: Strategy, precision: str, cpu_ranks: bool) -> tuple[list[Item], list[Item]]:
    """One rank's model states of the stage `lay` holds, and its temporaries: FSDP2's over the stage's
    data-parallel ranks, or the stage whole (fp32 weights, gradients and AdamW; autocast's weight copies in bf16; the
    flat copy of the gradients that their all-reduce over the data-parallel ranks averages). On CPU ranks, unfused
    AdamW's two fp32 temporaries of the largest tensor it steps."""
    dp, e = strategy.data_parallel_size, BYTES[precision]
    if strategy.family == "fsdp":
        states = max((fsdp_states(lay, dp, r, offload=False) for r in _ranks_to_check(strategy, dp)),
                     key=lambda items: sum(it.nbytes for it in items))  # fmt: skip
        temps = temporaries(lay, strategy, dp, precision, None)
        if cpu_ranks:
            temps.append(adam_temporaries(lay, strategy, dp, None, e))
        return states, temps
    states = [Item("params", "weights", 4 * lay.psi), Item("grads", "param.grad", 4 * lay.psi)]
    adam(states, lay.psi, len(lay.numels), "gpu")
    temps = [Item("buffers", "autocast_weight_copies", e * lay.psi if precision != "fp32" else 0),
             Item("buffers", "gradient_all_reduce", 4 * lay.psi if dp > 1 else 0),
             Item("buffers", "adam_temporaries", 8 * max(lay.numels) if cpu_ranks else 0)]  # fmt: skip
    return states, temps


# ---------------------------------------------------------------------------------------------- ZeRO paper


def zero_paper(psi: int, world: int, stage: int, precision: str) -> int:
    """Model-state bytes per rank in the ZeRO paper (Rajbhandari et al. 2020, section 5), stage 0 = DDP.

    Mixed precision Adam (K = 12: fp32 master weights, momentum, variance; 2-byte weights and gradients):
      baseline 16 psi, ZeRO-1 4 psi + 12 psi/Nd, ZeRO-2 2 psi + 14 psi/Nd, ZeRO-3 16 psi/Nd.
    fp32 (4-byte weights and gradients, Adam's 8 bytes, no master copy: the weights are fp32 already):
      baseline 16 psi, ZeRO-1 8 psi + 8 psi/Nd, ZeRO-2 4 psi + 12 psi/Nd, ZeRO-3 16 psi/Nd.
    """
    w, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    shard = {0: (w + g + k, 0), 1: (w + g, k), 2: (w, g + k), 3: (0, w + g + k)}[stage]
    return shard[0] * psi + shard[1] * psi / world
