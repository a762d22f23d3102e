"""AdamW's recipe: which parameters decay (the optimizer's groups, and the planners' count of them), and the peak
learning rate by model size when --learning_rate is not given."""

from __future__ import annotations

import math

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM

# The default peak learning rate by model size: (up to this many parameters, learning rate). GPT-3's table (Brown et
# al. 2020, Table 2.1: 125M 6e-4, 350M 3e-4, 760M 2.5e-4, 1.3B 2e-4, 2.7B 1.6e-4, 6.7B 1.2e-4, 13B 1e-4, 175B
# 6e-5), each row covering the sizes nearest it; below 50M, 1e-3, as nanoGPT trains its small models. Larger models
# need smaller steps: llama-3b diverged at 1e-3 (loss 9.6 -> 15.4 by step 3, gradient norm 765).
LEARNING_RATES = (
    (50e6, 1e-3), (200e6, 6e-4), (550e6, 3e-4), (1.0e9, 2.5e-4), (2.0e9, 2e-4), (4.5e9, 1.6e-4), (9e9, 1.2e-4),
    (20e9, 1e-4), (math.inf, 6e-5),
)  # fmt: skip


def recipe_learning_rate(config: ShardGPTConfig) -> float:
    """The default peak learning rate of a model of `config` (`LEARNING_RATES`), by its parameter count."""
    with torch.device("meta"):  # shapes only
        parameters = ShardGPTForCausalLM(config).num_parameters()
    return next(lr for limit, lr in LEARNING_RATES if parameters <= limit)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict]:
    """Decay 2-D weights (projections, and the embedding if asked); never norms or biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embed_tokens" in name or name.startswith("lm_head")
        # A parameter built inside ZeRO-3's zero.Init is an empty 1-D partition; ds_shape is its real shape.
        if len(getattr(p, "ds_shape", p.shape)) >= 2 and (decay_embeddings or not is_embedding):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
