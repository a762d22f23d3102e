"""Convert a checkpoint of recipes/train.py, written under any strategy, offline: one process, no GPU.

    python recipes/convert_checkpoint.py runs/tiny/checkpoint-100 runs/tiny-step100
    python recipes/convert_checkpoint.py runs/tiny/checkpoint-100 runs/tiny-step100 --llama

OUT receives a Hugging Face model folder (config.json, model.safetensors, loadable with
`AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`, or as a plain `LlamaForCausalLM` with
--llama), and `neutral.pt`: the strategy-neutral form (full fp32 weights, AdamW's exp_avg and exp_avg_sq, the step),
keyed by the HF parameter names (training/checkpoints/portable.py). The tokenizer is not part of a checkpoint: the
training run's output directory holds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import model as shardgpt
from model.export import save_llama
from training.checkpoints.checkpoint import is_complete
from training.checkpoints.portable import NEUTRAL, STATE, read_checkpoint
from training.checkpoints.safety import UnsafeCheckpointError, check_checkpoint


def convert(checkpoint: Path, out: Path, llama: bool = False) -> None:
    neutral = read_checkpoint(checkpoint)
    state = json.loads((checkpoint / STATE).read_text())
    net = shardgpt.ShardGPTForCausalLM(shardgpt.ShardGPTConfig.from_dict(state["model_config"]))
    # strict, but for the tied lm_head.weight, which is the embedding itself
    missing, unexpected = net.load_state_dict(neutral["weights"], strict=False)
    if unexpected or set(missing) - set(net._tied_weights_keys):
        raise ValueError(f"{checkpoint}: weights do not fit the model (missing {missing}, unexpected {unexpected})")
    net.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    if llama:
        save_llama(net, out, safe_serialization=True)
    else:
        net.save_pretrained(out, safe_serialization=True)
    torch.save(neutral, out / NEUTRAL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--llama", action="store_true", help="write a plain LlamaForCausalLM folder")
    parser.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="read a checkpoint whose pickles name more than this project's do (docs/checkpoints.md)",
    )
    args = parser.parse_args(argv)
    if not is_complete(args.checkpoint):
        print(f"error: {args.checkpoint} is not a complete checkpoint (no marker or trainer state)", file=sys.stderr)
        return 2
    try:  # before DeepSpeed's or torch's readers unpickle anything
        check_checkpoint(args.checkpoint, args.trust_checkpoint, what="checkpoint")
    except UnsafeCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    convert(args.checkpoint, args.out, args.llama)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
