"""`python -m model`: every preset's shape and parameter count (counted on the meta device: no memory)."""

import torch

from . import PRESETS, ShardGPTConfig, ShardGPTForCausalLM


def count_parameters(config: ShardGPTConfig) -> int:
    """Parameters of the model built from `config`, tied embeddings counted once."""
    with torch.device("meta"):
        return sum(p.numel() for p in ShardGPTForCausalLM(config).parameters())


def main() -> None:
    header = f"{'preset':<10} {'params':>9} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} "
    print(header + f"{'vocab':>6} {'ctx':>5} tied")
    for name in PRESETS:
        c = ShardGPTConfig.from_preset(name)
        n = count_parameters(c)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(
            f"{name:<10} {size:>9} {c.num_hidden_layers:>6} {c.hidden_size:>6} {c.intermediate_size:>6} "
            f"{c.num_attention_heads:>5} {c.num_key_value_heads:>3} {c.vocab_size:>6} "
            f"{c.max_position_embeddings:>5} {'yes' if c.tie_word_embeddings else 'no'}"
        )


if __name__ == "__main__":
    main()
