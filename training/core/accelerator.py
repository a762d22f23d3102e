"""The `Accelerator` for a launch, and the switches that let accelerate run every GPU strategy
on CPU ranks (FSDP and HSDP on gloo, FSDP2's precision policy, ZeRO-3's parameter dtype).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from training.axes.sequence import accelerator_parallelism_config
from training.compat import keep_zero3_param_dtype, skip_deepspeed_muon
from training.config import RunConfig
from training.environment import Environment
from training.strategy import Strategy


def make_accelerator(cfg: RunConfig, strategy: Strategy, env: Environment) -> Accelerator:
    """The Accelerator for `strategy`, launched under `env`. Creating it initialises the process group (a
    collective)."""
    on_cpu = not torch.cuda.is_available()
    handlers = []
    if strategy.world_size > 1:
        handlers.append(InitProcessGroupKwargs(backend="gloo" if on_cpu else None, timeout=timedelta(minutes=30)))
    kwargs = dict(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to.split(","),
        project_dir=cfg.output_dir,
        # --torch_compile compiles each decoder layer before `prepare` (training/core/build.py); whole-model
        # compilation by accelerate is left to an accelerate config that asks for it (dynamo_backend).
        kwargs_handlers=handlers,
        # The loop steps the scheduler once per optimizer step; accelerate's default would step it once per
        # process, assuming a data loader that it sharded itself.
        step_scheduler_with_optimizer=False,
    )
    if strategy.deepspeed is not None:
        keep_zero3_param_dtype()
        skip_deepspeed_muon(strategy.deepspeed)  # 2.7 s of CPU a rank otherwise (training/compat.py)
        # The YAML's inline fields (and its mixed_precision) are already resolved into the config; without this,
        # accelerate refuses a config dict beside them ("the following accelerate config variables will be ignored").
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=strategy.deepspeed)
        # Ulysses from the JSON's sequence_parallel_size: the parallelism config with which `prepare` registers
        # DeepSpeed's sequence-parallel attention and groups (an accelerate YAML's own block is read by accelerate).
        kwargs["parallelism_config"] = accelerator_parallelism_config(strategy.mesh, env)
    elif on_cpu:
        kwargs["cpu"] = True  # gloo MULTI_CPU; FSDP is switched on below
    # FSDP through accelerate's FSDP state on CPU ranks, and for DDP x TP (a DDP YAML's parallelism_config, held by
    # FSDP2 on a replicate-only mesh: training/parallel/launch.replicated_tensor_parallel) on any device.
    switch_to_fsdp = strategy.family == "fsdp" and (on_cpu or not env.fsdp)
    if switch_to_fsdp:
        # sync_module_states broadcasts rank 0's weights (cpu_ram_efficient_loading forces it on, for
        # transformers' from_pretrained on rank 0 alone, which this script does not use); torch's FSDP1 and
        # accelerate's plugin both demand a GPU for it. Every rank here builds identical weights from the same
        # seed, so there is nothing to sync.
        os.environ["FSDP_SYNC_MODULE_STATES"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    hybrid_switched = switch_to_fsdp and env.block is not None
    tensor_parallel = strategy.family == "fsdp" and strategy.tp_size > 1
    if hybrid_switched or tensor_parallel:
        # accelerate checks a parallelism_config against the state's distributed type when the Accelerator is
        # built, which on CPU is MULTI_CPU until FSDP is switched on: the config is applied after that instead.
        # With tensor parallelism accelerate never sees it, on any device: its `prepare` would import a class
        # transformers 5 removed; the project shards the model on the block's degrees (training/axes/tensor.py).
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    accelerator = Accelerator(**kwargs)
    if switch_to_fsdp and accelerator.distributed_type != DistributedType.FSDP:
        for name, value in strategy.fsdp_env.items():  # DDP x TP: FSDP2, the plugin's defaults otherwise
            os.environ.setdefault(name, value)
        enable_fsdp(accelerator)
    if hybrid_switched and strategy.replicas > 1 and not tensor_parallel:
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


def enable_fsdp(accelerator: Accelerator) -> None:
    """Run accelerate's FSDP path where accelerate's state is not FSDP: on CPU ranks (see the module docstring), and
    for DDP x TP on any device (a DDP YAML, whose model FSDP2 holds on a replicate-only mesh). The plugin reads the
    FSDP_* variables that `accelerate launch` exported from the YAML, as it does on GPUs; its precision policy is set
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
