"""A model's training FLOPs per token and a device's peak FLOP/s: what MFU divides, and what the planners count."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s of one device (no sparsity), from the vendors' data sheets.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "A10": 125e12, "L40S": 362e12,
    "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "T4": 65e12,
}  # fmt: skip


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's convention: 6 N + 12 L H Q T, with N the parameters that take
    part in matrix multiplies (the lm_head, not the embedding lookup) and the second term attention."""
    embed = config.vocab_size * config.hidden_size
    per_layer = (
        config.hidden_size * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
        + 3 * config.hidden_size * config.intermediate_size
    )
    n_matmul = config.num_hidden_layers * per_layer + embed  # + lm_head (shared with the lookup when tied)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6 * n_matmul + attention


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """The device's peak FLOP/s: the override, the table entry matching the GPU's name, or None (CPU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
