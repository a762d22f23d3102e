"""Checks that refuse a launch that could not run as asked, each naming the setting and the fix: FSDP1 on CPU
ranks and its checkpoints, accelerate's tensor parallelism, FSDP's wrap classes and size policy, DeepSpeed's ops.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch

from training.config import RunConfig
from training.core.ops import check_op_cache, launch_ops
from training.environment import Environment
from training.strategy import Strategy, fsdp1_sharding


def check_fsdp1(fsdp_env: Mapping[str, str]) -> None:
    """FSDP1 (torch's FullyShardedDataParallel, flat parameters): on CPU ranks two of its options cannot run, and one
    breaks weight decay everywhere; refused here rather than inside `prepare`."""
    sharding = fsdp1_sharding(fsdp_env)
    if not torch.cuda.is_available():
        if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
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


def check_parallelism_config_tp(tp: int, deepspeed: bool, fsdp_version: int, cfg: RunConfig, env: Environment,
                                world: int = 0) -> None:  # fmt: skip
    """Tensor parallelism from an accelerate config's parallelism_config (`tp_size`) runs under FSDP2, with torch's
    DTensor plan applied by this project (training/axes/tensor.py: accelerate 1.15's own preparation cannot
    import with transformers 5); a DDP config's dp_replicate x tp runs as FSDP2 on a replicate-only mesh
    (`replicated_tensor_parallel`). Refused before the process group: under DeepSpeed (AutoTP is the JSON's
    `tensor_parallel.autotp_size`), FSDP1 (flat parameters hold no DTensor slices), DDP with dp_shard, ring context,
    Ulysses or CPU offload, a degree that does not split every layer evenly or the block (which sequence parallelism
    shards), and degrees that do not multiply to the `world` launched ranks (0: not
    checked)."""
    if tp == 1:
        return
    where = f"the accelerate config's parallelism_config_tp_size: {tp}"
    if deepspeed:
        raise ValueError(
            f"{where} with DeepSpeed: DeepSpeed splits layers itself (AutoTP); set tensor_parallel.autotp_size: {tp} "
            "in the DeepSpeed JSON (ds_configs/autotp.json) and remove parallelism_config_tp_size"
        )
    if fsdp_version == 1:
        raise ValueError(
            f"{where} with fsdp_version: 1 (its flat parameters hold no DTensor slices): tensor parallelism runs "
            "under FSDP2 here; set fsdp_version: 2 (accelerate_configs/fsdp_tp.yaml), or use DeepSpeed AutoTP "
            "(accelerate_configs/autotp.yaml)"
        )
    if not fsdp_version and env.block_degree("dp_shard_size") > 1:  # DDP: whole copies, nothing to shard over
        raise ValueError(
            f"{where} with parallelism_config_dp_shard_size: {env.block_degree('dp_shard_size')} in a DDP config: DDP "
            "keeps whole copies of the split model; set parallelism_config_dp_replicate_size instead, or shard with "
            "FSDP2 (accelerate_configs/fsdp_tp.yaml)"
        )
    unsupported = (
        "parallelism_config_cp_size" if env.block_degree("cp_size") > 1
        else "parallelism_config_sp_size" if env.block_degree("sp_size") > 1
        else "fsdp_offload_params: true" if env.fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        else None
    )  # fmt: skip
    if unsupported:
        raise ValueError(
            f"{where} with {unsupported}: tensor parallelism composes with FSDP2's sharding and hybrid replicas only "
            "in this release; remove one of them"
        )
    from training.axes.tensor import check_tensor_parallel

    check_tensor_parallel(cfg.model_config(), tp)
    check_sequence_shards(cfg, tp, where)
    if world:
        check_block_covers_the_world(env, tp, cfg.pipeline_parallel_degree, world)


def check_block_covers_the_world(env: Environment, tp: int, pp: int, world: int) -> None:
    """The block's degrees times the pipeline's must be the launched ranks, as accelerate itself requires of a block
    (which it is not shown here: training/core/accelerator.py). Read as `accelerate launch` exports it, every size
    given (1 where the YAML has none); a block without its data-parallel sizes (read from a file) is not checked."""
    block = env.block or {}
    if not block.get("dp_shard_size") or not block.get("dp_replicate_size"):
        return
    replicate, shard = env.block_degree("dp_replicate_size"), env.block_degree("dp_shard_size")
    if replicate * shard * tp * pp == world:
        return
    product = f"dp_replicate_size {replicate} x dp_shard_size {shard} x tp_size {tp}"
    product += f" x --pipeline_parallel_degree {pp}" if pp > 1 else ""
    fits = world // (replicate * tp * pp) if world % (replicate * tp * pp) == 0 else None
    fix = f"set parallelism_config_dp_shard_size: {fits}" if fits else f"launch {replicate * shard * tp * pp} ranks"
    raise ValueError(
        f"the accelerate config's parallelism_config gives {product} = {replicate * shard * tp * pp} ranks, but "
        f"{world} were launched: {fix} (accelerate requires the block's degrees to multiply to the launched ranks)"
    )


def check_tensor_parallel_flag(cfg: RunConfig, deepspeed: bool, fsdp: bool, yaml_tp: int) -> None:
    """--tensor_parallel_degree: the model's plan inside each pipeline stage, with DDP's all-reduce across the
    pipelines (training/axes/pipeline.py). Refused before the process group where another setting owns the
    degree (the DeepSpeed JSON, the FSDP YAML's block) or where no pipeline holds the slices (DDP's reducer takes no
    DTensor), and for a degree that does not split every layer evenly or the block."""
    tp = cfg.tensor_parallel_degree
    if tp == 1:
        return
    where = f"--tensor_parallel_degree {tp}"
    if deepspeed:
        raise ValueError(
            f"{where} with a DeepSpeed config: DeepSpeed splits layers itself (AutoTP); set "
            f"tensor_parallel.autotp_size: {tp} in the JSON (ds_configs/autotp.json) and drop the flag"
        )
    if fsdp or yaml_tp > 1:
        what = "an FSDP accelerate config" if fsdp else f"an accelerate config's parallelism_config_tp_size: {yaml_tp}"
        raise ValueError(
            f"{where} with {what}: its degrees live in the YAML; set parallelism_config_tp_size: {tp} in its "
            "parallelism_config (accelerate_configs/fsdp_tp.yaml) and drop the flag"
        )
    if cfg.pipeline_parallel_degree == 1:
        raise ValueError(
            f"{where} without a pipeline: the flag splits pipeline stages; add --pipeline_parallel_degree 2 or more, "
            "or give the degrees in an accelerate config's parallelism_config (DDP: "
            "parallelism_config_dp_replicate_size x parallelism_config_tp_size; FSDP2: accelerate_configs/fsdp_tp.yaml)"
        )
    from training.axes.tensor import check_tensor_parallel

    check_tensor_parallel(cfg.model_config(), tp, flag="--tensor_parallel_degree")
    check_sequence_shards(cfg, tp, where)


def check_sequence_shards(cfg: RunConfig, tp: int, where: str) -> None:
    """Under tensor parallelism each sequence is sharded over the tensor-parallel ranks between their regions
    (Megatron's sequence parallelism, in pipeline stages too): the block must divide by the degree."""
    if cfg.block_size % tp:
        raise ValueError(
            f"{where} does not divide --block_size {cfg.block_size}: under tensor parallelism each sequence is "
            f"sharded over the tensor-parallel ranks between their regions (Megatron's sequence parallelism); choose "
            f"a --block_size that is a multiple of {tp}"
        )


def check_fsdp_wrap(strategy: Strategy, model: torch.nn.Module) -> None:
    """An FSDP config's wrap policy must be one the model can be wrapped with, checked on the model's module tree
    before any process group: accelerate would otherwise fail deep inside `prepare`."""
    policy = strategy.fsdp_env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    min_num_params = int(strategy.fsdp_env.get("FSDP_MIN_NUM_PARAMS", "0"))
    if policy == "SIZE_BASED_WRAP" and strategy.fsdp_version == 2:
        check_fsdp2_size_wrap(min_num_params, model)
    if policy == "SIZE_BASED_WRAP" and strategy.fsdp_version == 1:
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
