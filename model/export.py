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
