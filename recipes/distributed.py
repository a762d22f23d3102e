"""Which strategy the launcher asked for, the `Accelerator` that runs it, and proof that it is in force.

The strategy is read from the launch, never from a flag of the training script: an `accelerate launch`
config (its environment variables), or a DeepSpeed JSON given with `--deepspeed` under the `deepspeed`
launcher or `torchrun`. On machines without a GPU three of accelerate's defaults would silently run
something other than what was asked for, so this module sets them right and `verify_strategy` refuses to
train unless the prepared model really is sharded the way the config says:

- DeepSpeed on CPU needs a gloo process group and `cpu=False` (with `cpu=True` accelerate drops the plugin).
- DDP on CPU needs `cpu=True`, which gives accelerate's gloo `MULTI_CPU` DDP.
- FSDP on CPU: accelerate enables FSDP only for GPU-like device types, although torch's FSDP2 shards a
  model on CPU with gloo. `enable_fsdp_on_cpu` sets accelerate's state to FSDP, so `prepare` runs
  accelerate's own FSDP2 code path (`fully_shard` per decoder layer) exactly as on GPUs.
- FSDP1 (`fsdp_version: 1`) on CPU runs through torch's `FullyShardedDataParallel` with gloo the same way, with
  the device `cpu` and `sync_module_states` off (each needs a GPU; the ranks' weights are identical anyway). Its
  CPU offload, hybrid shard and two checkpoint paths fail on CPU in torch 2.13 and are refused before the process
  group (`fsdp1_strategy`, `check_fsdp1_checkpoints`).
- ZeRO-3 with NVMe parameter offload on CPU swapped fp32 parameters through bf16 buffers (a DeepSpeed
  dtype fallback for devices without fp16); `keep_zero3_param_dtype` keeps the model's dtype.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from .config import RunConfig, autotp_size, load_json, offload_devices, resolve_deepspeed, zero_stage
from .ops import check_op_cache, launch_ops


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_world_size() -> int:
    """Ranks the launcher started (torchrun, accelerate and deepspeed all export WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Strategy:
    """What the launch asked for, resolved before any process group exists."""

    name: str  # single, ddp, fsdp[-hybrid][-shard-grad-op][-offload], zero{1,2,3}[-offload-cpu|-offload-nvme]
    world_size: int
    deepspeed: dict | None = None  # the resolved DeepSpeed config
    deepspeed_source: str | None = None
    fsdp_env: dict = field(default_factory=dict)
    shard_size: int | None = None  # ranks one copy of the model is sharded over (hybrid FSDP: fewer than all)
    tp_size: int = 1  # ranks each layer is split over (tensor parallelism); they train on the same batch

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.deepspeed) if self.deepspeed else 0

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different data: the global batch is micro x accumulation x this."""
        return self.world_size // self.tp_size

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` trains on. Tensor-parallel groups are consecutive ranks
        (DeepSpeed's and accelerate's meshes put the `tp` dimension innermost), so ranks 0..tp-1 share one."""
        return rank // self.tp_size


def requested_strategy(cfg: RunConfig, hidden_size: int) -> Strategy:
    """Read the strategy from the launch and resolve/check its config. No process group is created."""
    world = launched_world_size()
    ds_file = cfg.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    use_fsdp = env_flag("ACCELERATE_USE_FSDP")
    if (ds_file or env_flag("ACCELERATE_USE_DEEPSPEED")) and use_fsdp:
        raise ValueError(
            "both DeepSpeed and FSDP are requested (--deepspeed or a DeepSpeed accelerate config, and an FSDP "
            "accelerate config): launch with one of them"
        )
    apply_launch_precision(cfg)
    check_parallelism_config_tp()
    if ds_file or env_flag("ACCELERATE_USE_DEEPSPEED"):
        if ds_file:
            raw, source = load_json(ds_file), repr(ds_file)
        else:  # an accelerate YAML with inline deepspeed_config fields: the JSON accelerate would build from them
            raw, source = inline_deepspeed_config(), "from the accelerate config's deepspeed_config"
        ds = resolve_deepspeed(raw, cfg, world, hidden_size, source)
        devices = offload_devices(ds)
        offload = next((d for d in (devices["offload_param"], devices["offload_optimizer"]) if d != "none"), None)
        tp = autotp_size(ds)
        name = f"zero{zero_stage(ds)}" + (f"-offload-{offload}" if offload else "") + ("-autotp" if tp > 1 else "")
        return Strategy(name, world, deepspeed=ds, deepspeed_source=source, tp_size=tp)
    if use_fsdp:
        fsdp_env = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
        # Hybrid shard: accelerate's parallelism_config shards over dp_shard ranks and replicates the shards.
        shard_size = int(os.environ.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", world)) if parallelism_config() else world
        if fsdp_version(fsdp_env) == 1:
            check_fsdp1_checkpoints(cfg, fsdp_env)
            return fsdp1_strategy(fsdp_env, world)
        name = "fsdp-hybrid" if shard_size < world else "fsdp"
        if fsdp_env.get("FSDP_SHARDING_STRATEGY") == "SHARD_GRAD_OP" or fsdp_env.get(
            "FSDP_RESHARD_AFTER_FORWARD", "true"
        ).lower() in ("false", "shard_grad_op"):
            name += "-shard-grad-op"
        if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            name += "-offload"
        return Strategy(name, world, fsdp_env=fsdp_env, shard_size=shard_size)
    return Strategy("ddp" if world > 1 else "single", world)


def apply_launch_precision(cfg: RunConfig) -> None:
    """The accelerate config's `mixed_precision` sets the precision when no flag does; a flag that says otherwise
    is refused naming both. `mixed_precision: "no"` (also what `accelerate launch` exports when the YAML has no
    such key) leaves precision to the flags. fp16 needs CUDA: on CPU accelerate turns its autocast off without a
    word, so the run would be fp32 while claiming fp16."""
    launch = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launch not in ("no", "bf16", "fp16"):
        raise ValueError(
            f"the accelerate config sets mixed_precision: {launch}, which this script does not train in: "
            "set mixed_precision: bf16 (or 'no' and pass --bf16)"
        )
    if launch != "no" and cfg.mixed_precision == "no":
        cfg.bf16, cfg.fp16 = launch == "bf16", launch == "fp16"
    elif launch not in ("no", cfg.mixed_precision):
        raise ValueError(
            f"the accelerate config sets mixed_precision: {launch} but the flags give --{cfg.mixed_precision}: "
            f"drop --{cfg.mixed_precision} (the YAML's {launch} is used), or set mixed_precision in the YAML to "
            f"{cfg.mixed_precision}"
        )
    if cfg.fp16 and not torch.cuda.is_available():
        raise ValueError(
            "fp16 (--fp16 or the accelerate config's mixed_precision: fp16) needs a CUDA GPU: on CPU accelerate "
            "silently trains in fp32; pass --bf16 instead (or set mixed_precision: bf16)"
        )


def inline_deepspeed_config() -> dict:
    """The DeepSpeed JSON that accelerate's `DeepSpeedPlugin` builds from an accelerate YAML's inline
    `deepspeed_config` fields (zero_stage, offload devices and NVMe paths, gradient_accumulation_steps,
    gradient_clipping), which `accelerate launch` exports as ACCELERATE_* variables. Built by the plugin itself,
    so it is exactly accelerate's reading; it then goes through `resolve_deepspeed` like any JSON."""
    ds = DeepSpeedPlugin().deepspeed_config
    ds.pop("steps_per_print", None)  # the plugin's float("inf"), which is not JSON; the resolved config sets none
    return ds


def fsdp_version(fsdp_env: dict) -> int:
    """`accelerate launch` exports FSDP_VERSION from the YAML's fsdp_version; a YAML without it is FSDP1."""
    return int(fsdp_env.get("FSDP_VERSION", "1"))


# torch's ShardingStrategy, by the name or number accelerate accepts in fsdp_sharding_strategy.
FSDP1_SHARDING = {
    "1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2",
}  # fmt: skip


def fsdp1_strategy(fsdp_env: dict, world: int) -> Strategy:
    """FSDP1 (torch's FullyShardedDataParallel, flat parameters): named fsdp1[-shard-grad-op|-no-shard][-offload].
    On CPU ranks two of its options cannot run, and are refused here rather than inside `prepare`."""
    sharding = fsdp_env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    sharding = FSDP1_SHARDING.get(sharding, sharding)
    offload = fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
    if not torch.cuda.is_available():
        if offload:
            # torch 2.13 torch/distributed/fsdp/_flat_param.py:1260, FlatParamHandle.init_flat_param_attributes:
            # `flat_param._local_shard = flat_param._local_shard.pin_memory()`, unconditionally under CPU offload;
            # pinning needs an accelerator ("Cannot access accelerator device when none is available").
            raise ValueError(
                "fsdp_offload_params: true with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 pins the "
                "offloaded shards in page-locked memory, which needs a GPU): set fsdp_offload_params: false, or use "
                "fsdp_version: 2 (its CPUOffloadPolicy runs on CPU)"
            )
        if sharding.startswith("HYBRID"):
            raise ValueError(
                f"fsdp_sharding_strategy: {sharding} with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 "
                "builds its intra-node groups from the GPU count): use fsdp_version: 2 with a parallelism_config "
                "(dp_replicate_size x dp_shard_size), which runs hybrid sharding on CPU"
            )
    if fsdp_env.get("FSDP_USE_ORIG_PARAMS", "true").lower() != "true":
        raise ValueError(
            "fsdp_use_orig_params: false with fsdp_version: 1 flattens each wrapped module's parameters into one, so "
            "AdamW's weight decay could not skip norms and biases, and accelerate would leave the optimizer holding "
            "the replaced parameters (nothing trains): set fsdp_use_orig_params: true"
        )
    suffix = {"FULL_SHARD": "", "SHARD_GRAD_OP": "-shard-grad-op", "NO_SHARD": "-no-shard"}.get(sharding)
    if suffix is None:
        raise ValueError(
            f"fsdp_sharding_strategy: {sharding} is not one of torch's: set FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD or HYBRID_SHARD_ZERO2"
        )
    name = "fsdp1" + suffix + ("-offload" if offload else "")
    return Strategy(name, world, fsdp_env=fsdp_env, shard_size=1 if sharding == "NO_SHARD" else world)


def check_fsdp1_checkpoints(cfg: RunConfig, fsdp_env: dict) -> None:
    """FSDP1 trains on CPU ranks, but two of its checkpoint paths fail there (torch 2.13, accelerate 1.15, measured
    on the `debug` preset): saving a FULL_STATE_DICT checkpoint ended the run at its first save, and a run resumed
    from a SHARDED_STATE_DICT checkpoint at step 2 logged the straight run's loss at step 3 but not at step 4
    (5.3806 against 5.3906: Adam's restored state differs). FSDP2's checkpoints resume exactly
    (tests/recipes/test_resume.py)."""
    if torch.cuda.is_available():
        return
    if cfg.resume_from_checkpoint:
        raise ValueError(
            f"--resume_from_checkpoint {cfg.resume_from_checkpoint} with fsdp_version: 1 on CPU ranks: FSDP1 does not "
            "restore Adam's state exactly here; start afresh without it, or train with fsdp_version: 2, whose "
            "checkpoints resume exactly"
        )
    if cfg.save_steps and fsdp_env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT").upper() == "FULL_STATE_DICT":
        raise ValueError(
            f"--save_steps {cfg.save_steps} with fsdp_version: 1 and fsdp_state_dict_type: FULL_STATE_DICT on CPU "
            "ranks: the first save ends the run here; set fsdp_state_dict_type: SHARDED_STATE_DICT, or pass "
            "--save_steps 0 (the trained model is still exported at the end)"
        )


def check_parallelism_config_tp() -> None:
    """Tensor parallelism from an accelerate config's parallelism_config (`tp_size`, with or without FSDP2) is
    refused before the process group: accelerate 1.15 prepares such a model in `Accelerator._prepare_tp`, whose
    FSDP2 branch (accelerate/accelerator.py:1618) runs `from transformers.integrations.tensor_parallel import
    ReplicateParallel` for the parameters the plan leaves whole (the norms), and transformers 5.23 has no such class
    (its replicated style is `ReplicatedWithGradAllReduce`): the ImportError would end every rank inside `prepare`,
    on GPUs as on CPUs. Without FSDP (`tp_size` = the world) it is refused too: this script has no data-parallel
    gradient reduction for it. DeepSpeed AutoTP splits the same plan and trains."""
    tp = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1")) if parallelism_config() else 1
    if tp > 1:
        raise ValueError(
            f"the accelerate config's parallelism_config sets tp_size: {tp}, which accelerate 1.15 cannot prepare with "
            "transformers 5.23 (accelerate/accelerator.py:1618 imports transformers' removed ReplicateParallel): "
            "for tensor parallelism launch accelerate_configs/autotp.yaml or --deepspeed ds_configs/autotp.json "
            "(DeepSpeed AutoTP), or remove parallelism_config_tp_size"
        )


def parallelism_config() -> bool:
    """Whether the accelerate config has a `parallelism_config` block (`accelerate launch` exports it)."""
    return env_flag("ACCELERATE_USE_PARALLELISM_CONFIG")


def check_fsdp_wrap(strategy: Strategy, model: torch.nn.Module) -> None:
    """An FSDP config's wrap policy must be one the model can be wrapped with, checked on the model's module tree
    before any process group: accelerate would otherwise fail deep inside `prepare`."""
    policy = strategy.fsdp_env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    min_num_params = int(strategy.fsdp_env.get("FSDP_MIN_NUM_PARAMS", "0"))
    if policy == "SIZE_BASED_WRAP" and fsdp_version(strategy.fsdp_env) == 2:
        check_fsdp2_size_wrap(min_num_params, model)
    if policy == "SIZE_BASED_WRAP" and fsdp_version(strategy.fsdp_env) == 1:
        check_fsdp1_size_wrap(min_num_params, model)
    if policy != "TRANSFORMER_BASED_WRAP":
        return  # accelerate reads fsdp_transformer_layer_cls_to_wrap only under TRANSFORMER_BASED_WRAP
    names = strategy.fsdp_env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if not names:
        return  # accelerate takes the model's _no_split_modules (ShardGPTDecoderLayer)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names.split(",") if n.strip() and n.strip() not in present]
    if missing:
        raise ValueError(
            f"the FSDP config's fsdp_transformer_layer_cls_to_wrap names {missing}, which this model does not have; "
            f"set it to {sorted(model._no_split_modules)} or remove it (the model's _no_split_modules are used)"
        )


def check_fsdp2_size_wrap(min_num_params: int, model: torch.nn.Module) -> None:
    """accelerate's FSDP2 version of SIZE_BASED_WRAP (`fsdp2_prepare_auto_wrap_policy`, accelerate 1.15) wraps
    every module above fsdp_min_num_params, containers included, unlike torch's FSDP1 policy, which skips them;
    `fully_shard` then refuses the decoder's ModuleList ("does not support containers that do not implement
    forward"). A threshold of 0 means no wrapping (accelerate drops the policy), which runs."""
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    too_big = [
        (name, n)
        for name, m in model.named_modules()
        if isinstance(m, containers) and (n := sum(p.numel() for p in m.parameters())) > min_num_params
    ]
    if min_num_params > 0 and too_big:
        name, n = too_big[0]
        raise ValueError(
            f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP with fsdp_version: 2 and fsdp_min_num_params: {min_num_params} "
            f"would wrap the container {name!r} ({n} parameters), which FSDP2's fully_shard refuses: use "
            f"fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, or fsdp_min_num_params of {n} or more"
        )


def check_fsdp1_size_wrap(min_num_params: int, model: torch.nn.Module) -> None:
    """torch's size-based policy wraps the embedding and the output layer each on its own once the threshold is
    at most their size; with tied embeddings FSDP1 then flattens the one shared matrix into two flat parameters,
    and the tie is gone (seen: a parameter count larger by one embedding)."""
    embedding = model.get_input_embeddings().weight.numel()
    if getattr(model.config, "tie_word_embeddings", False) and 0 < min_num_params <= embedding:
        raise ValueError(
            f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP with fsdp_version: 1 and fsdp_min_num_params: {min_num_params} "
            f"would wrap the tied input and output embeddings ({embedding} parameters) apart, untying them: set "
            f"fsdp_min_num_params above {embedding}, or use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"
        )


def check_deepspeed_ops(strategy: Strategy) -> None:
    """Before any process group: refuse a launch whose ranks would wait forever on a lock left by a killed
    build of a DeepSpeed op, and say which ops this launch compiles (minutes, otherwise silent)."""
    if strategy.deepspeed is None:
        return
    to_build = check_op_cache(launch_ops(strategy.deepspeed, torch.cuda.is_available()))
    if to_build and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line per node
        ops = f"{', '.join(to_build)} op{'s' if len(to_build) > 1 else ''}"
        print(
            f"DeepSpeed compiles its {ops} now, on first use here: minutes with no output, cached for later "
            "launches (`python recipes/doctor.py --build-ops` compiles ahead)",
            file=sys.stderr,
            flush=True,
        )


def make_accelerator(cfg: RunConfig, strategy: Strategy) -> Accelerator:
    """The Accelerator for `strategy`. Creating it initialises the process group (a collective)."""
    on_cpu = not torch.cuda.is_available()
    handlers = []
    if strategy.world_size > 1:
        handlers.append(InitProcessGroupKwargs(backend="gloo" if on_cpu else None, timeout=timedelta(minutes=30)))
    kwargs = dict(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to.split(","),
        project_dir=cfg.output_dir,
        dynamo_backend="inductor" if cfg.torch_compile else None,  # None: as the accelerate config says
        kwargs_handlers=handlers,
        # The loop steps the scheduler once per optimizer step; accelerate's default would step it once per
        # process, assuming a data loader that it sharded itself.
        step_scheduler_with_optimizer=False,
    )
    if strategy.deepspeed is not None:
        keep_zero3_param_dtype()
        # The YAML's inline fields (and its mixed_precision) are already resolved into the config; without this,
        # accelerate refuses a config dict beside them ("the following accelerate config variables will be ignored").
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=strategy.deepspeed)
    elif on_cpu:
        kwargs["cpu"] = True  # gloo MULTI_CPU; FSDP is switched on below
    fsdp_on_cpu = bool(strategy.fsdp_env) and on_cpu
    if fsdp_on_cpu:
        # sync_module_states broadcasts rank 0's weights (cpu_ram_efficient_loading forces it on, for
        # transformers' from_pretrained on rank 0 alone, which this script does not use); torch's FSDP1 and
        # accelerate's plugin both demand a GPU for it. Every rank here builds identical weights from the same
        # seed, so there is nothing to sync.
        os.environ["FSDP_SYNC_MODULE_STATES"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    hybrid_on_cpu = fsdp_on_cpu and parallelism_config()
    if hybrid_on_cpu:
        # accelerate checks a parallelism_config against the state's distributed type when the Accelerator is
        # built, which on CPU is MULTI_CPU until FSDP is switched on: the config is applied after that instead.
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    accelerator = Accelerator(**kwargs)
    if fsdp_on_cpu and accelerator.distributed_type != DistributedType.FSDP:
        enable_fsdp_on_cpu(accelerator)
    if hybrid_on_cpu and strategy.shard_size != strategy.world_size:
        apply_parallelism_config_on_cpu(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP and cfg.mixed_precision != "no":
        plugin = accelerator.state.fsdp_plugin
        plugin.mixed_precision_policy = fsdp_precision(cfg, plugin.fsdp_version)
    return accelerator


def fsdp_precision(cfg: RunConfig, fsdp_version: int = 2):
    """FSDP's mixed precision, as the project defines it (docs/precision.md): parameters gathered and computed
    in the low precision, gradients reduced in fp32 and the model's output (the loss) in fp32. accelerate's
    `set_mixed_precision` would reduce and return in the low precision too, rounding the logged loss to bf16;
    `--bf16_gradient_reduction` opts in to bf16 reduction (half the traffic, less exact). FSDP1's policy has no
    output dtype: the loss is computed under accelerate's autocast, which runs cross-entropy in fp32."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    low = torch.bfloat16 if cfg.bf16 else torch.float16
    reduce = low if cfg.bf16_gradient_reduction else torch.float32
    if fsdp_version == 1:
        return MixedPrecision(param_dtype=low, reduce_dtype=reduce, buffer_dtype=low)
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce, output_dtype=torch.float32)


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


def enable_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Run accelerate's FSDP path on CPU ranks (see the module docstring). The plugin reads the FSDP_*
    variables that `accelerate launch` exported from the YAML, as it does on GPUs; its precision policy is set
    by `make_accelerator` (`fsdp_precision`), on GPUs and CPUs alike."""
    plugin = FullyShardedDataParallelPlugin()
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinning host memory needs a GPU driver
    accelerator.state.fsdp_plugin = plugin
    # Both shared states: every new AcceleratorState() copies PartialState's fields over its own.
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    if plugin.fsdp_version == 1:
        # accelerate's MULTI_CPU device is `cpu:0` (an index from torch.cpu.device_count()), which FSDP1 receives as
        # `device_id` and refuses against its CPU compute device `cpu` ("Inconsistent compute device and device_id").
        accelerator.state.device = PartialState().device = torch.device("cpu")


def apply_parallelism_config_on_cpu(accelerator: Accelerator) -> None:
    """The YAML's parallelism_config (hybrid shard: dp_replicate x dp_shard) on CPU ranks, as accelerate applies
    it on GPUs: the config and its device mesh on the state, checked against the now-FSDP accelerator. Building
    the mesh is a collective."""
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig()  # sizes from the PARALLELISM_CONFIG_* variables of `accelerate launch`
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    config._validate_accelerator(accelerator)


def verify_strategy(accelerator: Accelerator, model: torch.nn.Module, strategy: Strategy) -> dict:
    """Refuse to train unless the prepared model is sharded as the launch asked. Returns what was seen:
    the strategy, the world size and the fraction of the parameters this rank holds."""
    world = strategy.world_size
    dist_world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if accelerator.num_processes != world or dist_world != world:
        raise RuntimeError(
            f"the launcher started {world} ranks but accelerate runs {accelerator.num_processes} process(es) "
            f"over a process group of {dist_world} ({accelerator.distributed_type}); every rank would train "
            "alone on the whole dataset. With `use_cpu: true` in an accelerate config accelerate drops "
            "DeepSpeed and FSDP: set `use_cpu: false` (this script uses gloo on CPU by itself)"
        )
    model = uncompiled(model)  # under --torch_compile: OptimizedModule(DDP) or OptimizedModule(FSDP module)
    unwrapped = accelerator.unwrap_model(model)
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

    if strategy.deepspeed is not None:
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            refuse(f"the prepared model is a {type(model).__name__}, not a DeepSpeedEngine")
        if model.zero_optimization_stage() != strategy.zero_stage:
            refuse(f"the engine runs ZeRO stage {model.zero_optimization_stage()}")
        sharded = strategy.zero_stage == 3 and world > 1
        if sharded and local > total / world * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (ZeRO-3 should hold about 1/{world})")
        if strategy.tp_size > 1:
            seen["tensor_parallel"] = verify_autotp(model, unwrapped, strategy, refuse)
    elif strategy.fsdp_env:
        if accelerator.distributed_type != DistributedType.FSDP:
            refuse(f"accelerate runs {accelerator.distributed_type}")
        shards = strategy.shard_size or world
        if shards > 1 and local > total / shards * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (FSDP should hold about 1/{shards})")
    elif world > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        refuse(f"the prepared model is a {type(model).__name__}, not DistributedDataParallel")
    return seen


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
    # transformers' merged plan, full module names: the config's base_model_tp_plan, the head's _tp_plan, and the
    # embedding split over the vocabulary (embedding_rowwise), which AutoTP shares with the tied head.
    counts: dict[str, int] = {}
    for name, module in unwrapped.named_modules():
        style = next((s for pattern, s in unwrapped.tp_plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        whole, split = tuple(getattr(module, "_orig_weight_shape", ())), tuple(module.weight.shape)
        dim = 1 if style == "rowwise" else 0  # weights are (out, in); an embedding's (vocabulary, hidden)
        want = tuple(n // tp if d == dim else n for d, n in enumerate(whole))
        if not whole or split != want:
            refuse(f"{name} ({style}) holds a weight of {split}, not 1/{tp} of {whole or split} along dim {dim}")
        counts[style] = counts.get(style, 0) + 1
    return {"size": tp, "data_parallel_size": strategy.data_parallel_size, "split_modules": counts}


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
    # torch.compile's wrapper (accelerate compiles DDP and FSDP models), or a DeepSpeed engine that compiled itself.
    compiled = hasattr(model, "_orig_mod") or bool(getattr(model, "is_compiled", False))
    seen = {"compiled": compiled} | observe_precision(model)
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


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """The whole model's weights for the export (a collective: ZeRO-3 and FSDP gather their shards).

    FSDP1 on CPU ranks: accelerate gathers with `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`, and
    torch 2.13 then crashed rank 0 with a segmentation fault while cloning the gathered tensors (in
    `_full_post_state_dict_hook`, torch/distributed/fsdp/_state_dict_utils.py:332). Offloading is pointless where
    the weights already live in host memory; gathered on every rank without it, the export is whole."""
    handles = _fsdp1_handles(model)
    if handles and handles[0].device.type == "cpu":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        whole = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, whole):
            return model.state_dict()  # collective: every rank gathers
    return accelerator.get_state_dict(model)


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


BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
PREEMPTED = 75  # exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL, "try again later"


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint (recipes/preemption.py)."""


def all_ranks_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise maximum of small integers over the ranks: every rank gets the same answer (a collective when
    the process group exists; the values themselves on a single process)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # collective: every rank
    return t.tolist()


def _is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def remove_deepspeed_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (its `shm_comm` op, deepspeed 0.19.8 `ops/csrc/cpu/comm/shm.cpp`) creates one
    shared-memory file per rank, /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
    (69 MB), and never removes it: every CPU launch left its files behind, and /dev/shm is RAM (12 GB had piled
    up on a test machine). This rank's file is unlinked at exit; mappings the other ranks still hold stay valid."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if addr and port and rank:
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}").unlink(missing_ok=True)


def run_rank(main: Callable[[], object], errors: tuple[type[BaseException], ...] = BAD_INPUT) -> NoReturn:
    """Run a launched script's `main` and end the process. Bad input (and `errors`) ends with one line,
    `error: ...`, and exit status 2 instead of a traceback (set SHARDGPT_TRACEBACK=1 to see it); an error that
    every rank raises alike (its `same_on_every_rank` is true) is printed by rank 0 alone. A run stopped
    by a preemption signal after its checkpoint ends with rank 0's one line and exit status `PREEMPTED` (75).

    A rank that used a process group exits without interpreter finalization. In torch 2.13 the gloo
    backend's worker threads outlive `destroy_process_group` once DDP, FSDP or DeepSpeed have held the
    group (they keep it alive from C++; the threads are still there after garbage collection), and a
    rank that had finished and written everything has been seen to abort during finalization with
    "terminate called without an active exception" (exit -6), failing a completed run. Everything is
    flushed here first; the script has already finished its trackers and destroyed the group."""
    # DeepSpeed (0.19.8) calls torch's deprecated collective names; under ZeRO-3 the FutureWarning was
    # printed again and again (2,384 times in a 30-step `tiny` run), burying everything else on stderr.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        category=FutureWarning,
    )
    try:
        main()
        code = 0
    except errors as e:
        if os.environ.get("SHARDGPT_TRACEBACK"):
            raise
        if not (getattr(e, "same_on_every_rank", False) and not _is_rank_0()):  # else rank 0 says it for all
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except Preempted as e:
        if _is_rank_0():  # rank 0 only: one line for the whole run
            print(e, file=sys.stderr, flush=True)
        code = PREEMPTED
    remove_deepspeed_shm_buffer()
    if launched_world_size() <= 1:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
