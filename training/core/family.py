"""The data-parallel families, one module each: one process and DDP (`ddp.py`), FSDP2 with FSDP1's YAMLs
(`fsdp.py`), DeepSpeed ZeRO-1/2/3 with its offloads (`zero.py`). accelerate wraps the model for all of them; a
family's module holds what the project does around that call, readable top to bottom: its strategy built from the
launch and its checks, the Accelerator's settings, how the model is built (whole, on the meta device and sharded,
or inside `zero.Init`), its precision policy, its gradient norm, what it reads back as in force, its checkpoint
format and the export's gather.

The launch, the build, the loop, the checkpoints and the export ask the launch's family (`family_of`); none of them
branches on which family it is. A family's module is imported only by a launch of that family. `Family` holds what
most families do alike; each module overrides what its family does otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from training.config import RunConfig
    from training.environment import Environment
    from training.strategy import Strategy

MODULES = {"single": "ddp", "ddp": "ddp", "fsdp": "fsdp", "deepspeed": "zero"}
"""Which module of training/core/ serves each `Strategy.family` (FSDP1's YAMLs: `fsdp1`)."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's states per parameter, in the strategy-neutral checkpoint form (training/checkpoints/portable.py)."""
STATES = (*MOMENTS, "momentum_buffer")
"""Every optimizer state the neutral form holds per parameter: AdamW's moments, Muon's momentum (training/muon.py);
each parameter has those of the optimizer that steps it."""


def family_of(strategy: Strategy) -> Family:
    """The family that runs `strategy`, its module imported now."""
    return family_named(strategy.family, strategy.fsdp_version)


def family_named(family: str, fsdp_version: int = 2) -> Family:
    """The family of a `Strategy.family` name (and FSDP version), its module imported now."""
    module = "fsdp1" if family == "fsdp" and fsdp_version == 1 else MODULES[family]
    # the import statement's own machinery (not importlib's), so that `-X importtime` counts it as every other import
    return __import__(f"training.core.{module}", fromlist=["FAMILY"]).FAMILY


def family_for(accelerator: Accelerator | None) -> Family:
    """The family of an Accelerator as made (`make_accelerator`): for what only needs the prepared state. Without one
    (the HF Trainer's build, before its Accelerator exists), ZeRO-3's where transformers' DeepSpeed config says so."""
    if accelerator is None:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        kind = "DEEPSPEED" if is_deepspeed_zero3_enabled() else "NO"
    else:
        kind = accelerator.distributed_type.name
    if kind == "FSDP":
        return family_named("fsdp", accelerator.state.fsdp_plugin.fsdp_version)
    return family_named("deepspeed" if kind == "DEEPSPEED" else "ddp")


class Family:
    """What a family does at each point of a run; the defaults are one process's and DDP's."""

    # ------------------------------------------------------------------ the launch, before any process group

    def check_start(self, strategy: Strategy) -> None:
        """On every rank before the process group, with side effects allowed (a line saying what is compiled)."""

    def accelerator_kwargs(self, cfg: RunConfig, strategy: Strategy, env: Environment) -> dict:
        """What the Accelerator is made with, beside the run's own settings."""
        return {} if torch.cuda.is_available() else {"cpu": True}  # gloo MULTI_CPU

    def configure(self, accelerator: Accelerator, cfg: RunConfig, strategy: Strategy, env: Environment) -> None:
        """The Accelerator as made, set up for the family (its state switched, its precision policy)."""

    # ------------------------------------------------------------------ the model

    def sharded_build(self, accelerator: Accelerator | None, config, model_name_or_path: str | None):
        """Where the family builds the model empty and shards it before its weights are written (FSDP2): the
        checkpoint's files to read into the shards ([] for fresh weights); None to build it whole."""
        return None

    def fresh_model(self, config):
        """A new model built as the family builds it (ZeRO-3: partitioned as it is built, inside `zero.Init`), its
        weights drawn; None: whole, as one process builds it (training/core/build.py)."""
        return None

    def after_prepare(self, net: torch.nn.Module, cfg: RunConfig) -> None:
        """After `accelerator.prepare`: what the family fixes on the wrapped model."""

    # ------------------------------------------------------------------ a step

    def norm_group(self, net: torch.nn.Module, strategy: Strategy):
        """The ranks that hold shards of the plain (non-DTensor) gradients, for their norm (None: each whole)."""
        return None

    def clips_itself(self) -> bool:
        """Whether the engine clips inside its own step and reports the norm after it (DeepSpeed)."""
        return False

    # ------------------------------------------------------------------ what is in force

    def parameter_counts(self, model: torch.nn.Module, unwrapped: torch.nn.Module) -> tuple[int, int]:
        """(this rank's, the whole model's) parameter elements, whatever this rank holds of them."""
        from training.core import wrapped

        return sum(wrapped.local_numel(p) for p in unwrapped.parameters()), wrapped.parameter_count(unwrapped)

    def verify(self, accelerator: Accelerator, model, unwrapped, strategy: Strategy, local: int, total: int,
               refuse) -> None:  # fmt: skip
        """Refuse (`refuse(why)`) a prepared model that is not wrapped as the family should wrap it."""
        world = strategy.world_size
        if world > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            refuse(f"the prepared model is a {type(model).__name__}, not DistributedDataParallel")

    def observe(self, model: torch.nn.Module, optimizer) -> dict:
        """What the prepared objects say of the family's sharding and precision, for strategy.json."""
        return {}

    def full_state_dict(self, accelerator: Accelerator, model: torch.nn.Module) -> dict:
        """The whole model's weights for the export (collective where the family shards them)."""
        from training.core.wrapped import unwrap

        # the model inside DDP, unwrapped without importing DeepSpeed (`unwrap`)
        return accelerator.get_state_dict(unwrap(accelerator, model), unwrap=False)

    def export_parts(self, accelerator: Accelerator, model: torch.nn.Module):
        """The whole model's weights for the export, in parts that rank 0 writes one by one (collectives: every rank
        iterates them; training/core/gather.py): here one part, the whole model, which every rank holds."""
        yield self.full_state_dict(accelerator, model)

    # ------------------------------------------------------------------ checkpoints in the neutral form

    def checkpoint_format(self, strategy: Strategy) -> str:
        """What decides the files of this family's checkpoints: two launches with the same format read each other's
        checkpoints natively."""
        return "plain"

    def converts(self, strategy: Strategy) -> bool:
        """Whether a checkpoint of `strategy` converts through the neutral form (to or from another strategy)."""
        return True

    def read_neutral(self, path, state: dict) -> dict:
        """The neutral form of a checkpoint this family wrote, offline in one process: DDP's and one process's
        files, the model's safetensors and torch's optimizer state dict, whose parameters are numbered in the order
        of the optimizer's parameter groups (rebuilt here on a meta model)."""
        from safetensors.torch import load_file

        from training.checkpoints.safety import safe_load

        model = meta_model(state)
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in optimizer_groups(model, state["run_config"]) for p in g["params"]]
        optim = safe_load(path / "optimizer.bin")
        numbers = [i for g in optim["param_groups"] for i in g["params"]]
        by_name = {name: optim["state"][i] for name, i in zip(order, numbers, strict=True)}
        return from_optimizer_state(load_file(path / "model.safetensors"), by_name)

    def load_neutral(self, net, optimizer, neutral: dict) -> None:
        """Weights, Adam's moments and step into the prepared model and optimizer, with torch's full state dict
        setters (collective under FSDP: each rank keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from training.core.wrapped import optimizer_chain, uncompiled

        full = StateDictOptions(full_state_dict=True)
        module, torch_optimizer = uncompiled(net), optimizer_chain(optimizer)[-1]
        weights = neutral["weights"]
        template = get_model_state_dict(module, options=full)  # collective under FSDP: gathers, for the keys
        tied = getattr(getattr(module, "module", module), "_tied_weights_keys", None) or {}  # DDP's inner model
        model_sd = {k: weights[k if k in weights else tied[k]].to(v.dtype) for k, v in template.items()}
        set_model_state_dict(module, model_sd, options=full)  # collective under FSDP: each rank keeps its shard
        optim_sd = get_optimizer_state_dict(module, torch_optimizer, options=full)  # collective; creates the state
        for name, state in optim_sd["state"].items():
            if "step" in state:  # AdamW's; Muon's matrices count no steps
                state["step"] = torch.tensor(float(neutral["step"]), dtype=state["step"].dtype)
            for key in STATES & state.keys():  # a pipeline's last stage names the tied embedding's copy lm_head.weight
                state[key] = neutral[key][name if name in neutral[key] else tied[name]].to(state[key].dtype)
        set_optimizer_state_dict(module, torch_optimizer, optim_sd, options=full)  # collective under FSDP

    def gather_neutral(self, net, optimizer) -> dict:
        """The neutral form of the prepared model and optimizer on every rank, with torch's getters (collective
        under FSDP: the shards gathered)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from training.core.wrapped import optimizer_chain, uncompiled

        inner = optimizer_chain(optimizer)[-1]
        weights, optim = get_state_dict(uncompiled(net), inner, options=StateDictOptions(full_state_dict=True))
        return from_optimizer_state(weights, optim["state"])

    def scheduler_state(self, path) -> dict:
        """accelerate's `scheduler.bin`."""
        from training.checkpoints.safety import safe_load

        return safe_load(path / "scheduler.bin")

    def muon_refusal(self, strategy: Strategy) -> str | None:
        """Why `--optim muon` cannot run under this family's `strategy` (training/muon.py), or None."""
        return None

    def muon_layout(self, strategy: Strategy):
        """Where the optimizer sees the matrices in flat partitions (ZeRO's `ZeroLayout`); None: as tensors."""
        return None

    def async_refusal(self, strategy: Strategy) -> str | None:
        """Why `--save_async` cannot save this family's checkpoints in the background, or None."""
        return None

    def save_async(self, accelerator: Accelerator, net, optimizer, scheduler, path, staged: dict) -> list:
        """`--save_async`'s part before the step goes on: this rank's share of the state copied to host memory, the
        small files written; returns the writes that put the copy on disk, run in a thread
        (training/checkpoints/background.py); `staged` keeps the copies, which the next save writes over. One process
        and DDP: accelerate's own files, from a copy of the weights and AdamW's states (rank 0's alone: every rank
        holds the same)."""
        from functools import partial

        from accelerate.utils import SAFE_WEIGHTS_NAME, save

        from training.core.staging import durable, host_copy, write_small_files

        small = write_small_files(accelerator, scheduler, path)  # the random states, the schedule: written now
        if not accelerator.is_main_process:
            return [partial(durable, small)]
        # the model's names, as accelerate's save_state writes them
        weights = staged["weights"] = host_copy(accelerator.get_state_dict(net), staged.get("weights"))
        moments = staged["moments"] = host_copy(optimizer.state_dict(), staged.get("moments"))

        def write(obj, name: str, safe: bool):
            save(obj, path / name, safe_serialization=safe)  # accelerate's writer, as its save_state calls it
            durable([path / name])

        return [partial(write, weights, SAFE_WEIGHTS_NAME, True), partial(write, moments, "optimizer.bin", False),
                partial(durable, small)]  # fmt: skip


def meta_model(state: dict) -> torch.nn.Module:
    """A checkpoint's model (its trainer state's `model_config`) without memory: its parameter names, shapes and
    optimizer groups."""
    from model import ShardGPTConfig, ShardGPTForCausalLM

    with torch.device("meta"):
        return ShardGPTForCausalLM(ShardGPTConfig.from_dict(state["model_config"]))


def optimizer_groups(model: torch.nn.Module, run_config: dict) -> list[dict]:
    """The parameter groups, in order, of the optimizer a checkpoint's run (its `run_config`) made for `model`."""
    if run_config.get("optim", "adamw_torch") == "muon":
        from types import SimpleNamespace

        from training.muon import muon_param_groups

        return muon_param_groups(model, SimpleNamespace(**run_config))
    from training.adamw import param_groups

    return param_groups(model, 0.0, run_config["decay_embeddings"])


def from_optimizer_state(weights: dict, state: dict) -> dict:
    """The neutral form from weights and an optimizer state keyed by parameter name: {"step", "weights", and each
    of `STATES` the optimizer keeps}, fp32 tensors."""
    neutral = {"step": int(next(s["step"] for s in state.values() if "step" in s)), "weights": {}}
    for name, states in state.items():
        neutral["weights"][name] = weights[name].float().contiguous()
        for key in STATES & states.keys():
            neutral.setdefault(key, {})[name] = states[key].float().contiguous()
    return neutral
