"""What the prepared objects show: the strategy in force read from the model and optimizer that
`accelerator.prepare` returned (wrapper, optimizer chain, ZeRO stage, offload, resharding), checked
against the request, and each rank's share of parameters, gradients and optimizer states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
from accelerate import Accelerator

from training.compat import is_compiled_function
from training.core.family import family_of
from training.core.wrapped import local_numel, optimizer_chain, uncompiled, unwrap
from training.strategy import Strategy


def verify_strategy(accelerator: Accelerator, model: torch.nn.Module, strategy: Strategy) -> dict:
    """Refuse to train unless the prepared model is wrapped and sharded as the launch's family should have it
    (training/core/family.py); the model-parallel axes verify their own (training/loop/engine.py). Returns what was
    seen: the strategy, the world size and the fraction of the parameters this rank holds."""
    world = check_world(accelerator, strategy)
    family = family_of(strategy)
    model = uncompiled(model)  # under --torch_compile: OptimizedModule(DDP) or OptimizedModule(FSDP module)
    unwrapped = unwrap(accelerator, model)
    local, total = family.parameter_counts(model, unwrapped)
    seen = {
        "strategy": strategy.name,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "world_size": world,
        "mixed_precision": accelerator.mixed_precision,  # what accelerate autocasts to (DeepSpeed: its bf16/fp16)
        "parameters": total,
        "local_parameter_fraction": round(local / total, 4),
    }
    family.verify(accelerator, model, unwrapped, strategy, local, total, refusal(strategy, seen))
    return seen


def refusal(strategy: Strategy, seen: dict) -> Callable[[str], NoReturn]:
    """`refuse(why)`: the one error of a prepared model that is not what the launch asked for."""

    def refuse(why: str) -> NoReturn:
        raise RuntimeError(
            f"asked for {strategy.name} on {strategy.world_size} ranks, but {why}: the launch's config was not applied "
            "as written; check the accelerate YAML's distributed_type and `use_cpu: false`, or the --deepspeed JSON's "
            f"zero_optimization.stage; seen: {seen}"
        )

    return refuse


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


def observe_strategy(model: torch.nn.Module, optimizer, strategy: Strategy) -> dict:
    """What the prepared objects say is in force, read from them rather than from the config that asked: whether
    layers are compiled, the parameters' dtypes, the wrapper and optimizer classes, and what the family reads of its
    own (ZeRO's stage and offloads, FSDP2's resharding and policy). Written to strategy.json beside the shares
    `StateShares` measures."""
    # --torch_compile's compiled decoder layers (training/core/build.py), torch.compile's wrapper around the whole
    # model (an accelerate config's dynamo_backend), or a DeepSpeed engine that compiled itself.
    blocks = sum(is_compiled_function(m.__dict__.get("forward")) for m in uncompiled(model).modules())
    whole = hasattr(model, "_orig_mod") or bool(getattr(model, "is_compiled", False))
    model = uncompiled(model)
    inner = getattr(model, "module", model)  # DDP's and DeepSpeed's wrapped module
    forward = getattr(inner, "_original_forward", None)  # set by accelerate when it wraps forward in autocast
    return {
        "compiled": whole or blocks > 0, "compiled_blocks": blocks,
        "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in inner.parameters()}),
        "autocast": forward is not None, "engine": type(model).__name__,
        "optimizer_chain": [type(o).__name__ for o in optimizer_chain(optimizer)],
        "zero_stage": 0, "offload_param": "none", "offload_optimizer": "none",
    } | family_of(strategy).observe(model, optimizer)  # fmt: skip


class StateShares:
    """This rank's share of the gradients and of the optimizer's states, measured at the first optimizer step.

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
                    self.grads[id(p)] = local_numel(p.grad)

    def read(self, parameters: int) -> dict:
        """After the first optimizer step: the shares, and the hook removed."""
        self.handle.remove()
        # AdamW's first moment, or Muon's momentum where a matrix has no exp_avg: one state per parameter element
        first = ("exp_avg", "momentum_buffer")
        states = sum(local_numel(next(s[k] for k in first if k in s)) for s in self.inner.state.values()
                     if any(k in s for k in first))  # fmt: skip
        swapper = next((o.optimizer_swapper for o in self.chain if getattr(o, "optimizer_swapper", None)), None)
        swapped = [i.numel() for i in swapper.swap_params_info.values() if i.has_state_tensors] if swapper else []
        tensors = [t for s in self.inner.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
        shares = {
            "local_gradient_fraction": round(sum(self.grads.values()) / parameters, 4),
            "local_optimizer_state_fraction": round(states / parameters, 4),
            "local_optimizer_state_fraction_on_nvme": round(sum(swapped) / parameters, 4),
            # every state tensor this rank holds (AdamW's two moments, Muon's one momentum), to the byte
            "local_optimizer_state_bytes": sum(local_numel(t) * t.element_size() for t in tensors),
        }
        if hasattr(self.inner, "orthogonalized"):  # --optim muon: its groups, and what its first step applied
            from training.muon import applied

            shares["optimizer"] = applied(self.inner)
        return shares
