"""What a rank holds, tensor by tensor: parameters, fp32 master copies, gradients and optimizer
states, found by walking the objects `accelerator.prepare` returned (DDP, FSDP2, ZeRO-1/2, ZeRO-3).
"""

from __future__ import annotations

import gc
import warnings
from collections import defaultdict

import torch

CATEGORIES = ("params", "master_params", "grads", "optimizer_states", "buffers")
MODEL_STATES = ("params", "master_params", "grads", "optimizer_states")


class Ledger:
    """Bytes by category, each storage counted once (the first category that claims it keeps it)."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.detail: dict[str, int] = defaultdict(int)

    def add(self, category: str, label: str, tensor) -> None:
        if tensor is None:
            return
        if isinstance(tensor, (list, tuple)):
            for t in tensor:
                self.add(category, label, t)
            return
        if hasattr(tensor, "flat_partition"):  # DeepSpeed's GradPartitionBufferGroup
            self.add(category, label, tensor.flat_partition)
            return
        if not isinstance(tensor, torch.Tensor):
            return
        if hasattr(tensor, "to_local"):  # a DTensor: this rank's shard
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category] += storage.nbytes()
        self.detail[f"{category}.{label}"] += storage.nbytes()

    def add_bytes(self, category: str, label: str, nbytes: int) -> None:
        """Memory with no Python tensor to dedupe by (DDP's C++ reducer buckets)."""
        self.bytes[category] += nbytes
        self.detail[f"{category}.{label}"] += nbytes

    def report(self) -> dict:
        out = {"bytes": dict(self.bytes), "detail": dict(sorted(self.detail.items()))}
        out["model_states"] = sum(self.bytes[c] for c in MODEL_STATES)
        return out


def optimizer_states(ledger: Ledger, optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            ledger.add("optimizer_states", f"adam.{key}", value)


def walk_ddp(ledger: Ledger, net, optimizer) -> None:
    params = list(net.module.parameters())
    ledger.add("params", "weights", [p.data for p in params])
    ledger.add("grads", "param.grad", [p.grad for p in params])
    if not net.gradient_as_bucket_view:
        # The reducer keeps its own flat gradient buckets (copies, not views of .grad): their sizes
        # come from zero-filled twins, as the reducer's tensors are not reachable from Python.
        twins = net.reducer._get_zeros_like_grad_buckets()
        ledger.add_bytes("grads", "ddp_buckets", sum(b.buffer().nbytes for b in twins))
    optimizer_states(ledger, optimizer)


def walk_fsdp(ledger: Ledger, net, optimizer) -> None:
    """A module whose parameters the optimizer steps as they are held: FSDP2's shards, the tensor-parallel slices of
    DTensor plans, a pipeline rank's stages (plain, sliced or sharded): the local part of each, its gradient, Adam's
    states, and FSDP2's gathered copies still allocated."""
    params = list(net.parameters())
    ledger.add("params", "local_shards", [p.data for p in params])
    ledger.add("grads", "local_shards", [p.grad for p in params])
    optimizer_states(ledger, optimizer)
    for fsdp_param in fsdp_params(net):  # unsharded parameters still allocated (freed after use when resharding)
        ledger.add("buffers", "fsdp_unsharded_params", getattr(fsdp_param, "_unsharded_param", None))


def walk_fsdp_gathered(ledger: Ledger, net) -> None:
    """FSDP2's units of `net` still gathered whole, and their gradients accumulated whole while the gradient sync is
    off (a pipeline's micro batches until the reduction after the last backward), as allocated."""
    for fsdp_param in fsdp_params(net):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        ledger.add("buffers", "unsharded_params", unsharded)
        # in the parameters' dtype, or upcast to the reduce dtype where one is set
        accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        grad = getattr(unsharded, "grad", None)
        ledger.add("buffers", "unsharded_accumulated_grads", accumulated if accumulated is not None else grad)


def fsdp_params(net):
    """FSDP2's per-parameter records of every unit in `net` (none outside FSDP2)."""
    for module in net.modules():
        group = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group", None)
        yield from getattr(group, "fsdp_params", [])


def walk_zero12(ledger: Ledger, engine) -> None:
    opt = engine.optimizer
    params = list(engine.module.parameters())
    ledger.add("params", "bit16_flat", opt.bit16_groups_flat)
    ledger.add("params", "weights", [p.data for p in params])
    if getattr(opt, "cpu_offload", False):
        ledger.add("params", "bit16_offload_buffer", opt.param_buffer_of_bit16_for_cpu_offload_groups)
    ledger.add("master_params", "fp32_partitions", opt.single_partition_of_fp32_groups)
    ledger.add("grads", "grads_in_partition", getattr(opt, "grads_in_partition", None))
    ledger.add("grads", "averaged_gradients", [g for g in opt.averaged_gradients.values() if g is not None])
    ledger.add("grads", "fp32_partition.grad", [p.grad for p in opt.single_partition_of_fp32_groups])
    optimizer_states(ledger, opt.optimizer)
    for bucket in opt.ipg_buckets.values():
        ledger.add("buffers", "reduce_buckets", bucket.buffer)
    if getattr(opt, "cpu_offload", False):
        staging = [opt.temp_grad_buffer_for_cpu_offload, opt.temp_grad_buffer_for_gpu_offload]
        ledger.add("buffers", "offload_grad_staging", staging)
    # ZeRO-1 keeps every whole gradient until the engine reduces them at the end of the backward: model
    # state. ZeRO-2 reduces bucket by bucket during the backward: a gradient not yet in its partition is
    # in flight (the last bucket, or a parameter larger than a bucket), a temporary.
    if opt.partition_gradients:
        ledger.add("buffers", "grads_in_flight", [p.grad for p in params])
    else:
        ledger.add("grads", "param.grad", [p.grad for p in params])


def walk_zero3(ledger: Ledger, engine) -> None:
    opt = engine.optimizer
    params = list(engine.module.parameters())
    ledger.add("params", "partitions", getattr(opt, "lp_param_buffer", None))
    ledger.add("params", "partitions", [p.ds_tensor for p in params])
    ledger.add("params", "persistent_whole", [p.data for p in params if p.ds_persist])
    ledger.add("master_params", "fp32_partitions", opt.fp32_partitioned_groups_flat)
    ledger.add("grads", "grad_partitions", opt.grad_partitions_flat_buffer)
    ledger.add("grads", "averaged_gradients", [g for g in opt.averaged_gradients.values() if g is not None])
    ledger.add("grads", "fp32_partition.grad", [p.grad for p in opt.fp32_partitioned_groups_flat])
    optimizer_states(ledger, opt.optimizer)
    for bucket in opt.ipg_buckets.values():
        ledger.add("buffers", "reduce_buckets", bucket.buffer)
    # Whole parameters gathered for a module's forward/backward, and whole gradients not yet reduced
    # into their partitions: temporaries of the backward (empty between steps).
    ledger.add("buffers", "gathered_params", [p.data for p in params if not p.ds_persist])
    ledger.add("buffers", "grads_in_flight", [p.grad for p in params])


def unattributed(ledger: Ledger, exclude: set[int]) -> dict:
    """Tensors the garbage collector sees that the walk did not count: the proof that it missed nothing."""
    seen = set(ledger.seen)
    total, largest = 0, []
    with warnings.catch_warnings():  # isinstance() on some deprecated module objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and id(obj) not in exclude]
    for obj in tensors:
        try:
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
            continue
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
        largest.append((storage.nbytes(), f"{tuple(t.shape)} {t.dtype}"))
    largest.sort(reverse=True)
    return {"bytes": total, "largest": [f"{n} B {what}" for n, what in largest[:5]]}
