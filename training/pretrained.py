"""A checkpoint to start from (--model_name_or_path): its config as a ShardGPTConfig, and whether it brings a
tokenizer. Read by the configuration before any runtime exists."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, LlamaConfig

from model import ShardGPTConfig
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
