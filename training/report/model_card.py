"""The exported folder's README.md: a Hugging Face model card (YAML front matter, then what the model is and how it
was trained), so the folder can be pushed to the Hub as it is."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData


def last_value(records: list[dict], key: str) -> float | None:
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def write_model_card(out: Path, cfg, config, tokenizer, seen: dict, parameters: int, steps: int) -> Path:
    """README.md in `out` from the run's flags, the model config, the strategy in force (`seen`, as
    strategy.json holds it) and the last loss and evaluation in metrics.jsonl."""
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    loss, eval_loss = last_value(records, "loss"), last_value(records, "eval_loss")
    data = cfg.dataset_name or cfg.train_file or "the default corpus (data/)"
    tags = ["shardgpt", "llama", "causal-lm", seen.get("strategy", "single")]
    card_data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=tags)
    if cfg.dataset_name:
        card_data.datasets = [cfg.dataset_name]
    precision = cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32"
    zero = f", ZeRO stage {seen['zero_stage']}" if seen.get("zero_stage") else ""
    # Tensor-parallel ranks share a batch: the global batch counts data-parallel ranks only.
    data_parallel = seen.get("tensor_parallel", {}).get("data_parallel_size", seen.get("world_size", 1))
    rows = [
        ("architecture", f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                         f"{config.num_attention_heads} heads ({config.num_key_value_heads} key/value), "
                         f"MLP {config.intermediate_size}, context {config.max_position_embeddings}"),
        ("parameters", f"{parameters:,}"),
        ("vocabulary", f"{config.vocab_size:,} ({type(tokenizer).__name__}, {len(tokenizer):,} tokens)"),
        ("data", f"{data}, blocks of {cfg.block_size} tokens"),
        ("strategy", f"{seen.get('strategy', 'single process')} ({seen.get('engine', 'no wrapper')}{zero}) on "
                     f"{seen.get('world_size', 1)} ranks"),
        ("precision", f"{precision}; parameters {', '.join(seen.get('parameter_dtypes', ['float32']))}"),
        ("batch", f"{cfg.global_batch(data_parallel)} sequences per optimizer step"),
        ("steps", f"{steps}"),
        ("final training loss", f"{loss:.4f}" if loss is not None else "not logged"),
        ("final validation loss", f"{eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f})"
                                  if eval_loss is not None else "no validation data"),
    ]  # fmt: skip
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    command = shlex.join(["python", *sys.argv])
    body = f"""
# {out.name}

A Llama-architecture causal language model trained from scratch with shardgpt. It loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and its weights copy into
`LlamaForCausalLM` key for key.

| | |
|---|---|
{table}

## Use

```python
from transformers import pipeline
print(pipeline("text-generation", "{out}", trust_remote_code=True)("def ")[0]["generated_text"])
```

## Training command

Each rank ran (under the launcher that chose the strategy above):

```
{command}
```

`run_config.json` in this folder holds every flag, `strategy.json` what each rank held, `metrics.jsonl` the
logged steps.
"""
    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}")
    card.save(out / "README.md")
    return out / "README.md"
