"""Forward+backward tokens/s of shardgpt and of transformers' `LlamaForCausalLM` of identical shape.

Both models live in one process with the same weights and are timed in alternation (A, B, A, B, ...), so
drift in the machine's speed hits both alike. The ratio is ours / Llama: above 1.0 means faster.

    python recipes/benchmark_model.py                      # CPU: tiny preset, fp32
    python recipes/benchmark_model.py --preset gpt2-124m   # on a GPU: bf16, SDPA
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from model.export import to_llama


def step_time(net, x, sync) -> float:
    """Seconds for one forward+backward (gradients dropped)."""
    sync()
    t0 = time.perf_counter()
    net(x, labels=x).loss.backward()
    sync()
    dt = time.perf_counter() - t0
    net.zero_grad(set_to_none=True)
    return dt


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=10, help="timed A/B pairs after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    ours = ShardGPTForCausalLM(ShardGPTConfig.from_preset(args.preset)).to(device, dtype).train()
    llama = to_llama(ours).to(device, dtype).train()
    llama.config._attn_implementation = "sdpa"
    x = torch.randint(0, ours.config.vocab_size, (args.batch_size, args.seq_len), device=device)

    times = {"shardgpt": [], "llama": []}
    for i in range(args.warmup + args.rounds):
        for name, net in (("shardgpt", ours), ("llama", llama)):
            dt = step_time(net, x, sync)
            if i >= args.warmup:
                times[name].append(dt)

    tokens = args.batch_size * args.seq_len
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    shape = f"batch {args.batch_size} x seq {args.seq_len}"
    print(f"{args.preset}, {shape}, {dtype}, {name}, torch {torch.__version__}")
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    for k, r in rate.items():
        print(f"  {k:<9} {r:>10,.0f} tokens/s  (median of {args.rounds}, fwd+bwd)")
    print(f"  ratio shardgpt / llama: {rate['shardgpt'] / rate['llama']:.3f}")


if __name__ == "__main__":
    main()
