"""What a launch asks for, read and checked before any process group exists: the strategy
named by the launcher's environment and the DeepSpeed JSON, the world size, the precision, and the
checks that refuse a launch which could not run as asked (FSDP wrap classes, DeepSpeed ops, FSDP1).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from accelerate.utils import (
    DeepSpeedPlugin,
)

from training.config import RunConfig, autotp_size, load_json, offload_devices, resolve_deepspeed, zero_stage
from training.ops import check_op_cache, launch_ops


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
    refused before the process group. accelerate 1.15 applies it in `Accelerator._prepare_tp`, which skips a
    model without DTensor parameters (accelerate/accelerator.py:1598-1603, a warning only: FSDP2 alone would then
    shard it, and each tensor-parallel pair would hold the same shards), so the model must arrive already split
    (DTensors on the mesh's `tp` dimension); then its FSDP2 branch (accelerate/accelerator.py:1618) runs
    `from transformers.integrations.tensor_parallel import ReplicateParallel` for the parameters the plan leaves
    whole (the norms), and transformers 5.23 has no such class (`accelerate_tp_importable`): the ImportError would
    end every rank inside `prepare`, on GPUs as on CPUs. Without FSDP (`tp_size` = the world) it is refused too:
    this script has no data-parallel gradient reduction for it. DeepSpeed AutoTP splits the same plan and trains;
    torch's own FSDP2 x TP of this model's plan trains like one process (tests/model/test_tensor_parallel.py)."""
    tp = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1")) if parallelism_config() else 1
    if tp > 1:
        blocker = (
            "accelerate/accelerator.py:1618 imports transformers' removed ReplicateParallel"
            if not accelerate_tp_importable()
            else "this script builds no DTensor model for accelerate's tensor-parallel preparation"
        )
        raise ValueError(
            f"the accelerate config's parallelism_config sets tp_size: {tp}, which accelerate 1.15 cannot prepare with "
            f"transformers 5.23 ({blocker}): for tensor parallelism launch accelerate_configs/autotp.yaml or "
            "--deepspeed ds_configs/autotp.json (DeepSpeed AutoTP), or remove parallelism_config_tp_size"
        )


def accelerate_tp_importable() -> bool:
    """Whether the class accelerate's FSDP2 x TP preparation imports exists in the installed transformers."""
    from transformers.integrations import tensor_parallel

    return hasattr(tensor_parallel, "ReplicateParallel")


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
