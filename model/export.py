"""Export to a plain `LlamaForCausalLM` folder, loadable without remote code (vLLM, llama.cpp converters...).

The architectures are the same function with the same parameter names, so the export is a config
translation and a state-dict copy; the parity tests prove the two compute the same logits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from itertools import chain

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .configuration_shardgpt import ShardGPTConfig
from .modeling_shardgpt import ShardGPTForCausalLM


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


# The source files `save_pretrained` copies beside the weights, and the classes config.json's `auto_map` names in them.
MODEL_FILES = ("configuration_shardgpt.py", "modeling_shardgpt.py")
AUTO_MAP = {
    "AutoConfig": "configuration_shardgpt.ShardGPTConfig",
    "AutoModelForCausalLM": "modeling_shardgpt.ShardGPTForCausalLM",
}


def save_model_folder(save_directory: str | os.PathLike, config: ShardGPTConfig, state_dict: dict,
                      **save_kwargs) -> None:  # fmt: skip
    """Write `state_dict` (the whole model's weights) as a Hugging Face folder of `ShardGPTForCausalLM`: config.json
    with `auto_map`, the weights, and this package's two source files.

    Saved from a model of this class built on the meta device (no memory), whatever model held the weights: a
    wrapper that swaps the model's class (FSDP2's `fully_shard` makes it `FSDPShardGPTForCausalLM`, defined in
    torch's FSDP package) would have `save_pretrained` copy that class's source files instead of these and name
    them in `auto_map`, and the folder would not load. `save_kwargs`: `save_pretrained`'s (`safe_serialization`,
    ...); a `generation_config` is set on the model first."""
    generation = save_kwargs.pop("generation_config", None)
    with torch.device("meta"):
        model = ShardGPTForCausalLM(config)
    floating = (t.dtype for t in state_dict.values() if t.is_floating_point())
    dtype = save_kwargs.pop("dtype", None) or next(floating, None)
    if dtype is not None:
        model.to(dtype)  # config.json's dtype is the weights' (bf16 under DeepSpeed's bf16)
    if generation is not None:
        model.generation_config = generation
    model.save_pretrained(save_directory, state_dict=state_dict, **save_kwargs)


SHARD_BYTES = 2 * 1024**3  # the most of the weights a streamed save holds before it writes them


def save_model_folder_streamed(save_directory: str | os.PathLike, config: ShardGPTConfig, parts: Iterator[dict],
                               shard_bytes: int = SHARD_BYTES, **save_kwargs) -> int:  # fmt: skip
    """`save_model_folder` of weights that arrive in parts (`parts`: dicts of name -> tensor, a layer's say, as a
    sharded model is gathered), written as they come: at most `shard_bytes` of them are held at once. The files are
    save_pretrained's: `model.safetensors`, or `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`
    where the weights exceed `shard_bytes`. Tied weights (`_tied_weights_keys`) are stored once, under the
    embedding's name, as save_pretrained stores them. Returns the number of parameters written."""
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(save_directory)
    first = next(parts, {})
    dtype = next((t.dtype for t in first.values() if t.is_floating_point()), None)
    save_model_folder(folder, config, {}, dtype=dtype, **save_kwargs)  # config.json, the code, generation_config
    skip = set(ShardGPTForCausalLM._tied_weights_keys) if config.tie_word_embeddings else set()
    shards: list[tuple[Path, list[str]]] = []  # (the file written, its tensors' names)
    held: dict[str, torch.Tensor] = {}
    counts = {"held": 0, "total": 0, "parameters": 0}

    def flush():
        shards.append((folder / f"model-{len(shards) + 1:05d}.safetensors.tmp", list(held)))
        save_file({k: v.contiguous() for k, v in held.items()}, shards[-1][0], metadata={"format": "pt"})
        held.clear()
        counts["held"] = 0

    for part in chain([first], parts):
        for name, tensor in part.items():
            if name in skip:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if held and counts["held"] + nbytes > shard_bytes:
                flush()  # the shard is full: written, then let go
            held[name] = tensor
            counts["held"] += nbytes
            counts["total"] += nbytes
            counts["parameters"] += tensor.numel()
    if held or not shards:
        flush()
    if len(shards) == 1:
        os.replace(shards[0][0], folder / "model.safetensors")
        return counts["parameters"]
    weight_map = {}
    for i, (tmp, names) in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp, folder / name)
        weight_map |= dict.fromkeys(names, name)
    index = {"metadata": {"total_size": counts["total"]}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return counts["parameters"]


def write_model_code(folder: str | os.PathLike) -> list[str]:
    """Make a saved folder load as the Hub loads it (`from_pretrained(folder, trust_remote_code=True)` where this
    project is not installed): config.json's `auto_map` names this package's classes and the folder holds its two
    source files as they are now, in place of the code an earlier `auto_map` named. `save_pretrained` of an
    FSDP2-wrapped model named `_fsdp_init.FSDPShardGPTForCausalLM` and copied torch's FSDP2 sources (`_fsdp_*.py`),
    which fail to load ("Tried to register an operator (fsdp::copy_ ...) ... multiple times"): those files, found
    as `save_pretrained` found them (the module `auto_map` named and its relative imports), are removed. The weights
    are not touched. Returns the names of the files removed."""
    import json
    import shutil
    from pathlib import Path

    from transformers.dynamic_module_utils import get_relative_import_files

    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("model_type") != ShardGPTConfig.model_type:
        raise ValueError(
            f"{config_file}: model_type is {config.get('model_type')!r}, not {ShardGPTConfig.model_type!r}: "
            "this folder does not hold a shardgpt model"
        )
    stale = set()
    for reference in (config.get("auto_map") or {}).values():  # "module.Class", or a pair of them (tokenizers)
        for ref in reference if isinstance(reference, (list, tuple)) else [reference]:
            source = folder / f"{str(ref).rsplit('.', 1)[0]}.py" if ref and "--" not in str(ref) else None
            if source is not None and source.is_file() and source.name not in MODEL_FILES:
                stale |= {source.name, *(Path(f).name for f in get_relative_import_files(str(source)))}
    for name in stale:
        (folder / name).unlink(missing_ok=True)
    here = Path(__file__).parent
    for name in MODEL_FILES:
        shutil.copyfile(here / name, folder / name)
    config["auto_map"] = dict(AUTO_MAP)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(stale)
