"""The model of a run: the preset's config fitted to the tokenizer, or a checkpoint to start from (an exported
shardgpt folder or any Llama-architecture transformers folder). Shared by `recipes/train.py` and
`recipes/trainer.py`, so that both start from the same weights for the same seed.

A fresh model is built sharded where the launch shards it: under ZeRO-3 inside DeepSpeed's `zero.Init`, under FSDP2
on the meta device, sharded there and given each rank's shards only (`materialize_sharded`). Either way the weights
are those of a plain build with the same seed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import DistributedType
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, LlamaConfig, PreTrainedModel
from transformers import initialization as init
from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

from model import ShardGPTConfig, ShardGPTForCausalLM
from model.export import from_llama_config


def start_config(model_name_or_path: str) -> ShardGPTConfig:
    """The config of the checkpoint at `model_name_or_path` as a `ShardGPTConfig` (a Llama config translated
    field by field); another architecture is a ValueError naming its model_type."""
    source = f"--model_name_or_path {model_name_or_path!r}"
    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
    except (OSError, ValueError) as error:  # no config.json, not on the hub, or an unknown model_type
        raise ValueError(f"{source}: {str(error).splitlines()[0]} (pass a folder with a config.json)") from None
    if isinstance(config, ShardGPTConfig):
        return config
    if isinstance(config, LlamaConfig):
        return from_llama_config(config, source)
    raise ValueError(
        f"{source}: config.json model_type = {config.model_type!r}, but shardgpt starts only from 'llama' or "
        "'shardgpt' checkpoints (the same network, weights key for key)"
    )


def has_tokenizer(model_name_or_path: str) -> bool:
    """Whether the checkpoint brings a tokenizer: a folder holding one, or a hub name (resolved by transformers)."""
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return True
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def build_model(
    config: ShardGPTConfig,
    tokenizer,
    gradient_checkpointing: bool = False,
    model_name_or_path: str | None = None,
    accelerator: Accelerator | None = None,
) -> ShardGPTForCausalLM:
    """A freshly initialised model (weights drawn from torch's global RNG: seed first), or the weights of
    `model_name_or_path` (whose config `config` is, from `start_config`). `config` is updated in place: eos/bos/pad
    come from the tokenizer, and a fresh model's vocabulary is padded to a multiple of 128 (tensor-core friendly
    shapes; the extra rows are never targets). Given the launch's `accelerator` under FSDP2, a fresh model, or one
    read from a local safetensors checkpoint, comes back already sharded (`materialize_sharded`; collective), for
    the optimizer to be made on its shards."""
    if model_name_or_path is None:
        config.vocab_size = 128 * math.ceil(len(tokenizer) / 128)
    elif len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"--model_name_or_path {model_name_or_path!r} has vocab_size {config.vocab_size}, fewer rows than the "
            f"tokenizer's {len(tokenizer)} tokens: pass its own tokenizer (--tokenizer_name {model_name_or_path})"
        )
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    on_meta = accelerator is not None and fsdp2_builds_on_meta(accelerator)
    fill = None  # under FSDP2: what writes each rank's shards once the model is sharded on the meta device
    if model_name_or_path is None and on_meta:
        with InitRecord() as record:  # no weights yet: `record.replay` writes them
            net = empty_model(config)
        record.name_writes(net)
        fill = record.replay
    elif model_name_or_path is None:
        with partitioned_construction():
            net = ShardGPTForCausalLM(config)
    elif on_meta and (files := checkpoint_covering(model_name_or_path, net := empty_model(config))):
        fill = partial(load_shards, files)  # each rank reads its rows of every tensor
    else:
        # Under ZeRO-3 (accelerate's DeepSpeed plugin sets transformers' HfDeepSpeedConfig) transformers builds
        # the model inside deepspeed.zero.Init and loads the checkpoint into each rank's partitions.
        net = ShardGPTForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    net.config.use_cache = False  # training never reads a KV cache
    if fill is not None:
        net = materialize_sharded(accelerator, net, fill)  # collective: the device mesh
    return net


@contextmanager
def partitioned_construction():
    """Under ZeRO-3 (accelerate's DeepSpeed plugin sets transformers' HfDeepSpeedConfig), build inside DeepSpeed's
    `zero.Init`: each module's parameters are partitioned over the ranks as soon as the module is built, so a rank
    holds its share plus the module being built. transformers' own weight init runs where a plain build runs it
    (in each `post_init`), on the module's gathered parameters, in the same order: the RNG draws, hence the weights,
    are those of a plain build with the same seed, on every rank (rank 0's values are kept). Elsewhere: a plain
    build."""
    if not is_deepspeed_zero3_enabled():
        yield
        return
    import deepspeed

    plain = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = initialize_gathered
    try:
        with deepspeed.zero.Init(config_dict_or_path=deepspeed_config()):
            yield
    finally:
        PreTrainedModel.initialize_weights = plain


@torch.no_grad()
@init.guard_torch_init_functions()
def initialize_gathered(self: PreTrainedModel) -> None:
    """`PreTrainedModel.initialize_weights` (children before parents, as its `smart_apply`) on ZeRO-3 partitions:
    collective: every rank gathers each module's parameters in turn and initialises them; rank 0's are kept."""
    import deepspeed

    for module in post_order(self):
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
            self._initialize_weights(module)


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from post_order(child)
    yield module


# ---------------------------------------------------------------------------- FSDP2: built on meta, sharded, replayed


def fsdp2_builds_on_meta(accelerator: Accelerator) -> bool:
    """Whether the launch is FSDP2 and `prepare` can take a model already sharded. Not with accelerate's
    `cpu_ram_efficient_loading` (it loads rank 0's whole model into the shards) or `fsdp_activation_checkpointing`
    (`prepare` wraps the decoder layers before sharding them, looking them up by their unsharded class)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = accelerator.state.fsdp_plugin
    return plugin.fsdp_version == 2 and not (plugin.cpu_ram_efficient_loading or plugin.activation_checkpointing)


def empty_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """The model without storage (accelerate's `init_empty_weights`: parameters go to meta as they are
    registered, while transformers' `post_init` still runs its weight init on them)."""
    with init_empty_weights():
        net = ShardGPTForCausalLM(config)
    net.tie_weights()  # init_empty_weights re-registers the tied head as a parameter of its own: tie it again
    return net


@dataclass
class RecordedWrite:
    """One in-place op of a plain build on one parameter: `name` (None: a tensor the build later drops, as
    `lm_head.weight` before it is tied to the embedding, whose draws still move the RNG), its full shape and dtype."""

    name: str | None
    shape: torch.Size
    dtype: torch.dtype
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict


class InitRecord(TorchDispatchMode):
    """While a model is built on the meta device (accelerate's `init_empty_weights`: parameters go to meta as they
    are registered, and transformers' `post_init` still runs its weight init on them), the in-place ops that write
    a parameter, in the order a plain build runs them: the constructors' `reset_parameters` and `_init_weights`.
    The global RNG state at the start is kept: a plain build draws from it."""

    def __init__(self):
        super().__init__()
        self.writes: list[RecordedWrite] = []
        self.targets: list[torch.Tensor] = []  # the meta tensor of each write, until `name_writes`
        self.rng_state = torch.get_rng_state()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, nn.Parameter) and target.is_meta and torch.Tag.inplace in func.tags:
            if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
                raise ValueError(f"building on the meta device: {func} writes a parameter from another tensor, "
                                 "which cannot be replayed shard by shard")  # fmt: skip
            self.writes.append(RecordedWrite(None, target.shape, target.dtype, func, args[1:], kwargs))
            self.targets.append(target)
        return func(*args, **kwargs)

    def name_writes(self, net: nn.Module) -> None:
        """Name each write's parameter as `net` holds it (tied parameters: the first name) and drop the tensors."""
        names = {id(p): n for n, p in net.named_parameters()}
        for write, target in zip(self.writes, self.targets, strict=True):
            write.name = names.get(id(target))
        self.targets = []
        if unwritten := sorted(set(names.values()) - {w.name for w in self.writes}):
            raise ValueError(f"building on the meta device: {unwritten} are never written in place by the "
                             "constructors or `_init_weights`, so their values cannot be replayed")  # fmt: skip
        if buffers := [n for n, _ in net.named_buffers()]:
            raise ValueError(f"building on the meta device: buffers {buffers} would be left empty")

    def replay(self, params: dict[str, torch.Tensor]) -> None:
        """The plain build's writes into `params` (sharded), in its order, one tensor at a time: a random draw on
        a full-size CPU temporary (the same RNG stream as a plain build, hence the same values on every rank) of
        which each rank copies its own rows into its shard (`own_part`), an elementwise write on the shard
        itself. A rank holds its shards plus one full tensor; the RNG ends where
        a plain build leaves it."""
        torch.set_rng_state(self.rng_state)
        for write in self.writes:
            replay_write(write, params.get(write.name))


def materialize_sharded(accelerator: Accelerator, net: nn.Module, fill) -> nn.Module:
    """`net`, built on the meta device, sharded as `accelerator.prepare` shards it (accelerate's
    `fsdp2_prepare_model`: `fully_shard` per decoder layer and the root, still on meta), given storage for this
    rank's shards only (`to_empty`), then written by `fill(parameters by name)`: `InitRecord.replay` (a fresh
    model, the same weights as a plain build) or `load_shards` (a checkpoint). `accelerator.prepare` then finds the
    model sharded and binds the optimizer to its shards (its own sharding, on meta, would bind it by storage
    address, which meta tensors lack)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

    net = fsdp2_prepare_model(accelerator, net)  # collective: builds the device mesh
    offloaded = isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
    net.to_empty(device="cpu" if offloaded else accelerator.device)
    fill(dict(net.named_parameters()))
    return net


@torch.no_grad()
def replay_write(write: RecordedWrite, param: torch.Tensor | None) -> None:
    """One recorded write into `param`'s shard (None: a dropped tensor, whose draws are made all the same)."""
    if torch.Tag.nondeterministic_seeded in write.op.tags:  # a draw: the whole tensor, as a plain build
        full = write.op(torch.empty(write.shape, dtype=write.dtype), *write.args, **write.kwargs)
        if param is not None:
            local(param).copy_(full[own_part(param)])
    elif param is not None and elementwise(write.op):
        write.op(local(param), *write.args, **write.kwargs)
    elif param is not None:
        raise ValueError(f"building on the meta device: {write.op} on {write.name} is neither a random draw nor "
                         "elementwise, so it cannot be replayed shard by shard")  # fmt: skip


def elementwise(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.pointwise in op.tags or op.overloadpacket in (torch.ops.aten.fill_, torch.ops.aten.zero_)


def own_part(param: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of `param` lies in the whole tensor (a DTensor: from its mesh and placements, as
    FSDP2 chunks dim 0; otherwise all of it)."""
    if not isinstance(param, DTensor):
        return (slice(None),)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def checkpoint_covering(model_name_or_path: str, net: nn.Module) -> list[Path]:
    """The safetensors files of a local checkpoint folder when they hold every parameter of `net` under its own
    name and shape (shardgpt's and Llama's names are the same); otherwise none, and transformers loads it."""
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
    wanted = {name: tuple(p.shape) for name, p in net.named_parameters()}
    return files if files and all(shapes.get(name) == shape for name, shape in wanted.items()) else []


@torch.no_grad()
def load_shards(files: list[Path], params: dict[str, torch.Tensor]) -> None:
    """Each parameter's shard read from the checkpoint's safetensors files: only this rank's rows are read (cast
    to the parameter's dtype, as `from_pretrained(dtype=float32)` does); a tied head shares the embedding's."""
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys() & params.keys():
                param = params[key]
                local(param).copy_(f.get_slice(key)[own_part(param)].to(param.dtype))
