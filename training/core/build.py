"""The model of a run: the preset's config fitted to the tokenizer, or a checkpoint to start from (an exported
shardgpt folder or any Llama-architecture transformers folder). Shared by `recipes/train.py` and
`recipes/trainer.py`, so that both start from the same weights for the same seed.

A fresh model is built without drawing a single random number, where the launch shards it: under ZeRO-3 inside
DeepSpeed's `zero.Init`, under FSDP2 on the meta device and then sharded (`shard_on_meta`), elsewhere whole. Its
weights are then drawn by the model's own `_init_weights`, module by module in the order transformers'
`initialize_weights` uses, each module's parameters whole for the moment of their draw (`initialize`): every path
gives the same weights for the same seed, and no rank holds more than its share plus one module's parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers import initialization as init
from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

from model import ShardGPTConfig, ShardGPTForCausalLM


def build_model(
    config: ShardGPTConfig,
    tokenizer,
    gradient_checkpointing: bool = False,
    model_name_or_path: str | None = None,
    accelerator: Accelerator | None = None,
    torch_compile: bool = False,
) -> ShardGPTForCausalLM:
    """A freshly initialised model (weights drawn from torch's global RNG: seed first), or the weights of
    `model_name_or_path` (whose config `config` is, from `start_config`). `config` is updated in place: eos/bos/pad
    come from the tokenizer, and a fresh model's vocabulary is padded to a multiple of 128 (tensor-core friendly
    shapes; the extra rows are never targets). Given the launch's `accelerator` under FSDP2, a fresh model, or one
    read from a local safetensors checkpoint, comes back already sharded (collective: the device mesh), for the
    optimizer to be made on its shards.

    In torchtitan's order: activation checkpointing, then compilation (`compile_blocks`), then sharding, so that
    what the strategy adds around a module (FSDP2's and ZeRO-3's hooks, DDP's reducer) stays outside the
    compiled code."""
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
    files = checkpoint_covering(model_name_or_path, config) if on_meta and model_name_or_path else []
    if on_meta and (model_name_or_path is None or files):
        net = empty_model(config)  # its weights are written once it is sharded, below
    elif model_name_or_path is None:
        net = fresh_model(config)
    else:
        # Under ZeRO-3 (accelerate's DeepSpeed plugin sets transformers' HfDeepSpeedConfig) transformers builds
        # the model inside deepspeed.zero.Init and loads the checkpoint into each rank's partitions.
        net = ShardGPTForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if torch_compile:
        compile_blocks(net)
    net.config.use_cache = False  # training never reads a KV cache
    if on_meta and (model_name_or_path is None or files):
        net = shard_on_meta(accelerator, net)  # collective: the device mesh
        if files:
            load_shards(files, dict(net.named_parameters()))  # each rank reads its rows of every tensor
        else:
            initialize(net, sharded_whole)
    return net


def fresh_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """A new model with the weights `initialize` draws: under ZeRO-3 built inside `zero.Init`, partitioned module by
    module as it is built, else whole. (FSDP2 builds on the meta device: `build_model`.)"""
    if is_deepspeed_zero3_enabled():  # accelerate's DeepSpeed plugin has set transformers' HfDeepSpeedConfig
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=deepspeed_config()), init.no_init_weights():
            net = ShardGPTForCausalLM(config)
        net.tie_weights()  # no_init_weights also skips the tie that post_init makes
        initialize(net, gathered_whole)  # collective: each module's partitions are gathered in turn
    else:
        with init.no_init_weights():  # the constructors' own draws (nn.Linear's reset_parameters) are skipped
            net = ShardGPTForCausalLM(config)
        net.tie_weights()
        initialize(net, as_is)
    return net


def compile_blocks(net: ShardGPTForCausalLM) -> None:
    """torch.compile each decoder layer's forward (regional compilation, as torchtitan compiles per block): the layers
    are alike, so one graph is compiled and reused by all of them, in seconds rather than the whole model's minutes,
    and Inductor fuses what matters most to speed at small sizes (the norms, rotary embeddings and SwiGLU's
    elementwise work between the matmuls). Only `forward` is compiled: the hooks a strategy registers on the layer
    (FSDP2's gathers, ZeRO-3's fetches) and activation checkpointing's wrapper around it stay eager. ZeRO-3 also
    fetches at each linear inside the layer, where DeepSpeed keeps its hooks out of the graph (graph breaks there).
    The chunked loss is an opaque custom operator either way."""
    for layer in net.model.layers:
        layer.forward = torch.compile(layer.forward)


def empty_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """The model on the meta device: its module tree and shapes, no storage, nothing drawn."""
    with torch.device("meta"), init.no_init_weights():
        net = ShardGPTForCausalLM(config)
    net.tie_weights()
    return net


# ---------------------------------------------------------------------------- initialisation, module by module


@torch.no_grad()
def initialize(net: ShardGPTForCausalLM, whole: Callable[[nn.Module, list[str]], object]) -> None:
    """The model's `_init_weights` on every module that owns parameters, children before parents as transformers'
    `initialize_weights` runs it, drawing from the global RNG. `whole(module, names)` is a context in which those
    parameters of the module are whole tensors: the parameters themselves (`as_is`), each ZeRO-3 partition
    gathered (`gathered_whole`), or a full-size temporary per FSDP2 shard whose rows are then copied into the shard
    (`sharded_whole`). A parameter shared with an earlier module (the tied head) keeps that module's values: the later
    module draws into a throwaway tensor of its shape, so that the RNG moves as in every other build."""
    done: set[int] = set()
    for module in post_order(net):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        own = [name for name, p in params.items() if id(p) not in done]
        shared = [name for name, p in params.items() if id(p) in done]
        with whole(module, own), temporaries(module, shared, torch.float32):
            net._init_weights(module)
        done |= {id(params[name]) for name in own}


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from post_order(child)
    yield module


@contextmanager
def temporaries(module: nn.Module, names: list[str], dtype: torch.dtype | None = None):
    """The parameters `names` of `module` replaced, for the duration, by new whole tensors of their shapes and dtypes
    (or `dtype`), on the CPU; yields those temporaries by name."""
    originals = {name: getattr(module, name) for name in names}
    for name, p in originals.items():
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partition's `shape` is empty; `ds_shape` is the whole's
        temp = torch.empty(shape, dtype=dtype or p.dtype)
        setattr(module, name, nn.Parameter(temp, requires_grad=p.requires_grad))
    temps = {name: getattr(module, name) for name in names}
    try:
        yield temps
    finally:
        for name, p in originals.items():
            setattr(module, name, p)


def as_is(module: nn.Module, names: list[str]):
    """A whole model: its parameters are whole already."""
    return nullcontext()


@contextmanager
def gathered_whole(module: nn.Module, names: list[str]):
    """ZeRO-3: the partitions gathered while the module is initialised; rank 0's values are kept (collective). The
    draws go into whole fp32 temporaries on the CPU, as a whole model's do, and are copied into the gathered
    parameters: under `zero.Init` those live on the GPU in the run's precision, where the CUDA generator and bf16
    would draw other weights than every other strategy."""
    import deepspeed

    params = {name: getattr(module, name) for name in names}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0, enabled=bool(params)):
        with temporaries(module, names, torch.float32) as temps:
            yield
        for name, p in params.items():
            p.data.copy_(temps[name])


@contextmanager
def sharded_whole(module: nn.Module, names: list[str]):
    """FSDP2: a whole temporary per sharded parameter while the module is initialised; then this rank's rows of it
    are copied into its shard."""
    shards = {name: getattr(module, name) for name in names}
    with temporaries(module, names) as temps:
        yield
    for name, p in shards.items():
        local(p).copy_(temps[name][own_rows(p)])


# ---------------------------------------------------------------------------- FSDP2: built on meta, then sharded


def fsdp2_builds_on_meta(accelerator: Accelerator) -> bool:
    """Whether the launch is FSDP2 and `prepare` can take a model already sharded. Not with accelerate's
    `cpu_ram_efficient_loading` (it loads rank 0's whole model into the shards) or `fsdp_activation_checkpointing`
    (`prepare` wraps the decoder layers before sharding them, looking them up by their unsharded class)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = accelerator.state.fsdp_plugin
    return plugin.fsdp_version == 2 and not (plugin.cpu_ram_efficient_loading or plugin.activation_checkpointing)


def shard_on_meta(accelerator: Accelerator, net: nn.Module) -> nn.Module:
    """`net`, built on the meta device, sharded as `accelerator.prepare` shards it (accelerate's
    `fsdp2_prepare_model`: `fully_shard` per decoder layer and the root, still on meta), then given storage for this
    rank's shards only (`to_empty`), for the caller to write. `accelerator.prepare` then finds the model sharded and
    binds the optimizer to its shards (its own sharding, on meta, would bind it by storage address, which meta
    tensors lack). Collective: builds the device mesh."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

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


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


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
