"""Checkpoints across strategies and numbers of ranks, through one strategy-neutral form.

The neutral form is a dict keyed by the HF parameter names: the full fp32 weights, AdamW's `exp_avg` and
`exp_avg_sq`, and the optimizer step. `read_checkpoint` builds it offline, in one process, from what each strategy
writes, with the libraries' own readers: DeepSpeed's `ds_to_universal` for ZeRO-1/2/3, torch's `dcp_to_torch_save`
for FSDP2's torch.distributed.checkpoint folders, plain files for DDP and one process. `load_neutral` puts it into
the objects `accelerator.prepare` returned, with the libraries' own setters: torch's `set_model_state_dict` and
`set_optimizer_state_dict` (full state dicts) for DDP and FSDP, DeepSpeed's `safe_set_full_fp32_param` and
`safe_set_full_optimizer_state` for ZeRO. The scheduler, the data position and (same number of ranks) the RNG
states are the checkpoint's own files, which every strategy writes alike.

A resume under the strategy and number of ranks that wrote the checkpoint loads it natively
(`accelerator.load_state`); any other goes through the neutral form, converted once by rank 0 into the checkpoint
directory (`neutral.pt`).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from training.strategy import Strategy

STATE = "trainer_state.json"
NEUTRAL = "neutral.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------- which checkpoints convert


def family(strategy: Strategy) -> str:
    """What decides the checkpoint's files: the ZeRO strategy itself (stage and offload: the offload JSONs hand the
    schedule to the engine, which saves it elsewhere), `fsdp1`, `fsdp` (FSDP2, any sharding), `plain` (DDP and one
    process) or `pipeline` (any pipeline layout)."""
    if strategy.pp_size > 1:  # pipeline stages: torch.distributed.checkpoint folders as FSDP2's, each rank its part
        return "pipeline"
    if strategy.family == "deepspeed":
        return strategy.name
    if strategy.family == "fsdp":
        return "fsdp1" if strategy.fsdp_version == 1 else "fsdp"
    return "plain"


def written_by(saved: dict) -> Strategy:
    """The strategy a checkpoint was written under, from its trainer state's record (strategy.json's fields)."""
    return Strategy.from_name(saved["strategy"], saved["world_size"])


def needs_conversion(saved: dict, strategy: Strategy, world: int) -> bool:
    """Whether a checkpoint written under `saved` (its trainer state's strategy) must be converted, rather than load
    natively here. A pipeline's checkpoint, or a pipeline run, always goes through the neutral form: exact in fp32,
    whichever stages each rank holds."""
    if "pipeline" in (family(written_by(saved)), family(strategy)):
        return True
    return family(written_by(saved)) != family(strategy) or saved["world_size"] != world


def refusal(saved: dict, strategy: Strategy, world: int) -> str | None:
    """Why a checkpoint written under `saved` cannot resume in this launch, or None."""
    if not needs_conversion(saved, strategy, world):
        return None
    for side, where in ((written_by(saved), "the checkpoint's"), (strategy, "this launch's")):
        if side.offload_device == "nvme" or family(side) == "fsdp1":
            return (
                f"{saved['strategy']} on {saved['world_size']} ranks cannot resume under {strategy.name} on {world} "
                f"ranks: {where} {side.name} is not converted (NVMe swap files, FSDP1's flat parameters); resume "
                "under the strategy and ranks that wrote it, or move between DDP, FSDP2 and ZeRO-1/2/3 with or "
                "without CPU offload"
            )
    return None


# ---------------------------------------------------------------------- reading a checkpoint, offline


def read_checkpoint(path: Path) -> dict:
    """The neutral form of a checkpoint: {"step", "weights", "exp_avg", "exp_avg_sq"}, tensors on the CPU."""
    path = Path(path)
    state = json.loads((path / STATE).read_text())
    written = written_by(state["strategy"])
    kind = family(written)
    if written.family == "deepspeed" and written.offload_device != "nvme":
        return _read_zero(path, meta_model(state))
    if kind in ("fsdp", "pipeline"):
        return _read_dcp(path)
    if kind == "plain":
        return _read_plain(path, state)
    raise ValueError(f"checkpoint {str(path)!r} was written by {kind}, whose checkpoints are not converted")


def meta_model(state: dict) -> torch.nn.Module:
    """The checkpoint's model without memory, for its parameter names, shapes and optimizer groups."""
    from model import ShardGPTConfig, ShardGPTForCausalLM

    with torch.device("meta"):
        return ShardGPTForCausalLM(ShardGPTConfig.from_dict(state["model_config"]))


def _read_zero(path: Path, model: torch.nn.Module) -> dict:
    """DeepSpeed's universal checkpoint: one folder per parameter with fp32.pt, exp_avg.pt and exp_avg_sq.pt.
    accelerate's save path does not record the `universal_checkpoint_info` DeepSpeed asks for; its defaults (no
    tensor or pipeline parallelism) are what `inject_missing_state` fills in. ZeRO-3's come flat: reshaped here."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tag = (path / "latest").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        args = argparse.Namespace(
            input_folder=str(path / tag), output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True,
        )  # fmt: skip
        ds_to_universal(args)
        zero = Path(tmp) / "zero"
        neutral = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
        shapes = {name: p.shape for name, p in model.named_parameters()}
        # A tied weight (lm_head.weight) gets a folder of its own without moments: its parameter is the embedding.
        for folder in sorted(p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()):
            for key, file in (("weights", "fp32"), *((m, m) for m in MOMENTS)):
                saved = torch.load(folder / f"{file}.pt", weights_only=False)
                saved = saved["param"] if isinstance(saved, dict) else saved
                neutral[key][folder.name] = saved.float().reshape(shapes[folder.name]).contiguous()
        step_files = sorted(zero.glob("*/step.pt"))
        if step_files:  # ZeRO-1/2: a step per parameter, all equal
            step = torch.load(step_files[0], weights_only=False)
        else:  # ZeRO-3: in the common optimizer state
            common = torch.load(zero / "optimizer_state.pt", weights_only=False)
            step = common["optimizer_state_dict"]["state"][0]["step"]
    return {"step": int(step), **neutral}


def _read_dcp(path: Path) -> dict:
    """FSDP2's torch.distributed.checkpoint folders (and a pipeline's, written alike: each stage's parameters under
    their HF names), gathered into one state dict each by torch's converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path / "pytorch_model_fsdp_0", Path(tmp) / "model.pt")
        dcp_to_torch_save(path / "optimizer_0", Path(tmp) / "optimizer.pt")
        weights = torch.load(Path(tmp) / "model.pt", weights_only=False)["model"]
        optim = torch.load(Path(tmp) / "optimizer.pt", weights_only=False)["optimizer"]
    return _from_optimizer_state(weights, optim["state"])


def _read_plain(path: Path, state: dict) -> dict:
    """DDP's and one process's files: the model's safetensors and torch's optimizer state dict, whose parameters
    are numbered in the order of the optimizer's parameter groups (rebuilt here on a meta model)."""
    from safetensors.torch import load_file

    from training.adamw import param_groups

    model = meta_model(state)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.0, state["run_config"]["decay_embeddings"])
    order = [names[id(p)] for g in groups for p in g["params"]]
    optim = torch.load(path / "optimizer.bin", weights_only=False)
    numbers = [i for g in optim["param_groups"] for i in g["params"]]
    by_name = {name: optim["state"][i] for name, i in zip(order, numbers, strict=True)}
    return _from_optimizer_state(load_file(path / "model.safetensors"), by_name)


def _from_optimizer_state(weights: dict, state: dict) -> dict:
    """The neutral form from weights and an optimizer state keyed by parameter name."""
    neutral = {"step": int(next(iter(state.values()))["step"]), "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, moments in state.items():
        neutral["weights"][name] = weights[name].float().contiguous()
        for key in MOMENTS:
            neutral[key][name] = moments[key].float().contiguous()
    return neutral


# ---------------------------------------------------------------------- loading into prepared objects


def load_neutral(net, optimizer, neutral: dict) -> None:
    """Weights, Adam's moments and step into the prepared model and optimizer (a collective: every rank calls it
    with the same neutral form)."""
    if hasattr(net, "zero_optimization_stage"):  # a DeepSpeedEngine
        _load_zero(net, optimizer, neutral)
    else:
        _load_torch(net, optimizer, neutral)


def _load_torch(net, optimizer, neutral: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from training.core.inspection import optimizer_chain, uncompiled

    full = StateDictOptions(full_state_dict=True)
    module, torch_optimizer = uncompiled(net), optimizer_chain(optimizer)[-1]
    weights = neutral["weights"]
    template = get_model_state_dict(module, options=full)  # collective under FSDP: gathers, for the keys
    tied = getattr(accelerated_module(module), "_tied_weights_keys", None) or {}
    model_sd = {k: weights[k if k in weights else tied[k]].to(v.dtype) for k, v in template.items()}
    set_model_state_dict(module, model_sd, options=full)  # collective under FSDP: each rank keeps its shard
    optim_sd = get_optimizer_state_dict(module, torch_optimizer, options=full)  # collective; initialises the state
    for name, state in optim_sd["state"].items():
        state["step"] = torch.tensor(float(neutral["step"]), dtype=state["step"].dtype)
        for key in MOMENTS:  # a pipeline's last stage names the tied embedding's copy lm_head.weight
            state[key] = neutral[key][name if name in neutral[key] else tied[name]].to(state[key].dtype)
    set_optimizer_state_dict(module, torch_optimizer, optim_sd, options=full)  # collective under FSDP


def accelerated_module(module):
    """The model inside DDP (`module`), or the model itself."""
    return getattr(module, "module", module)


def _load_zero(engine, optimizer, neutral: dict) -> None:
    """ZeRO-3 parameters are set through `GatheredParameters` (rank 0's full value re-partitioned); ZeRO-1/2 keep
    whole parameters on every rank. The fp32 master copy and the moments go through DeepSpeed's setters, each rank
    keeping its partition."""
    from deepspeed import zero
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from training.core.inspection import optimizer_chain

    inner = optimizer_chain(optimizer)[-1]  # the torch (or DeepSpeed CPU) Adam over this rank's fp32 partitions
    init_zero_adam_state(engine.optimizer, inner)
    stage3 = engine.zero_optimization_stage() == 3
    for name, param in engine.module.named_parameters():
        full = neutral["weights"][name]
        with zero.GatheredParameters([param], modifier_rank=0, enabled=stage3):  # collective under ZeRO-3
            param.data.copy_(full.view_as(param).to(param.dtype))
        safe_set_full_fp32_param(param, full)
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, neutral[key][name], key)
    for state in inner.state.values():
        step = state.get("step")
        state["step"] = (
            torch.tensor(float(neutral["step"]), dtype=step.dtype) if torch.is_tensor(step) else neutral["step"]
        )


def scheduler_state(path: Path) -> dict:
    """accelerate's `scheduler.bin`, or, when the DeepSpeed engine owned the scheduler (a JSON that defines the
    optimizer, as the offload configs do), the `lr_scheduler` entry of the engine's model states."""
    if (path / "scheduler.bin").is_file():
        return torch.load(path / "scheduler.bin", weights_only=False)
    tag = (path / "latest").read_text().strip()
    states = sorted((path / tag).glob("*model_states.pt"))
    return torch.load(states[0], weights_only=False)["lr_scheduler"]


def gather_neutral(net, optimizer) -> dict:
    """The neutral form of the prepared model and optimizer, on every rank (a collective: ZeRO and FSDP gather their
    shards), with the libraries' getters."""
    from training.core.inspection import optimizer_chain, uncompiled

    inner = optimizer_chain(optimizer)[-1]
    step = int(next(s for s in inner.state.values() if s)["step"])
    if hasattr(net, "zero_optimization_stage"):  # a DeepSpeedEngine
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        neutral = {"step": step, "weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, param in net.module.named_parameters():  # collective per parameter
            neutral["weights"][name] = safe_get_full_fp32_param(param).cpu()
            for key in MOMENTS:
                neutral[key][name] = safe_get_full_optimizer_state(param, key).cpu()
        return neutral
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = StateDictOptions(full_state_dict=True)
    weights, optim = get_state_dict(uncompiled(net), inner, options=full)  # collective under FSDP
    return _from_optimizer_state(weights, optim["state"])


def init_zero_adam_state(zero_optimizer, inner: torch.optim.Optimizer) -> None:
    """Adam creates its moments at its first step, and this engine has not stepped yet, so DeepSpeed's setters have
    nothing to write into. Created here as Adam would, zero, on the fp32 partitions they are keyed by (ZeRO-3 puts
    its partitions in the optimizer's groups only during the step, so torch's state_dict API cannot create them);
    ZeRO-1/2 then link each parameter to its share of them, as at their first step."""
    flats = (
        getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3's
        or getattr(zero_optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2's
        or zero_optimizer.fp32_groups_flat_partition  # ZeRO-1 in bf16 with fp32 accumulation: BF16_Optimizer's
    )
    for flat in flats:
        if not inner.state.get(flat):
            # torch's Adam keeps the step as a float tensor; DeepSpeed's CPU Adam as an int
            step = torch.tensor(0.0) if isinstance(inner, torch.optim.Adam) else 0
            inner.state[flat] = {"step": step, **{key: torch.zeros_like(flat) for key in MOMENTS}}
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def load_around(path: Path, optimizer, scheduler, rank: int, same_world: bool) -> None:
    """The strategy-independent files: the scheduler (and the learning rate it sets for the next step), and each
    rank's RNG states when the number of ranks is the checkpoint's."""
    scheduler.load_state_dict(scheduler_state(path))
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    if same_world:
        states = torch.load(path / f"random_states_{rank}.pkl", weights_only=False)
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
