"""Export to a plain `LlamaForCausalLM` folder, loadable without remote code (vLLM, llama.cpp converters...).

The architectures are the same function with the same parameter names, so the export is a config
translation and a state-dict copy; the parity tests prove the two compute the same logits.
"""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .configuration_shardgpt import ShardGPTConfig


def to_llama_config(config: ShardGPTConfig) -> LlamaConfig:
    """The `LlamaConfig` describing the same network as `config`."""
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def to_llama(model: torch.nn.Module) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` holding a copy of `model`'s weights (loaded with `strict=True`)."""
    llama = LlamaForCausalLM(to_llama_config(model.config)).to(model.dtype)
    state = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        llama.load_state_dict(state, strict=False)
        missing = {k for k in llama.state_dict() if k not in state} - {"lm_head.weight"}
        if missing:
            raise KeyError(f"weights missing for LlamaForCausalLM: {sorted(missing)}")
    else:
        llama.load_state_dict(state, strict=True)
    return llama


def save_llama(model: torch.nn.Module, save_directory: str | os.PathLike, **save_kwargs) -> None:
    """Write `model` as a plain Llama folder (config.json with `model_type: llama`, safetensors weights)."""
    to_llama(model).save_pretrained(save_directory, **save_kwargs)


# What a `LlamaConfig` may say for the network to be shardgpt's: (field, value shardgpt computes with).
LLAMA_AS_SHARDGPT = (
    ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1),
    ("attention_dropout", 0.0),
)  # fmt: skip


def from_llama_config(llama: LlamaConfig, source: str = "the checkpoint") -> ShardGPTConfig:
    """The `ShardGPTConfig` of the network a `LlamaConfig` describes; a field whose value shardgpt does not
    compute (another activation, biases, a rope scaling, a head_dim other than hidden_size / heads) is a
    ValueError naming it."""
    for name, value in LLAMA_AS_SHARDGPT:
        if getattr(llama, name, value) != value:
            raise ValueError(
                f"{source}: config.json {name} = {getattr(llama, name)!r}, but shardgpt computes with {name} = "
                f"{value!r}: start from a checkpoint of the plain Llama architecture"
            )
    rope = dict(getattr(llama, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{source}: config.json rope_parameters.rope_type = {rope['rope_type']!r}, but shardgpt's rotary "
            "embeddings are unscaled ('default'): start from a checkpoint without rope scaling"
        )
    heads = llama.num_attention_heads
    head_dim = getattr(llama, "head_dim", None) or llama.hidden_size // heads
    if head_dim * heads != llama.hidden_size:
        raise ValueError(
            f"{source}: config.json head_dim = {head_dim}, but shardgpt's heads are hidden_size / "
            f"num_attention_heads = {llama.hidden_size // heads} wide: start from a checkpoint where they are"
        )
    return ShardGPTConfig(
        vocab_size=llama.vocab_size,
        hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=llama.num_key_value_heads or heads,
        max_position_embeddings=llama.max_position_embeddings,
        rms_norm_eps=llama.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(llama, "rope_theta", 10000.0)),
        tie_word_embeddings=llama.tie_word_embeddings,
        initializer_range=llama.initializer_range,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
        pad_token_id=llama.pad_token_id,
    )
