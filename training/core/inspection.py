"""What the prepared objects show: the strategy in force read from the model and optimizer that
`accelerator.prepare` returned (wrapper, optimizer chain, ZeRO stage, offload, resharding), checked
against the request, and each rank's share of parameters, gradients and optimizer states.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
)

from training.compat import is_compiled_function
from training.strategy import Strategy


def verify_strategy(accelerator: Accelerator, model: torch.nn.Module, strategy: Strategy) -> dict:
    """Refuse to train unless the prepared model is sharded as the launch asked. Returns what was seen:
    the strategy, the world size and the fraction of the parameters this rank holds."""
    world = check_world(accelerator, strategy)
    model = uncompiled(model)  # under --torch_compile: OptimizedModule(DDP) or OptimizedModule(FSDP module)
    unwrapped = unwrap(accelerator, model)
    total = parameter_count(unwrapped)
    local = sum(_local_numel(p) for p in unwrapped.parameters())
    if _fsdp1_handles(model):  # FSDP1 replaced the parameters by flat ones: count what they hold
        local, total = _fsdp1_numels(model)
    seen = {
        "strategy": strategy.name,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "world_size": world,
        "mixed_precision": accelerator.mixed_precision,  # what accelerate autocasts to (DeepSpeed: its bf16/fp16)
        "parameters": total,
        "local_parameter_fraction": round(local / total, 4),
    }

    def refuse(why: str):
        raise RuntimeError(
            f"asked for {strategy.name} on {world} ranks, but {why}: the launch's config was not applied as written; "
            "check the accelerate YAML's distributed_type and `use_cpu: false`, or the --deepspeed JSON's "
            f"zero_optimization.stage; seen: {seen}"
        )

    if strategy.family == "deepspeed":
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            refuse(f"the prepared model is a {type(model).__name__}, not a DeepSpeedEngine")
        if model.zero_optimization_stage() != strategy.zero_stage:
            refuse(f"the engine runs ZeRO stage {model.zero_optimization_stage()}")
        sharded = strategy.zero_stage == 3 and world > 1
        if sharded and local > total / world * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (ZeRO-3 should hold about 1/{world})")
        if strategy.tp_size > 1 or (model.autotp_size() or 1) > 1:  # asked for, or running (an engine of its own)
            seen["tensor_parallel"] = verify_autotp(model, unwrapped, strategy, refuse)
        if strategy.sp_size > 1:
            seen["sequence_parallel"] = verify_ulysses(model, unwrapped, strategy, refuse)
    elif strategy.family == "fsdp":
        if accelerator.distributed_type != DistributedType.FSDP:
            refuse(f"accelerate runs {accelerator.distributed_type}")
        shards = strategy.shard_size
        if shards > 1 and local > total / shards * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (FSDP should hold about 1/{shards})")
        if strategy.tp_size > 1:
            seen["tensor_parallel"] = verify_dtensor_tp(unwrapped, strategy, refuse)
    elif world > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        refuse(f"the prepared model is a {type(model).__name__}, not DistributedDataParallel")
    return seen


def check_world(accelerator: Accelerator, strategy: Strategy) -> int:
    """Refuse a launch whose ranks do not form one process group of the strategy's world size."""
    world = strategy.world_size
    dist_world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if accelerator.num_processes != world or dist_world != world:
        raise RuntimeError(
            f"the launcher started {world} ranks but accelerate runs {accelerator.num_processes} process(es) "
            f"over a process group of {dist_world} ({accelerator.distributed_type}); every rank would train "
            "alone on the whole dataset. With `use_cpu: true` in an accelerate config accelerate drops "
            "DeepSpeed and FSDP: set `use_cpu: false` (this script uses gloo on CPU by itself)"
        )
    return world


def verify_pipeline(accelerator: Accelerator, layout: dict, strategy: Strategy) -> dict:
    """Refuse to train unless the pipeline as built (`Pipeline.in_force`) is the strategy's: its degree, schedule and
    stages per rank, and the data parallelism across the pipelines (FSDP2 under an FSDP config, else an all-reduce
    of whole copies where there are several). Returns what was seen, as `verify_strategy` does."""
    world = check_world(accelerator, strategy)
    pipe = layout["pipeline"]
    dp = strategy.data_parallel_size
    expected = {
        "degree": strategy.pp_size,
        "schedule": strategy.pp_schedule,
        "stages_per_rank": strategy.pp_stages_per_rank,
        "data_parallel_size": dp,
        "data_parallel": "fsdp2" if strategy.family == "fsdp" else "all-reduce" if dp > 1 else "none",
        "tensor_parallel_size": strategy.tp_size,
    }
    built = {key: pipe[key] for key in expected}
    if built != expected:
        wrong = ", ".join(f"{k} {built[k]} (asked: {v})" for k, v in expected.items() if built[k] != v)
        raise RuntimeError(f"asked for {strategy.name} on {world} ranks, but the pipeline runs {wrong}; seen: {layout}")
    if strategy.tp_size > 1 and not pipe["split_modules"]:
        raise RuntimeError(f"asked for {strategy.name}, but no matrix of this rank's stages is split; seen: {layout}")
    return {
        "strategy": strategy.name,
        "distributed_type": "PIPELINE",
        "world_size": world,
        "mixed_precision": accelerator.mixed_precision,
    } | layout


def tp_plan_styles(model: torch.nn.Module) -> dict[str, str]:
    """Each module the model's tensor-parallel plan splits, by full name, with its style: transformers' merged plan
    (the config's base_model_tp_plan, the head's _tp_plan, and the embedding split over the vocabulary,
    embedding_rowwise, which AutoTP shares with the tied head). A model on the meta device has the same."""
    styles = {}
    for name, _ in model.named_modules():
        style = next((s for pattern, s in model.tp_plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is not None:
            styles[name] = style
    return styles


def verify_autotp(engine, unwrapped: torch.nn.Module, strategy: Strategy, refuse: Callable[[str], NoReturn]) -> dict:
    """DeepSpeed AutoTP in force as asked: the engine's tensor-parallel size, this rank's place in the (dp, tp)
    mesh (the data loader's shard), and every module of the model's tensor-parallel plan split along the plan's
    dimension: "colwise" (q, k, v, gate, up; the head over the vocabulary) keeps 1/tp of the output rows of the
    weight (out, in), "rowwise" (o, down) 1/tp of its input columns. Returns the count of each style."""
    tp = strategy.tp_size
    if engine.autotp_size() != tp:
        refuse(f"the engine splits layers over {engine.autotp_size()} ranks")
    mpu, rank = engine.mpu, torch.distributed.get_rank()
    place = (mpu.get_data_parallel_rank(), mpu.get_tensor_model_parallel_world_size())
    if place != (strategy.data_parallel_rank(rank), tp):
        refuse(f"rank {rank} is data-parallel rank {place[0]} of a tensor-parallel group of {place[1]}")
    counts: dict[str, int] = {}
    for name, style in tp_plan_styles(unwrapped).items():
        module = unwrapped.get_submodule(name)
        # ZeRO-3 partitions the slice further: its `ds_shape` is the slice's shape, `shape` this rank's partition's
        whole = tuple(getattr(module, "_orig_weight_shape", ()))
        split = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
        dim = 1 if style == "rowwise" else 0  # weights are (out, in); an embedding's (vocabulary, hidden)
        want = tuple(n // tp if d == dim else n for d, n in enumerate(whole))
        if not whole or split != want:
            refuse(f"{name} ({style}) holds a weight of {split}, not 1/{tp} of {whole or split} along dim {dim}")
        counts[style] = counts.get(style, 0) + 1
    return {"size": tp, "data_parallel_size": strategy.data_parallel_size, "split_modules": counts}


def verify_dtensor_tp(model: torch.nn.Module, strategy: Strategy, refuse: Callable[[str], NoReturn]) -> dict:
    """The model's plan in force under FSDP2 (training/axes/tensor.py): every module the decoder's plan names
    holds a weight split over the mesh's tp ranks along the plan's dimension (colwise: output rows, rowwise: input
    columns), and the embedding and the head theirs by vocabulary rows. Returns the count of each style."""
    from training.axes.tensor import split_modules

    tp = strategy.tp_size
    counts = split_modules(model, tp)
    layers = len(model.model.layers)
    planned: dict[str, int] = {"embedding_rowwise": 1, "colwise_gather_output": 1}  # split by vocabulary rows
    for style in model.config.base_model_tp_plan.values():
        planned[style] = planned.get(style, 0) + layers
    if counts != planned:
        refuse(f"the modules split over {tp} tensor-parallel ranks are {counts}, not the plan's {planned}")
    return {"size": tp, "data_parallel_size": strategy.data_parallel_size, "split_modules": counts}


def verify_ulysses(engine, unwrapped: torch.nn.Module, strategy: Strategy,
                   refuse: Callable[[str], NoReturn]) -> dict:  # fmt: skip
    """Ulysses in force as asked: the engine's sequence-parallel size, this rank's place in DeepSpeed's groups (the
    loader's slice and shard), and transformers' attention for the model's implementation replaced by DeepSpeed's
    all-to-all wrapper (without it each rank would attend within its own slice only)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = strategy.sp_size
    if engine.sequence_parallel_size != sp:
        refuse(f"the engine splits sequences over {engine.sequence_parallel_size} ranks")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups

    rank = torch.distributed.get_rank()
    place = (groups.get_sequence_parallel_rank(), groups.get_sequence_data_parallel_world_size() // sp)
    if place != (strategy.sequence_parallel_rank(rank), strategy.data_parallel_size):
        refuse(f"rank {rank} holds slice {place[0]} of the sequences among {place[1]} data-parallel groups")
    implementation = unwrapped.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if getattr(attention, "__name__", "") != "uattn_wrapper":
        refuse(f"transformers' {implementation} attention is not DeepSpeed's Ulysses wrapper")
    return {"size": sp, "data_parallel_size": strategy.data_parallel_size, "attention": implementation}


def unwrap(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model inside the strategy's wrapper: `accelerator.unwrap_model` under DeepSpeed; DDP's or FSDP1's
    `module` otherwise (FSDP2 keeps the model itself). accelerate 1.15 imports DeepSpeed on every `unwrap_model` call
    where it is installed, 1-2 s of each CPU rank's start-up in a launch that does not use it."""
    if accelerator.distributed_type.name == "DEEPSPEED":
        return accelerator.unwrap_model(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, FullyShardedDataParallel)):
        model = model.module
    return model


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile wrapped (DDP, an FSDP2 model), or `model` itself. Read, never rewritten:
    `accelerator.unwrap_model` with its default `keep_torch_compile=True` replaces the compiled module's
    `_orig_mod` by the unwrapped model, which silently drops DDP (and its `no_sync`) from the compiled
    module's forward."""
    return getattr(model, "_orig_mod", model)


def observe_strategy(model: torch.nn.Module, optimizer) -> dict:
    """What the prepared objects say is in force, read from them rather than from the config that asked:
    the wrapper and optimizer classes, the ZeRO stage, where parameters and optimizer states live, and
    FSDP2's resharding and offload policy. Written to strategy.json beside the shares `StateShares` measures."""
    # --torch_compile's compiled decoder layers (training/core/build.py), torch.compile's wrapper around the whole
    # model (an accelerate config's dynamo_backend), or a DeepSpeed engine that compiled itself.
    blocks = sum(is_compiled_function(m.__dict__.get("forward")) for m in uncompiled(model).modules())
    whole = hasattr(model, "_orig_mod") or bool(getattr(model, "is_compiled", False))
    seen = {"compiled": whole or blocks > 0, "compiled_blocks": blocks} | observe_precision(model)
    model = uncompiled(model)
    return seen | _observe_sharding(model, optimizer)


def observe_precision(model: torch.nn.Module) -> dict:
    """The precision in force, read from the prepared objects: the dtypes of the parameters the forward
    uses, accelerate's autocast (DDP, one process), FSDP2's policy, DeepSpeed's bf16/fp16 and the dtypes it
    communicates and accumulates gradients in (docs/precision.md)."""
    compiled = uncompiled(model)
    inner = getattr(compiled, "module", compiled)  # DDP's and DeepSpeed's wrapped module
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in inner.parameters()})
    forward = getattr(inner, "_original_forward", None)  # set by accelerate when it wraps forward in autocast
    seen = {"parameter_dtypes": dtypes, "autocast": forward is not None}
    policies = {g.mp_policy for m in inner.modules() if (g := _fsdp_param_group(m)) is not None}
    if policies:
        (policy,) = policies  # one policy for every parameter group
        seen["fsdp_mixed_precision"] = {
            k: None if v is None else str(v).removeprefix("torch.")
            for k, v in (("param_dtype", policy.param_dtype), ("reduce_dtype", policy.reduce_dtype),
                         ("output_dtype", policy.output_dtype))
        }  # fmt: skip
    if hasattr(compiled, "zero_optimization_stage"):  # a DeepSpeedEngine
        _, accum = compiled.get_data_types()  # (the model's dtype, the gradient accumulation dtype)
        seen["deepspeed_precision"] = {
            "bf16": compiled.bfloat16_enabled(),
            "fp16": compiled.fp16_enabled(),
            "communication_data_type": str(compiled.communication_data_type).removeprefix("torch."),
            "grad_accum_dtype": str(accum).removeprefix("torch."),
        }
    return seen


def _observe_sharding(model: torch.nn.Module, optimizer) -> dict:
    chain = [type(o).__name__ for o in optimizer_chain(optimizer)]
    seen = {"engine": type(model).__name__, "optimizer_chain": chain, "zero_stage": 0,
            "offload_param": "none", "offload_optimizer": "none"}  # fmt: skip
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeedEngine
        zero = model.optimizer
        seen["zero_stage"] = model.zero_optimization_stage()
        if seen["zero_stage"] == 3:
            seen["offload_param"] = _device(zero.offload_param, zero.params_in_nvme_and_cpu)
            # DeepSpeed swaps only partitions of 1 MiB or more; smaller ones stay in host memory.
            on_nvme = [p.ds_tensor.ds_numel for p in model.module.parameters() if _on_nvme(p.ds_tensor)]
            seen["local_parameter_fraction_on_nvme"] = round(sum(on_nvme) / parameter_count(model), 4)
            seen["offload_optimizer"] = _device(zero.offload_optimizer, zero.swap_optimizer)
            seen["gradients_partitioned_in_backward"] = True
        else:
            seen["offload_optimizer"] = _device(getattr(zero, "cpu_offload", False), False)
            # ZeRO-1 in bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, which has no such
            # flag: like ZeRO-1, it reduces whole gradients in the backward.
            seen["gradients_partitioned_in_backward"] = bool(getattr(zero, "partition_gradients", False))
        return seen
    handles = _fsdp1_handles(model)
    if handles:  # FSDP1: one flat parameter per wrapped module
        seen["fsdp_sharding_strategy"] = sorted({h._sharding_strategy.name for h in handles})
        seen["fsdp_flat_parameters"] = len(handles)
        return seen
    layers = set(getattr(model, "_no_split_modules", None) or ())
    groups = [(type(m).__name__, g) for m in model.modules() if (g := _fsdp_param_group(m)) is not None]
    if groups:  # FSDP2: a parameter group per decoder layer, one for the tail (embedding, norm), the root's
        # accelerate keeps the tail's and the root's parameters gathered after the forward, by design.
        seen["reshard_after_forward"] = sorted(
            {g._reshard_after_forward for name, g in groups if name.removeprefix("FSDP") in layers}
        )
        seen["fsdp_param_dtype"] = sorted({str(g.mp_policy.param_dtype).removeprefix("torch.") for _, g in groups})
        policies = sorted({type(g.offload_policy).__name__ for _, g in groups})
        seen["fsdp_offload_policy"] = policies
        offloaded = policies == ["CPUOffloadPolicy"]  # shards, their gradients and Adam's states on the host
        seen["offload_param"] = seen["offload_optimizer"] = "cpu" if offloaded else "none"
    return seen


def _on_nvme(partition: torch.Tensor) -> bool:
    location = getattr(partition, "final_location", None)
    return getattr(location, "value", location) == "nvme"


def parameter_count(model: torch.nn.Module) -> int:
    """The whole model's parameter elements, whatever this rank holds of them."""
    # DeepSpeed AutoTP's split layers keep their weight's whole shape (the model has no biases).
    split = {id(m.weight): math.prod(m._orig_weight_shape) for m in model.modules() if hasattr(m, "_orig_weight_shape")}
    return sum(split.get(id(p)) or _global_numel(p) for p in model.parameters())


def _device(offloaded: bool, to_nvme: bool) -> str:
    return "nvme" if offloaded and to_nvme else "cpu" if offloaded else "none"


def _fsdp1_handles(model: torch.nn.Module) -> list:
    """The flat-parameter handles of a model wrapped by torch's FSDP1 (none for anything else)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        return []
    return [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle is not None]


def _fsdp1_numels(model: torch.nn.Module) -> tuple[int, int]:
    """(this rank's, the whole model's) parameter elements under FSDP1, read right after wrapping, when each flat
    parameter holds this rank's shard (padding included) and knows its unsharded size."""
    handles = _fsdp1_handles(model)
    local = sum(h.flat_param.numel() for h in handles)
    return local, sum(h.flat_param._unpadded_unsharded_size.numel() for h in handles)


def _fsdp_param_group(module: torch.nn.Module):
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    return getattr(state, "_fsdp_param_group", None)


def optimizer_chain(optimizer) -> list:
    """The optimizer and what it wraps, outermost first: accelerate's wrapper, a ZeRO optimizer, the torch
    optimizer that updates the weights."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    return chain


class StateShares:
    """This rank's share of the gradients and of Adam's states, measured at the first optimizer step.

    A pre-step hook on the torch optimizer that really updates (DeepSpeed's ZeRO optimizers call it once per
    partition or sub-group) counts the local elements of the gradients it is given; after the step, the local
    elements of `exp_avg`. Divided by the model's parameter count: 1 for whole copies, about 1/N when sharded
    (ZeRO pads partitions). Optimizer states swapped to NVMe are not in memory and count 0 here."""

    def __init__(self, optimizer):
        self.chain = optimizer_chain(optimizer)
        self.inner = self.chain[-1]
        self.grads: dict[int, int] = {}
        self.handle = self.inner.register_step_pre_hook(self._count_grads)

    def _count_grads(self, optimizer, *_):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = _local_numel(p.grad)

    def read(self, parameters: int) -> dict:
        """After the first optimizer step: the shares, and the hook removed."""
        self.handle.remove()
        states = sum(_local_numel(s["exp_avg"]) for s in self.inner.state.values() if "exp_avg" in s)
        swapper = next((o.optimizer_swapper for o in self.chain if getattr(o, "optimizer_swapper", None)), None)
        swapped = [i.numel() for i in swapper.swap_params_info.values() if i.has_state_tensors] if swapper else []
        return {
            "local_gradient_fraction": round(sum(self.grads.values()) / parameters, 4),
            "local_optimizer_state_fraction": round(states / parameters, 4),
            "local_optimizer_state_fraction_on_nvme": round(sum(swapped) / parameters, 4),
        }


def _local_numel(p: torch.Tensor) -> int:
    if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition
        return p.ds_tensor.numel()
    if hasattr(p, "to_local"):  # FSDP2 DTensor: this rank's shard
        return p.to_local().numel()
    return p.numel()


def _global_numel(p: torch.Tensor) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()
