"""Training throughput and MFU of shardgpt against transformers' `LlamaForCausalLM` of identical shape.

Both models live in one process with the same weights, the same fused AdamW and the same batch, and are
timed in alternation (A, B, A, B, ...) so that drift in the machine's speed hits both alike. A step is
forward, backward and optimizer step; warm-up steps are excluded (under --torch_compile they include the
compilation); on GPUs each step is timed with CUDA events. MFU uses PaLM's FLOPs per token, `6 N + 12 L H Q T`
(training/loop/metrics.py), against the device's peak.

With --separate each model runs in a fresh process of its own (one after the other: no alternation), which
also measures its peak memory: the process's peak RSS on CPU (weights, Adam, activations, the loss; the
model is built and copied once before the steps), `torch.cuda.max_memory_allocated` on a GPU.

    python recipes/measure/benchmark.py                            # CPU: tiny preset, fp32, a quick check
    python recipes/measure/benchmark.py --presets gpt2-124m gpt2-350m --seq_len 1024 --steps 50 \
        --write docs/benchmarks.md
    python recipes/measure/benchmark.py --presets llama-1b --seq_len 2048 --batch_size 4 --steps 50
    python recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 16 --steps 30 --torch_compile
    python recipes/measure/benchmark.py --presets gpt2-124m --seq_len 1024 --batch_size 8 --steps 2 --warmup 1 \
        --separate
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from model import ShardGPTConfig, ShardGPTForCausalLM
from model.export import to_llama
from training.core.build import compile_blocks
from training.flops import flops_per_token, peak_flops


class Timer:
    """Seconds of one step: CUDA events on a GPU (no host sync inside the step), wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.seconds = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.seconds


def train_step(net, optimizer, x) -> None:
    net(x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(preset: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    ours = ShardGPTForCausalLM(ShardGPTConfig.from_preset(preset)).to(device, dtype).train()
    llama = to_llama(ours).to(device, dtype).train()
    llama.config._attn_implementation = "sdpa"
    if args.torch_compile:  # both the same way: each decoder layer, as train.py --torch_compile does
        compile_blocks(ours)
        compile_blocks(llama)
    fused = device.type == "cuda"
    x = torch.randint(0, ours.config.vocab_size, (args.batch_size, args.seq_len), device=device)
    nets = {"shardgpt": ours, "llama": llama}
    if args.only:  # --separate: this process trains one of them
        nets = {args.only: nets[args.only]}
        del ours, llama
    opts = {k: torch.optim.AdamW(n.parameters(), lr=1e-4, fused=fused or None) for k, n in nets.items()}
    times = {k: [] for k in nets}
    for i in range(args.warmup + args.steps):
        for name, net in nets.items():
            with Timer(device) as t:
                train_step(net, opts[name], x)
            if i >= args.warmup:
                times[name].append(t)
    tokens = args.batch_size * args.seq_len
    peak = peak_flops(device, args.peak_flops)
    config = next(iter(nets.values())).config
    flops = flops_per_token(config, args.seq_len)
    row = {"preset": preset, "params": sum(p.numel() for p in next(iter(nets.values())).parameters())}
    for name in nets:
        step = statistics.median(t.elapsed() for t in times[name])
        row[f"{name}_tokens_per_sec"] = tokens / step
        row[f"{name}_mfu"] = flops * tokens / step / peak if peak else None
        if args.only:
            row[f"{name}_peak_gb"] = peak_memory_gb(device)
    if not args.only:
        row["ratio"] = row["shardgpt_tokens_per_sec"] / row["llama_tokens_per_sec"]
    del nets, opts
    return row


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: allocated GPU memory, or on CPU the peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def measure_separately(preset: str, args) -> dict:
    """One fresh process per model, each printing its row as JSON on its last line; the rows merged."""
    row = {}
    for name in ("shardgpt", "llama"):
        flags = [f"--{k}={v}" for k in ("batch_size", "seq_len", "steps", "warmup", "device", "dtype", "peak_flops")
                 if (v := getattr(args, k)) is not None]  # fmt: skip
        flags += ["--torch_compile"] if args.torch_compile else []
        cmd = [sys.executable, __file__, "--presets", preset, "--only", name, *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row.update(json.loads(done.stdout.splitlines()[-1]))
    row["ratio"] = row["shardgpt_tokens_per_sec"] / row["llama_tokens_per_sec"]
    return row


def table(rows: list[dict], header: str) -> str:
    def pct(v):
        return f"{100 * v:.1f}%" if v is not None else "n/a"

    peaks = "shardgpt_peak_gb" in rows[0]
    lines = [
        header,
        "",
        "| preset | params | shardgpt tokens/s | MFU | Llama tokens/s | MFU | ratio |"
        + (" shardgpt peak GB | Llama peak GB | peak saved |" if peaks else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if peaks else ""),
    ]
    for r in rows:
        line = (
            f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['shardgpt_tokens_per_sec']:,.0f} | "
            f"{pct(r['shardgpt_mfu'])} | {r['llama_tokens_per_sec']:,.0f} | {pct(r['llama_mfu'])} | {r['ratio']:.3f} |"
        )
        if peaks:
            ours, theirs = r["shardgpt_peak_gb"], r["llama_peak_gb"]
            line += f" {ours:.2f} | {theirs:.2f} | {1 - ours / theirs:.1%} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny"])
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (the GPU goal asks for >= 50)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--peak_flops", type=float, default=None, help="peak FLOP/s of the device, for MFU")
    p.add_argument("--write", default=None, help="append the table to this markdown file")
    p.add_argument("--separate", action="store_true", help="each model in a fresh process; measures peak memory")
    p.add_argument(
        "--torch_compile", action="store_true", help="compile each decoder layer of both models (as train.py does)"
    )
    p.add_argument("--only", choices=["shardgpt", "llama"], help=argparse.SUPPRESS)  # set by --separate
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if args.only:  # a process of --separate: its row, for the parent to read
        print(json.dumps(measure(args.presets[0], args, device, dtype)))
        return
    rows = []
    for preset in args.presets:
        rows.append(measure_separately(preset, args) if args.separate else measure(preset, args, device, dtype))
        print(f"{preset}: {rows[-1]}", flush=True)
    command = "python recipes/measure/benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"**{name}**, {str(dtype).replace('torch.', '')}, batch {args.batch_size} x seq {args.seq_len}, "
        f"median of {args.steps} timed steps (forward, backward, AdamW) after {args.warmup} warm-up"
        f"{', each decoder layer compiled (inductor)' if args.torch_compile else ''}"
        f"{', each model in its own process' if args.separate else ''}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}. Command: `{command.strip()}`"
    )
    text = table(rows, header)
    print(text)
    if args.write:
        with Path(args.write).open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
