"""The share of peak a decoder layer's matrix multiplies reach on this device, per tensor-parallel degree.

    python recipes/measure/gemm_efficiency.py                                  # llama-3-8b's layer, tp 1 2 4 8
    python recipes/measure/gemm_efficiency.py --config_file model/configs/llama-3-70b.json --tokens 16384 8192
    python recipes/measure/gemm_efficiency.py --json runs/gemm.json            # every shape, for scripts

The step-time planner (training/plan/step_time.py) gives every GEMM one efficiency per GPU kind, calibrated on models
whose matrices are at least 768 wide. Tensor parallelism makes each rank's matrices thinner (a Llama 3 8B layer at tp
8: k and v 4096 x 128, q 4096 x 512), and published runs there come out slower than that one figure predicts. This
measures it: each linear layer's three GEMMs of a training step (the forward's X W, the input gradient's dY W^T and the
weight gradient's X^T dY) at the rank's slice of the layer (column-split q, k, v, gate, up; row-split o, down) for
`--tokens` tokens a micro batch, in bf16 on a GPU (fp32 on CPU), each the median of `--repeats` timed runs after a
warm-up, as FLOP/s and as a share of the device's dense peak (training/flops.py's table; none on CPU). The layer's
share is its GEMMs' FLOPs over their summed time.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from model import ShardGPTConfig
from training.arguments import ArgumentParser
from training.flops import peak_flops
from training.plan.layouts import llama_config


def layer_gemms(config: ShardGPTConfig, tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of each GEMM of one decoder layer's linear layers on one of `tp` ranks, for `tokens` tokens."""
    h, d, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    kv = max(config.num_key_value_heads // tp, 1) * d  # fewer key-value heads than ranks: each rank keeps one whole
    q = config.num_attention_heads * d // tp
    linears = {  # (in, out) on one rank: column-split outputs, row-split inputs
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, ffn // tp),
        "up": (h, ffn // tp),
        "down": (ffn // tp, h),
    }
    out = []
    for name, (k, n) in linears.items():
        out += [
            (f"{name} forward", tokens, k, n),
            (f"{name} input grad", tokens, n, k),
            (f"{name} weight grad", k, tokens, n),
        ]
    return out


def seconds(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The median seconds of one (m x k) @ (k x n) product."""
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: the library picks its kernel
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(config: ShardGPTConfig, tps: list[int], token_counts: list[int], device: torch.device,
            repeats: int) -> list[dict]:  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = peak_flops(device, None)
    rows = []
    for tokens in token_counts:
        for tp in tps:
            gemms = [
                (name, m, k, n, seconds(m, k, n, device, dtype, repeats))
                for name, m, k, n in layer_gemms(config, tp, tokens)
            ]
            for name, m, k, n, s in gemms:
                flops = 2 * m * k * n / s
                rows.append(dict(tokens=tokens, tp=tp, gemm=name, m=m, k=k, n=n, seconds=s, flops_per_s=flops,
                                 share_of_peak=flops / peak if peak else None))  # fmt: skip
            total = sum(2 * m * k * n for _, m, k, n, _ in gemms) / sum(s for *_, s in gemms)
            rows.append(dict(tokens=tokens, tp=tp, gemm="layer", flops_per_s=total,
                             share_of_peak=total / peak if peak else None))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = ArgumentParser(prog="recipes/measure/gemm_efficiency.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", default="model/configs/llama-3-8b.json", help="A model config.json.")
    p.add_argument("--preset", default=None, help="A preset instead of --config_file (train.py --preset).")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="Tensor-parallel degrees.")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="Tokens a micro batch on one rank.")
    p.add_argument("--repeats", type=int, default=10, help="Timed runs of each GEMM (the median is kept).")
    p.add_argument("--json", default=None, help="Write every row here.")
    args = p.parse_args(argv)
    config = ShardGPTConfig.from_preset(args.preset) if args.preset else llama_config(args.config_file)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = measure(config, args.tp, args.tokens, device, args.repeats)
    print(f"{name}, torch {torch.__version__}: hidden {config.hidden_size}, intermediate {config.intermediate_size}")
    print("| tokens | tp | layer TFLOP/s | share of peak | thinnest GEMM (m x k x n) | its TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for layer in (r for r in rows if r["gemm"] == "layer"):
        own = [r for r in rows if r["gemm"] != "layer" and (r["tokens"], r["tp"]) == (layer["tokens"], layer["tp"])]
        thin = min(own, key=lambda r: r["flops_per_s"])
        share = f"{layer['share_of_peak']:.1%}" if layer["share_of_peak"] else "n/a"
        print(f"| {layer['tokens']} | {layer['tp']} | {layer['flops_per_s'] / 1e12:.1f} | {share} | {thin['gemm']} "
              f"{thin['m']} x {thin['k']} x {thin['n']} | {thin['flops_per_s'] / 1e12:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
