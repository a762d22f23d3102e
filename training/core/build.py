"""The model of a run: the preset's config fitted to the tokenizer, or a checkpoint to start from (an exported
shardgpt folder or any Llama-architecture transformers folder). Shared by `recipes/train.py` and
`recipes/trainer.py`, so that both start from the same weights for the same seed.

A fresh model is built without drawing a single random number, where the launch shards it, as its family builds it
(training/core/family.py): under ZeRO-3 inside DeepSpeed's `zero.Init`, under FSDP2 on the meta device and then
sharded, elsewhere whole. Its
weights are then drawn by the model's own `_init_weights`, module by module in the order transformers'
`initialize_weights` uses, each module's parameters whole for the moment of their draw (`initialize`): every path
gives the same weights for the same seed, and no rank holds more than its share plus one module's parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import initialization as init

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.core.family import family_for


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
    family = family_for(accelerator)
    files = family.sharded_build(accelerator, config, model_name_or_path)  # FSDP2: built on meta, then sharded
    if files is not None:
        net = empty_model(config)  # its weights are written once it is sharded, below
    elif model_name_or_path is None:
        # ZeRO-3: inside zero.Init, each rank its partitions (collective); the others whole, drawn module by module
        net = family.fresh_model(config) or fresh_model(config)
    else:
        # Under ZeRO-3 (accelerate's DeepSpeed plugin sets transformers' HfDeepSpeedConfig) transformers builds
        # the model inside deepspeed.zero.Init and loads the checkpoint into each rank's partitions.
        net = ShardGPTForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if torch_compile:
        compile_blocks(net)
    net.config.use_cache = False  # training never reads a KV cache
    if files is not None:
        net = family.shard_built(accelerator, net, files)  # collective: the device mesh
    return net


def new_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """The model with its parameters allocated but not drawn: the constructors' own draws (nn.Linear's
    reset_parameters) are skipped, and `initialize` draws them in one order for every family."""
    with init.no_init_weights():
        net = ShardGPTForCausalLM(config)
    net.tie_weights()  # no_init_weights also skips the tie that post_init makes
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


def fresh_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """A whole new model, its weights drawn from the global RNG module by module (`initialize`)."""
    net = new_model(config)
    initialize(net, as_is)
    return net


def empty_model(config: ShardGPTConfig) -> ShardGPTForCausalLM:
    """The model on the meta device: its module tree and shapes, no storage, nothing drawn."""
    with torch.device("meta"):
        return new_model(config)


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


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
