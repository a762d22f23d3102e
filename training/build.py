"""The model of a run: the preset's config fitted to the tokenizer, or a checkpoint to start from (an exported
shardgpt folder or any Llama-architecture transformers folder). Shared by `recipes/train.py` and
`recipes/trainer.py`, so that both start from the same weights for the same seed."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
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
    config: ShardGPTConfig, tokenizer, gradient_checkpointing: bool = False, model_name_or_path: str | None = None
) -> ShardGPTForCausalLM:
    """A freshly initialised model (weights drawn from torch's global RNG: seed first), or the weights of
    `model_name_or_path` (whose config `config` is, from `start_config`). `config` is updated in place: eos/bos/pad
    come from the tokenizer, and a fresh model's vocabulary is padded to a multiple of 128 (tensor-core friendly
    shapes; the extra rows are never targets)."""
    if model_name_or_path is None:
        config.vocab_size = 128 * math.ceil(len(tokenizer) / 128)
    elif len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"--model_name_or_path {model_name_or_path!r} has vocab_size {config.vocab_size}, fewer rows than the "
            f"tokenizer's {len(tokenizer)} tokens: pass its own tokenizer (--tokenizer_name {model_name_or_path})"
        )
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    if model_name_or_path is None:
        with partitioned_construction():
            net = ShardGPTForCausalLM(config)
    else:
        # Under ZeRO-3 (accelerate's DeepSpeed plugin sets transformers' HfDeepSpeedConfig) transformers builds
        # the model inside deepspeed.zero.Init and loads the checkpoint into each rank's partitions.
        net = ShardGPTForCausalLM.from_pretrained(model_name_or_path, config=config, dtype=torch.float32)
    if gradient_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    net.config.use_cache = False  # training never reads a KV cache
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
