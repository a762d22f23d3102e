"""FSDP2 (torch's `fully_shard`): every rank holds 1/N of each parameter, gathers a decoder layer's parameters for its
forward and backward (all-gather) and reduce-scatters its gradients, through accelerate's FSDP plugin, which reads
the YAML's fsdp_config. FSDP1's YAMLs run as this family, with what their flat parameters change
(training/core/fsdp1.py).

What the project does around accelerate's `prepare` for this family, in order:
- the strategy from the launch's FSDP_* variables: sharding, offload, hybrid replicas from the YAML's
  parallelism_config; the wrap policy checked on the model's module tree (`check_fsdp_wrap`);
- the Accelerator: accelerate enables FSDP only for GPU-like devices, so on CPU ranks its state is switched to FSDP
  after it is made (`enable_fsdp`), hybrid sharding's device mesh built there too; the precision policy is the
  project's: low-precision compute, fp32 gradient reduction and an fp32 output (`fsdp_precision`);
- the model built on the meta device and sharded as `prepare` would shard it, then written shard by shard, fresh
  from the seed or read from a safetensors checkpoint row by row (`sharded_build`, `shard_on_meta`);
- the gradient norm: FSDP2's gradients are DTensors that say how they are sharded (training/core/gradnorm.py);
- what is in force: each rank's share of the parameters, the resharding, the policy and offload of every unit;
- checkpoints: torch.distributed.checkpoint folders (`pytorch_model_fsdp_0`, `optimizer_0`), read offline by torch's
  converter; the export gathers the full state dict.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from model import ShardGPTConfig
from training.config import RunConfig
from training.core.build import empty_model, local, temporaries
from training.core.family import Family
from training.core.gather import fsdp2_parts
from training.core.staging import fsdp2_async_save, sharded_only
from training.deepspeed_config import DeepSpeedJSON
from training.environment import Environment
from training.strategy import Strategy


class FullyShardedDataParallel(Family):
    """FSDP2 (`fully_shard`); FSDP1's YAMLs run as `training.core.fsdp1.FSDP1`, what differs overridden."""

    # ------------------------------------------------------------------ the launch

    def strategy(self, cfg: RunConfig, env: Environment, degrees: dict, ds: DeepSpeedJSON | None) -> Strategy:
        """The strategy accelerate's FSDP_* variables run on the launched ranks; the wrap policy checked on the
        model's module tree (on the meta device: no memory)."""
        from model import ShardGPTForCausalLM
        from training.core.ddp import pipeline_fields

        tp = env.block_degree("tp_size")
        replicas = hybrid_replicas(env, env.world, degrees["cp"], tp, degrees["pp"])
        strategy = self.read_strategy(env.fsdp_env, env.world, replicas, cp=degrees["cp"], tp=tp,
                                      **pipeline_fields(cfg))  # fmt: skip
        with torch.device("meta"):
            self.check_wrap(strategy, ShardGPTForCausalLM(cfg.model_config()))
        return strategy

    def read_strategy(self, fsdp_env: Mapping[str, str], world: int, replicas: int, **degrees) -> Strategy:
        return fsdp_strategy(fsdp_env, world, replicas, **degrees)

    def check_wrap(self, strategy: Strategy, model: torch.nn.Module) -> None:
        check_fsdp_wrap(strategy, model)

    def accelerator_kwargs(self, cfg: RunConfig, strategy: Strategy, env: Environment) -> dict:
        switched = not torch.cuda.is_available() or not env.fsdp  # CPU ranks; DDP x TP on any device
        if switched:
            # sync_module_states broadcasts rank 0's weights (cpu_ram_efficient_loading forces it on, for
            # transformers' from_pretrained on rank 0 alone, which this script does not use); torch's FSDP1 and
            # accelerate's plugin both demand a GPU for it. Every rank here builds identical weights from the same
            # seed, so there is nothing to sync.
            os.environ["FSDP_SYNC_MODULE_STATES"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
        if (switched and env.block is not None) or strategy.tp_size > 1:
            # accelerate checks a parallelism_config against the state's distributed type when the Accelerator is
            # built, which on CPU is MULTI_CPU until FSDP is switched on: the config is applied after that instead.
            # With tensor parallelism accelerate never sees it, on any device: its `prepare` would import a class
            # transformers 5 removed; the project shards the model on the block's degrees (training/axes/tensor/).
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        return super().accelerator_kwargs(cfg, strategy, env)

    def configure(self, accelerator, cfg: RunConfig, strategy: Strategy, env: Environment) -> None:
        if accelerator.distributed_type != DistributedType.FSDP:
            for name, value in strategy.fsdp_env.items():  # DDP x TP: FSDP2, the plugin's defaults otherwise
                os.environ.setdefault(name, value)
            enable_fsdp(accelerator)
            if env.block is not None and strategy.replicas > 1 and strategy.tp_size == 1:
                apply_parallelism_config_on_cpu(accelerator)
        if cfg.mixed_precision != "no":
            plugin = accelerator.state.fsdp_plugin
            plugin.mixed_precision_policy = fsdp_precision(cfg, plugin.fsdp_version)

    # ------------------------------------------------------------------ the model

    def sharded_build(self, accelerator, config, model_name_or_path: str | None):
        """FSDP2 builds the model on the meta device and shards it, unless accelerate's `cpu_ram_efficient_loading`
        (it loads rank 0's whole model into the shards) or `fsdp_activation_checkpointing` (`prepare` wraps the
        decoder layers before sharding them, looking them up by their unsharded class) is on; a checkpoint only where
        its safetensors hold every parameter (else transformers loads it whole)."""
        plugin = accelerator.state.fsdp_plugin
        if plugin.fsdp_version != 2 or plugin.cpu_ram_efficient_loading or plugin.activation_checkpointing:
            return None
        if model_name_or_path is None:
            return []
        return checkpoint_covering(model_name_or_path, config) or None

    def shard_built(self, accelerator, net: torch.nn.Module, files: list[Path]) -> torch.nn.Module:
        """`net`, built on the meta device, sharded (`shard_on_meta`; collective: the device mesh), then its shards
        written: each rank reads its rows of every tensor of `files`, or draws fresh weights module by module."""
        from training.core.build import initialize

        net = shard_on_meta(accelerator, net)
        if files:
            load_shards(files, dict(net.named_parameters()))
        else:
            initialize(net, sharded_whole)
        return net

    def after_prepare(self, net: torch.nn.Module, cfg: RunConfig) -> None:
        from training.compat import cast_grouped_inputs

        if cfg.mixed_precision != "no":
            cast_grouped_inputs(net, fsdp_precision(cfg).param_dtype)  # torch < 2.13: the tail unit's own casts

    # ------------------------------------------------------------------ a step, what is in force, the export

    def verify(self, accelerator, model, unwrapped, strategy: Strategy, local: int, total: int, refuse) -> None:
        if accelerator.distributed_type != DistributedType.FSDP:
            refuse(f"accelerate runs {accelerator.distributed_type}")
        shards = strategy.shard_size
        if shards > 1 and local > total / shards * 1.05 + 1024:
            refuse(f"this rank holds {local} of {total} parameters (FSDP should hold about 1/{shards})")

    def observe(self, model: torch.nn.Module, optimizer) -> dict:
        """FSDP2's policy, resharding and offload of every unit."""
        groups = [(type(m).__name__, g) for m in model.modules() if (g := fsdp_param_group(m)) is not None]
        if not groups:
            return {}
        (policy,) = {g.mp_policy for _, g in groups}  # one policy for every parameter group
        layers = set(getattr(model, "_no_split_modules", None) or ())
        offload = sorted({type(g.offload_policy).__name__ for _, g in groups})
        offloaded = "cpu" if offload == ["CPUOffloadPolicy"] else "none"  # shards, their gradients, Adam's states
        return {
            "fsdp_mixed_precision": {k: None if v is None else str(v).removeprefix("torch.") for k, v in
                                     (("param_dtype", policy.param_dtype), ("reduce_dtype", policy.reduce_dtype),
                                      ("output_dtype", policy.output_dtype))},
            # a parameter group per decoder layer, one for the tail (embedding, norm), the root's: accelerate keeps
            # the tail's and the root's parameters gathered after the forward, by design.
            "reshard_after_forward": sorted(
                {g._reshard_after_forward for name, g in groups if name.removeprefix("FSDP") in layers}
            ),
            "fsdp_param_dtype": sorted({str(g.mp_policy.param_dtype).removeprefix("torch.") for _, g in groups}),
            "fsdp_offload_policy": offload,
            "offload_param": offloaded,
            "offload_optimizer": offloaded,
        }  # fmt: skip

    def full_state_dict(self, accelerator, model: torch.nn.Module) -> dict:
        return accelerator.get_state_dict(model)  # collective: the shards gathered

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_format(self, strategy: Strategy) -> str:
        return "fsdp"

    async_refusal = staticmethod(sharded_only)  # --save_async: torch.distributed.checkpoint's async_save
    export_parts = staticmethod(fsdp2_parts)  # the export: a parameter at a time
    save_async = staticmethod(fsdp2_async_save)

    def read_neutral(self, path: Path, state: dict) -> dict:
        """torch.distributed.checkpoint's folders (a pipeline's are written alike: each stage's parameters under
        their HF names), each gathered into one state dict by torch's converter."""
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        from training.checkpoints.safety import safe_load
        from training.core.family import from_optimizer_state

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path / "pytorch_model_fsdp_0", Path(tmp) / "model.pt")
            dcp_to_torch_save(path / "optimizer_0", Path(tmp) / "optimizer.pt")
            weights = safe_load(Path(tmp) / "model.pt")["model"]
            optim = safe_load(Path(tmp) / "optimizer.pt")["optimizer"]
        return from_optimizer_state(weights, optim["state"])


FAMILY = FullyShardedDataParallel()


# ---------------------------------------------------------------------------------------------- the strategy


def fsdp_strategy(fsdp_env: Mapping[str, str], world: int, replicas: int = 1, **degrees) -> Strategy:
    """The strategy accelerate's FSDP_* variables (as `accelerate launch` exports them from the YAML's fsdp_config)
    run on `world` ranks: one copy of the model sharded over the data-parallel ranks of each of `replicas` copies
    (more than 1: hybrid), with the model-parallel `degrees` (`Strategy.of`'s pp, cp, tp, and the pipeline's
    fields)."""
    offload = offload_device(fsdp_env)
    reshard = fsdp_env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "shard_grad_op")
    keep_gathered = fsdp_env.get("FSDP_SHARDING_STRATEGY") == "SHARD_GRAD_OP" or not reshard
    return Strategy.of(
        "fsdp", world, offload_param=offload, offload_optimizer=offload, fsdp_version=2,
        fsdp_sharding="SHARD_GRAD_OP" if keep_gathered else "FULL_SHARD", replicas=replicas, fsdp_env=fsdp_env,
        **degrees,
    )  # fmt: skip


def offload_device(fsdp_env: Mapping[str, str]) -> str:
    """Where FSDP's `fsdp_offload_params` keeps the shards, their gradients and Adam's states: "cpu" or "none"."""
    return "cpu" if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true" else "none"


def hybrid_replicas(env: Environment, world: int, cp: int = 1, tp: int = 1, pp: int = 1) -> int:
    """Hybrid sharding: the copies of the model an accelerate parallelism_config keeps, each sharded over its
    dp_shard x cp ranks of tp-way split layers in each of pp pipeline stages (the shards replicated over the rest);
    1 without the block or its dp_shard_size. `accelerate launch` exports every size of the block, 1 where the YAML
    has none."""
    if (env.block or {}).get("dp_replicate_size"):  # named: accelerate's own count of the copies
        return env.block_degree("dp_replicate_size")
    shard = env.block_degree("dp_shard_size", default=world)
    return math.ceil(world / (shard * cp * tp * pp))


# ---------------------------------------------------------------------------------------------- the checks


def check_fsdp_wrap(strategy: Strategy, model: torch.nn.Module) -> None:
    """An FSDP config's wrap policy must be one the model can be wrapped with, checked on the model's module tree
    before any process group: accelerate would otherwise fail deep inside `prepare`."""
    policy = strategy.fsdp_env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    min_num_params = int(strategy.fsdp_env.get("FSDP_MIN_NUM_PARAMS", "0"))
    if policy == "SIZE_BASED_WRAP" and strategy.fsdp_version == 2:
        check_fsdp2_size_wrap(min_num_params, model)  # FSDP1's own: training/core/fsdp1.py
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


# ---------------------------------------------------------------------------------------------- the Accelerator


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


# ---------------------------------------------------------------------------------- built on meta, then sharded


def shard_on_meta(accelerator: Accelerator, net: nn.Module) -> nn.Module:
    """`net`, built on the meta device, sharded as `accelerator.prepare` shards it (accelerate's
    `fsdp2_prepare_model`: `fully_shard` per decoder layer and the root, still on meta), then given storage for this
    rank's shards only (`to_empty`), for the caller to write. `accelerator.prepare` then finds the model sharded and
    binds the optimizer to its shards (its own sharding, on meta, would bind it by storage address, which meta
    tensors lack). Collective: builds the device mesh."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    net = fsdp2_prepare_model(accelerator, net)
    offloaded = isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
    return net.to_empty(device="cpu" if offloaded else accelerator.device)


def own_rows(param: torch.Tensor) -> slice:
    """The rows of the whole tensor that this rank's shard of `param` holds. FSDP2 shards dimension 0 over one
    dimension of its mesh (`Shard(0)`; hybrid sharding replicates over the other), split as `torch.chunk` splits it
    (the documented semantics of `Shard`). A plain tensor: all of it."""
    if not isinstance(param, DTensor):
        return slice(None)
    rows = param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"a shard of dimension {placement.dim}: only FSDP2's Shard(0) is read here")
            per_rank = math.ceil(rows / param.device_mesh.size(mesh_dim))
            start = min(param.device_mesh.get_local_rank(mesh_dim) * per_rank, rows)
            return slice(start, min(start + per_rank, rows))
    return slice(None)


@contextmanager
def sharded_whole(module: nn.Module, names: list[str]):
    """FSDP2: a whole temporary per sharded parameter while the module is initialised; then this rank's rows of it
    are copied into its shard."""
    shards = {name: getattr(module, name) for name in names}
    with temporaries(module, names) as temps:
        yield
    for name, p in shards.items():
        local(p).copy_(temps[name][own_rows(p)])


def checkpoint_covering(model_name_or_path: str, config: ShardGPTConfig) -> list[Path]:
    """The safetensors files of a local checkpoint folder when they hold every parameter of a model of `config`
    under its own name and shape (shardgpt's and Llama's names are the same); otherwise none, and transformers
    loads it."""
    folder = Path(model_name_or_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            shapes |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (not a dict); headers only
    wanted = {name: tuple(p.shape) for name, p in empty_model(config).named_parameters()}
    return files if files and all(shapes.get(name) == shape for name, shape in wanted.items()) else []


@torch.no_grad()
def load_shards(files: list[Path], params: dict[str, torch.Tensor]) -> None:
    """Each parameter's shard read from the checkpoint's safetensors files: only this rank's rows are read (cast
    to the parameter's dtype, as `from_pretrained(dtype=float32)` does); a tied head shares the embedding's."""
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys() & params.keys():
                param = params[key]
                local(param).copy_(f.get_slice(key)[own_rows(param)].to(param.dtype))


def fsdp_param_group(module: torch.nn.Module):
    """FSDP2's parameter group of a module `fully_shard` wrapped (None for any other)."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    return getattr(state, "_fsdp_param_group", None)
