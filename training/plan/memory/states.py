"""Model states per rank, tensor by tensor, as DDP, FSDP2 and DeepSpeed 0.19 allocate them for this model:
parameters, gradients and AdamW's states, with DeepSpeed's flat buffers and alignment, the ZeRO-1/2 gradient
partition, ZeRO-3's persistent parameters and sub-groups, FSDP2's padded shards and DDP's buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.plan.memory.layout import BYTES, Layout, offload_device
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- model states


@dataclass
class Item:
    category: str  # params, master_params, grads, optimizer_states, buffers
    label: str  # the same labels as recipes/measure/measure_memory.py
    nbytes: int
    where: str = "gpu"  # gpu, host or nvme


def adam(items: list[Item], numel: int, tensors: int, where: str, muon: int = 0) -> None:
    """torch AdamW: fp32 exp_avg and exp_avg_sq per element, and a 4-byte fp32 step counter per tensor; with
    --optim muon, `muon` of the elements are Muon's matrices instead: one fp32 momentum each, no counter
    (training/muon.py)."""
    items.append(Item("optimizer_states", "adam.exp_avg", 4 * (numel - muon), where))
    items.append(Item("optimizer_states", "adam.exp_avg_sq", 4 * (numel - muon), where))
    items.append(Item("optimizer_states", "adam.step", 4 * tensors, where))
    if muon:
        items.append(Item("optimizer_states", "muon.momentum_buffer", 4 * muon, where))


def ddp_states(lay: Layout) -> list[Item]:
    """Whole fp32 weights (accelerate's mixed precision autocasts, the weights stay fp32), whole fp32
    gradients, and the reducer's own flat gradient buckets: accelerate leaves `gradient_as_bucket_view` at
    torch's default False, so buckets are copies, not views, of the gradients."""
    psi = lay.psi
    items = [Item("params", "weights", 4 * psi), Item("grads", "param.grad", 4 * psi)]
    items.append(Item("grads", "ddp_buckets", 4 * psi))
    muon = sum(lay.numels[i] for i in lay.muon)
    adam(items, psi, len(lay.numels) - len(lay.muon), "gpu", muon)
    return items


def fsdp_states(lay: Layout, world: int, rank: int, offload: bool) -> list[Item]:
    """FSDP2: each parameter's dim 0 in chunks of ceil(rows / world); a rank keeps its chunk padded to full
    size for parameters and for the reduce-scatter's gradient output (cast to fp32), while Adam's moments
    are shaped like the unpadded local shard."""
    where = "host" if offload else "gpu"
    padded = local = muon = 0
    for i, (numel, rows) in enumerate(zip(lay.numels, lay.rows, strict=True)):
        chunk = math.ceil(rows / world)
        per_row = numel // rows
        padded += chunk * per_row
        local += max(0, min(chunk, rows - rank * chunk)) * per_row
        muon += max(0, min(chunk, rows - rank * chunk)) * per_row if i in lay.muon else 0
    items = [Item("params", "local_shards", 4 * padded, where), Item("grads", "local_shards", 4 * padded, where)]
    adam(items, local, len(lay.numels) - len(lay.muon), where, muon)
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
        adam(items, part, len(parts), "host")  # Muon has no CPU offload (refused)
        return items
    items.append(Item("master_params", "fp32_partitions", 4 * part))
    if stage == 1:
        items.append(Item("grads", "param.grad", e * lay.psi))
    else:
        items.append(Item("grads", "grads_in_partition", e * sum(k for _, _, k in parts)))
    # --optim muon: the Muon group's partition holds a momentum, each other group's Adam's moments and a step
    muon = [p for (_, p, _), group in zip(parts, lay.groups, strict=True) if group[0] in lay.muon]
    adam(items, part, len(parts) - len(muon), "gpu", sum(muon))
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
    muon = sum(math.ceil(lay.numels[i] / world) for i in lay.muon)  # one sub-group: training/muon.ZeroLayout.check
    adam(items, part, len(subs) - (1 if lay.muon else 0), opt_where, muon)
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
