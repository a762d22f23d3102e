"""The model and optimizer inside the wrappers a strategy puts around them (DDP, FSDP, a DeepSpeed engine,
torch.compile, accelerate's optimizer), and their elements counted whatever this rank holds of them."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator


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


def optimizer_chain(optimizer) -> list:
    """The optimizer and what it wraps, outermost first: accelerate's wrapper, a ZeRO optimizer, the torch
    optimizer that updates the weights."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    return chain


def parameter_count(model: torch.nn.Module) -> int:
    """The whole model's parameter elements, whatever this rank holds of them."""
    # DeepSpeed AutoTP's split layers keep their weight's whole shape (the model has no biases).
    split = {id(m.weight): math.prod(m._orig_weight_shape) for m in model.modules() if hasattr(m, "_orig_weight_shape")}
    return sum(split.get(id(p)) or global_numel(p) for p in model.parameters())


def local_numel(p: torch.Tensor) -> int:
    if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition
        return p.ds_tensor.numel()
    if hasattr(p, "to_local"):  # FSDP2 DTensor: this rank's shard
        return p.to_local().numel()
    return p.numel()


def global_numel(p: torch.Tensor) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()
