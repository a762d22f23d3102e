"""The model of a run: the preset's config fitted to the tokenizer. Shared by `recipes/train.py` and
`recipes/trainer.py`, so that both start from the same weights for the same seed."""

from __future__ import annotations

import math

from model import ShardGPTConfig, ShardGPTForCausalLM


def build_model(config: ShardGPTConfig, tokenizer, gradient_checkpointing: bool = False) -> ShardGPTForCausalLM:
    """A freshly initialised model (weights drawn from torch's global RNG: seed first). `config` is updated
    in place: the vocabulary is padded to a multiple of 128 (tensor-core friendly shapes; the extra rows are
    never targets) and eos/bos/pad come from the tokenizer."""
    config.vocab_size = 128 * math.ceil(len(tokenizer) / 128)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    net = ShardGPTForCausalLM(config)
    if gradient_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    net.config.use_cache = False  # training never reads a KV cache
    return net
