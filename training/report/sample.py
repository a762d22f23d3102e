"""Samples from the exported model at the end of a run, as nanoGPT's sample.py draws them: temperature 0.8 and top-k
200 by default, a fixed seed, each continuing the start of a validation document. The settings are the exported
folder's `generation_config.json` too, so `generate` and `pipeline` draw the same way from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from data import PackedStream
from training.config import RunConfig

PROMPT_TOKENS = 8  # the prompt: a document's first tokens, enough to set a context, few enough to leave the rest


def generation_config(cfg: RunConfig, eos_token_id: int) -> GenerationConfig:
    """transformers' generation settings of --sample_*: sampled with temperature and top-k, or greedy."""
    sampling = {} if cfg.sample_greedy else {"do_sample": True, "temperature": cfg.sample_temperature}
    if not cfg.sample_greedy and cfg.sample_top_k:
        sampling["top_k"] = cfg.sample_top_k
    length = {"max_new_tokens": cfg.sample_max_new_tokens} if cfg.sample_max_new_tokens else {}
    return GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id, **sampling, **length)


def describe(gen: GenerationConfig) -> str:
    if not gen.do_sample:
        return "greedy"
    return f"temperature {gen.temperature:g}" + (f", top-k {gen.top_k}" if gen.top_k else "")


def validation_prompts(blocks: np.ndarray | PackedStream, eos_token_id: int, count: int) -> list[list[int]]:
    """`count` prompts from validation blocks spread over the split: the first `PROMPT_TOKENS` tokens after the
    first document boundary in each block (a block starts mid-document), else the block's own first tokens."""
    if isinstance(blocks, PackedStream):  # a stream's length is unknown: its first blocks
        blocks = next(blocks.iter_chunks(count), np.zeros((0, 0), dtype=np.int64))
    prompts = []
    for i in np.unique(np.linspace(0, len(blocks) - 1, count).round().astype(int)) if len(blocks) else []:
        block = [int(t) for t in blocks[i]]
        starts = [j + 1 for j, t in enumerate(block) if t == eos_token_id and j + 1 + PROMPT_TOKENS <= len(block)]
        start = starts[0] if starts else 0
        prompts.append(block[start : start + PROMPT_TOKENS])
    return prompts


@torch.no_grad()
def draw_samples(model, prompts: list[list[int]], gen: GenerationConfig, seed: int) -> list[list[int]]:
    """Each prompt's new tokens, drawn with `gen` from the global RNG seeded with `seed` (restored afterwards)."""
    samples = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            samples.append(out[0, len(prompt) :].tolist())
    return samples


def print_samples(folder: Path, tokenizer, validation, cfg: RunConfig) -> None:
    """Samples from the exported folder (which proves that it loads), printed. Runs on rank 0 alone, so
    transformers must not build the model under ZeRO-3's collective init."""
    unset_hf_deepspeed_config()
    trained = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    prompts = validation_prompts(validation, tokenizer.eos_token_id, cfg.sample_count)
    gen = trained.generation_config  # generation_config(cfg, ...), saved with the export
    samples = draw_samples(trained, prompts, gen, cfg.seed)
    print(f"--- {len(samples)} samples ({describe(gen)}, seed {cfg.seed}), each from a validation document's start ---")
    for prompt, sample in zip(prompts, samples, strict=True):
        print(f"{tokenizer.decode(prompt + sample)}\n---", flush=True)
