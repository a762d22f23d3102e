"""Tensor parallelism's launch checks and what it reads back as in force: the degree against the model's shapes
and the launch's other settings, refused before any process group in one line naming the setting and the fix;
after `prepare`, every module of the model's plan split as the plan says, by DeepSpeed AutoTP (ZeRO) or by the
DTensor plan (FSDP2, training/axes/tensor/plan.py). Imported only by a launch that splits layers."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import NoReturn

import torch

from training.config import RunConfig
from training.environment import Environment
from training.strategy import Strategy


def check_tensor_parallel(config, tp: int, flag: str = "parallelism_config_tp_size") -> None:
    """Refuse a tensor-parallel degree that does not split every layer evenly: each rank holds heads / tp query
    heads, kv heads / tp key-value heads, intermediate / tp MLP columns and vocab / tp rows of the embedding and the
    head. Before any process group."""
    if tp == 1:
        return
    for what, size in (("num_attention_heads", config.num_attention_heads),
                       ("num_key_value_heads", config.num_key_value_heads),
                       ("intermediate_size", config.intermediate_size),
                       ("vocab_size", config.vocab_size)):  # fmt: skip
        if size % tp:
            fits = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ValueError(
                f"{flag} = {tp} does not divide the model's {what} ({size}): each tensor-parallel rank holds an equal "
                f"share of it; set {flag} to one of {fits}"
            )


def check_parallelism_config_tp(tp: int, deepspeed: bool, fsdp_version: int, cfg: RunConfig, env: Environment) -> None:
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
    check_tensor_parallel(cfg.model_config(), tp)
    check_sequence_shards(cfg, tp, where)


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


# ---------------------------------------------------------------------------------------------- in force


def verify_tensor_parallel(engine, unwrapped: torch.nn.Module, strategy: Strategy,
                           refuse: Callable[[str], NoReturn]) -> dict:  # fmt: skip
    """The layers split as the launch asked: by DeepSpeed AutoTP inside a DeepSpeed engine, by the model's DTensor
    plan under FSDP2. Returns the count of each style."""
    if strategy.family == "deepspeed":
        return verify_autotp(engine, unwrapped, strategy, refuse)
    return verify_dtensor_tp(unwrapped, strategy, refuse)


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
    from training.axes.tensor.plan import split_modules

    tp = strategy.tp_size
    counts = split_modules(model, tp)
    layers = len(model.model.layers)
    planned: dict[str, int] = {"embedding_rowwise": 1, "colwise_gather_output": 1}  # split by vocabulary rows
    for style in model.config.base_model_tp_plan.values():
        planned[style] = planned.get(style, 0) + layers
    if counts != planned:
        refuse(f"the modules split over {tp} tensor-parallel ranks are {counts}, not the plan's {planned}")
    return {"size": tp, "data_parallel_size": strategy.data_parallel_size, "split_modules": counts}
