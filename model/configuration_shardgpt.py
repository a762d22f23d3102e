"""Configuration of the shardgpt decoder: Llama's field names, named presets, validation in `__post_init__`.

This file and `modeling_shardgpt.py` are copied next to every saved checkpoint (`auto_map`), so they import
nothing but torch and transformers.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# Sizes by name. `debug` serves the tests, `tiny` is the CPU default, the rest are GPU sizes. Vocabulary sizes
# are those of the GPT-2 tokenizer padded to a multiple of 128 (50304) or of Llama 2 (32000); the training
# script replaces `vocab_size` with its tokenizer's (padded) size. Counts: `python -m model`.
PRESETS: dict[str, dict] = {
    "debug": dict(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ),
    "tiny": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    ),
    "gpt2-124m": dict(
        vocab_size=50304, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
    ),
    "gpt2-350m": dict(
        vocab_size=50304, hidden_size=1024, intermediate_size=2752, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024,
    ),
    "llama-1b": dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0,
    ),
    "llama-3b": dict(
        vocab_size=50304, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0,
    ),
    "llama-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


class ShardGPTConfig(PretrainedConfig):
    """A Llama-shaped decoder. Field names and meanings are those of `transformers.LlamaConfig`.

    Attention heads share `hidden_size // num_attention_heads` dimensions; `num_key_value_heads` below
    `num_attention_heads` gives grouped-query attention. Residual projections (`o_proj`, `down_proj`) are
    initialised with `initializer_range / sqrt(2 * num_hidden_layers)` as in GPT-2.
    """

    model_type = "shardgpt"
    # Llama's tensor- and pipeline-parallel plans (`from_pretrained(tp_plan="auto")`, vLLM's transformers backend):
    # the modules have Llama's names and shapes, so they shard the same way.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        self._validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def _validate(self) -> None:
        for field in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ShardGPTConfig.{field}={value!r}: must be a positive integer.")
        for field in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"ShardGPTConfig.{field}={value!r}: must be a positive number.")
        if self.hidden_size % self.num_attention_heads:
            valid = [h for h in range(1, self.hidden_size + 1) if self.hidden_size % h == 0 and h <= 128]
            raise ValueError(
                f"ShardGPTConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; choose num_attention_heads from {valid}."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ShardGPTConfig.hidden_size={self.hidden_size} / num_attention_heads="
                f"{self.num_attention_heads} gives head_dim={self.head_dim}; rotary embeddings need an even "
                "head_dim: change hidden_size or num_attention_heads."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            valid = [k for k in range(1, self.num_attention_heads + 1) if self.num_attention_heads % k == 0]
            raise ValueError(
                f"ShardGPTConfig.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}; valid values: {valid}."
            )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ShardGPTConfig:
        """The config of preset `name` (see `PRESETS`), with any field replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is unknown; valid presets: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})


__all__ = ["PRESETS", "ShardGPTConfig"]
