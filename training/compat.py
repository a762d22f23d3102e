"""The versions this project runs on, checked at start-up, and the one place that touches private APIs.

The floors are the oldest releases the test suite runs on (`make test-floor` for torch, the lock for the rest; the
same floors as pyproject.toml's ranges, which a test keeps equal). A launch on an older release ends before any
heavy work with one line naming the installed version, what needs more and the fix.

Private APIs, each used because no public one does the job, checked on torch 2.11-2.14 and deepspeed 0.19.8:
- torch's CUDA memory history and snapshot (`torch.cuda.memory._record_memory_history`, `_dump_snapshot`): the
  APIs torch's own memory-visualisation guide uses; GPU only.
- whether a function is torch.compile's wrapper (`_torchdynamo_orig_callable`, which `torch.compile` sets on what it
  returns for a function): to report the compiled decoder layers in strategy.json.
- how torch's JIT extension build locks its directory (whether `torch.utils.cpp_extension` still uses `FileBaton`):
  see `build_lock_blocks`.
- torch's dispatch mode (`torch.utils._python_dispatch.TorchDispatchMode`, which torch's own `CommDebugMode` is built
  on, but that counts calls only), an operator's schema (`OpOverload._schema`) and a functional collective's group
  (`_resolve_process_group`): to count every collective a step calls, in bytes (training/loop/comms.py); checked on
  2.13.
- torch's functional collectives' `AsyncCollectiveTensor`: a DTensor redistribution's output not waited for yet,
  whose storage cannot be read; the saved-tensor counter waits for it (`arrived`, training/measure/saved.py),
  and a compiled first decoder layer takes it arrived (`is_in_flight`, training/axes/tensor/plan.py).
- DeepSpeed's `zero.Init` dtype choice (`InsertPostInitMethodToModuleSubClasses._set_dtype`), patched where the
  device has no fp16 (CPU): see `keep_zero3_param_dtype`.
- torch < 2.13's grouped `fully_shard([a, b, ...])` casts forward inputs to the policy's `param_dtype` at the group's
  first module only (`_register_group_forward_hooks` runs the state's pre-forward once per group); 2.13 casts at each
  module. accelerate groups the final norm with the (tied) embedding and head, so on 2.11 the head received the last
  layer's fp32 output against its bf16 weight: see `cast_grouped_inputs` (no private API; keyed on the version).
- torch.distributed.checkpoint's helpers that copy a state dict, DTensors and all, into host buffers made once
  (`_create_cpu_state_dict`, `_copy_state_dict`: what its writer's `cache_staged_state_dict` uses, which pins its
  buffers and so needs a GPU): `copy_into_host`, for --save_async's copy (training/core/staging.py).
- whether torch's multi-stage pipeline schedules open each stage's links by sending to every neighbouring stage, its
  own rank's included (torch < 2.13's `_get_init_p2p_neighbors_ops`; from 2.13 `PipelineScheduleMulti._warmup_p2p`
  hands a same-rank neighbour its value in memory): gloo has no link from a rank to itself, see
  `pipeline_sends_to_own_rank`.
- the operators torchtitan's per-op selective recomputation keeps (the flash and memory-efficient attention kernels,
  sdpa's CPU kernel, the functional reduce-scatter: `torch.ops.aten._scaled_dot_product_*`,
  `torch.ops._c10d_functional.reduce_scatter_tensor`) and torch's pytree leaves of an op's output, for the measurement
  of what that policy keeps (training/measure/saved.PerOpPolicy): see `selective_kept_ops`, `tensor_leaves`.
- torch.optim.Muon's Newton-Schulz iteration and learning-rate adjustment (`torch.optim._muon.
  _zeropower_via_newtonschulz`, `_adjust_lr`; torch 2.9 and newer): torch's Muon steps whole tensors only, so the
  project's Muon (training/muon.py) runs torch's own iteration on the matrices it gathers from shards and partitions.
- DeepSpeed's ZeRO optimizer check importing its Muon module (`deepspeed.runtime.zero.muon.muon_optimizer`): kept
  out of a run whose optimizer is not Muon, see `skip_deepspeed_muon`.
"""

from __future__ import annotations

import sys
import types
from importlib.metadata import version

import torch
from packaging.version import Version
from torch.optim._muon import _adjust_lr as muon_adjust_lr  # noqa: F401  (training/muon.py)
from torch.optim._muon import _zeropower_via_newtonschulz as muon_newton_schulz  # noqa: F401  (training/muon.py)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (training/loop/comms.py's base class)

# The oldest release of each that the suite runs on (pyproject.toml's lower bounds).
FLOORS = {"torch": "2.11", "transformers": "5.24", "accelerate": "1.15", "deepspeed": "0.19.8"}
WHY = {
    "torch": "the oldest torch whose compiler, FSDP2 and DTensor this project is tested with",
    "transformers": "the model follows transformers 5.24's cache API (`cache=`, `BaseModelOutputWithPast.cache`)",
    "accelerate": "FSDP2 preparation and the DeepSpeed plugin as this project drives them",
    "deepspeed": "the ZeRO config model, CPU Adam and the NVMe swapper this project reads",
}


def check_versions() -> None:
    """Refuse, in one line, an installed release older than its floor (read from the packages' metadata: nothing
    is imported)."""
    for name in FLOORS:
        installed = version(name)
        if Version(installed).release < Version(FLOORS[name]).release:
            raise ValueError(
                f"{name} {installed} is installed, but this project needs {name} >= {FLOORS[name]} ({WHY[name]}): "
                f"pip install '{name}>={FLOORS[name]}' (for torch, the build for your CUDA: see the README's set-up)"
            )


# ------------------------------------------------------------------------------------------------ private APIs


def build_lock_blocks() -> bool:
    """Whether torch's JIT extension build (DeepSpeed's ops) locks with a file whose mere existence blocks.

    Up to torch 2.13 the build holds `<op>/lock` as a file (`FileBaton`): every other process waits for as long as
    it exists, and a killed build leaves it behind. From 2.14 it holds an OS advisory lock on that file (filelock),
    which the kernel releases when its holder dies; the file stays and blocks nothing (pytorch issue 189245)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def is_compiled_function(fn) -> bool:
    """Whether `fn` is what `torch.compile` returned for a function or method."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def collective_group_size(func, args: tuple, kwargs: dict) -> int:
    """The size of the process group a collective operator `func` runs over: its `process_group` argument (c10d
    operators, passed by the dispatcher as a TorchScript object) or its `group_size` / `group_name` (functional
    collectives)."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if arg.name == "process_group":
            return (value if isinstance(value, ProcessGroup) else ProcessGroup.unbox(value)).size()
        if arg.name == "group_size" and value is not None:
            return int(value)
        if arg.name == "group_name":
            return _resolve_process_group(value).size()
    return torch.distributed.get_world_size()


def is_in_flight(tensor) -> bool:
    """Whether `tensor` is a functional collective's output torch has not waited for yet (`AsyncCollectiveTensor`)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return isinstance(tensor, AsyncCollectiveTensor)


def arrived(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or, where it is the output of a functional collective torch has not waited for yet, that output
    once it has arrived (its storage is not readable before)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def record_cuda_memory_history() -> None:
    """Start recording the CUDA caching allocator's history (for `dump_cuda_memory_snapshot`)."""
    torch.cuda.memory._record_memory_history(max_entries=100_000)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocator history (open it at https://pytorch.org/memory_viz) and stop recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def keep_zero3_param_dtype() -> None:
    """Make ZeRO-3 keep the model's parameter dtype where the device has no fp16 (CPU).

    When the engine partitions an existing model it passes the model's dtype to `zero.Init`, but
    `InsertPostInitMethodToModuleSubClasses._set_dtype` (deepspeed 0.19.8) reads
    `dtype or torch.float16 if fp16_supported else torch.bfloat16 ...`, which on a device without fp16
    ignores the dtype and answers bf16. Under NVMe parameter offload the swapper then stores fp32
    partitions in bf16 buffers: measured on the `tiny` preset, the embedding was rounded to bf16 when
    `prepare` returned (max error 2.4e-4) and the step-1 loss moved by 7e-6 relative. On GPUs the
    expression already returns the given dtype, so nothing is changed there."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    if get_accelerator().is_fp16_supported() or getattr(ZeroInit._set_dtype, "keeps_given_dtype", False):
        return
    upstream = ZeroInit._set_dtype

    def _set_dtype(self, ds_config, dtype):
        upstream(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    _set_dtype.keeps_given_dtype = True
    ZeroInit._set_dtype = _set_dtype


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def skip_deepspeed_muon(ds_config: dict) -> None:
    """Keep DeepSpeed's Muon optimizer module unimported in a run that does not use Muon.

    deepspeed 0.19.8 imports `deepspeed.runtime.zero.muon.muon_optimizer` in every ZeRO engine (its supported-
    optimizer check, zero/utils.py; ZeRO-1/2/3's and the bf16 optimizer's set-up) for one thing only:
    `isinstance(optimizer, MuonWithAuxAdam)`. Importing it applies `torch.compile` to Muon's kernels as it defines
    them, which loads torch's inductor: 2.7 s of CPU on every rank of every ZeRO launch here (measured with cProfile
    on a 2-core AMD EPYC), a fifth of a short CPU run, for an optimizer nobody asked for. In its place stands a module
    whose `MuonWithAuxAdam` no optimizer is an instance of, so every one of those checks answers as it would.
    Not done where the DeepSpeed config's own optimizer is Muon, or where the module is already imported."""
    optimizer = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    if "muon" in optimizer or MUON in sys.modules:
        return
    stand_in = types.ModuleType(MUON, "DeepSpeed's Muon module's stand-in in a run without Muon (training/compat.py)")

    class MuonWithAuxAdam:  # never instantiated: DeepSpeed only asks whether the optimizer is one
        pass

    stand_in.MuonWithAuxAdam = MuonWithAuxAdam
    sys.modules[MUON] = stand_in


def cast_grouped_inputs(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """On torch < 2.13, each FSDP2 unit below the root casts its floating-point positional inputs to `dtype` (the
    policy's `param_dtype`) before its own forward, as torch 2.13 does for every module of a grouped `fully_shard`
    (see the module docstring). A unit whose group already cast them finds them in `dtype` (no copy)."""
    if Version(torch.__version__).release >= (2, 13):
        return
    from torch.distributed.fsdp import FSDPModule

    def cast(module, args):
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for module in net.modules():
        if module is not net and isinstance(module, FSDPModule):
            module.register_forward_pre_hook(cast)


def pipeline_sends_to_own_rank() -> str | None:
    """The installed torch's version where its multi-stage schedules open the links between stages with a send from
    each stage to each neighbour, a neighbour on the same rank included, as torch 2.11 does; None where they hand a
    same-rank neighbour its value in memory (2.13 and 2.14: `PipelineScheduleMulti._warmup_p2p`). gloo makes no send
    from a rank to itself ("Pair is not connected", 2.11 and 2.13 alike), so a V-shaped schedule, whose middle stages
    share a rank, fails there on the first step (training/axes/pipeline/schedules.check_schedule_on_gloo)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return None if hasattr(PipelineScheduleMulti, "_warmup_p2p") else torch.__version__


def selective_kept_ops() -> set:
    """The operators besides matrix multiplies whose outputs torchtitan's per-op selective recomputation keeps
    (`_save_list` in its parallelize_llama.py): attention's kernels, flash and memory-efficient, with sdpa's CPU
    kernel for CPU ranks, and the functional collectives' reduce-scatter."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}  # fmt: skip


def tensor_leaves(tree) -> list:
    """The leaves of an op's output (a tensor, or a tuple or list of them)."""
    return torch.utils._pytree.tree_leaves(tree)


def copy_into_host(state_dict: dict, buffers: dict | None) -> dict:
    """`state_dict` (DTensors and all) copied into `buffers` (None: host buffers made now, pinned where there is a
    GPU), as torch.distributed.checkpoint's writer stages it; returns the copy."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    if buffers is None:
        buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
    return _copy_state_dict(state_dict, buffers, non_blocking=False)
