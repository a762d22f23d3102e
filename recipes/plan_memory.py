"""Predict the memory one GPU needs to train shardgpt under each strategy, before renting the GPUs.

    python recipes/plan_memory.py --preset llama-1b --num_gpus 8 --strategy zero2 --precision bf16
    python recipes/plan_memory.py --preset llama-7b --num_gpus 8 --strategy all --gpu_memory_gb 80
    python recipes/plan_memory.py --preset llama-1b --hidden_size 2560 --num_gpus 16 --strategy all --json
    python recipes/plan_memory.py --largest --num_gpus 2 --strategy all --seq_len 128 --activation_checkpointing \
        --vocab_size 8192 --nvme_path /local_nvme
    python recipes/plan_memory.py --preset llama-1b --num_gpus 8 --strategy fsdp --pipeline_parallel_degree 4 \
        --pipeline_parallel_schedule 1F1B --gradient_accumulation_steps 8

`--largest`: the largest preset (or shallower copy of the next preset, `--config_overrides num_hidden_layers=N`)
that each strategy is predicted to train on this machine: its free GPU memory (or --gpu_memory_gb), available
RAM (or --host_memory_gb) and free disk at --nvme_path (or --disk_gb), the check `recipes/train.py` runs
before it starts. Pass --vocab_size of the tokenizer the run will use (the default corpus's: 8192).

Per GPU: parameters, gradients, optimizer states (fp32 master copies and Adam's moments), activations,
logits and temporary buffers; for offload, host RAM and NVMe per GPU. `predict()` returns the same as a dict.
With --pipeline_parallel_degree P (GPipe or 1F1B; the micro batches are --gradient_accumulation_steps, as in
recipes/train.py) one row per stage: its layers, the embedding on the first, the norm and the (tied) head on the last,
each stage's states whole per rank (ddp, single) or FSDP2-sharded over its world / P ranks (fsdp), and the
activations of the micro batches the schedule keeps in flight there.

Model states (parameters, gradients, optimizer states) are counted exactly as DDP, FSDP2 and DeepSpeed 0.19
allocate them for this model, tensor by tensor: DeepSpeed's flat buffers and their alignment, the ZeRO-1/2
gradient partition that holds every gradient touching a rank's partition whole, ZeRO-3's persistent small
parameters, FSDP2's padded shards, DDP's gradient buckets, Adam's step counters. `recipes/measure/measure_memory.py`
counts the same on 2 CPU ranks, and `tests/recipes/test_memory.py` checks that both agree to the byte.
Activations, logits and temporaries follow the formulas in docs/memory.md (GPU figures still to be measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from model import PRESETS, ShardGPTConfig
from training.arguments import ArgumentParser
from training.deepspeed_config import load_json
from training.memory.fit import Capacity, Launch, capacity, largest_that_fits, needs
from training.memory.planner import BYTES, PIPELINE_SCHEDULES, STRATEGIES, GiB, layout, predict
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- command line


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(rows: list[dict], gpu_memory_gb: float | None) -> str:
    head = ["strategy", "params", "grads", "optim", "activ", "logits", "temp", "total GiB", "host GiB", "nvme GiB"]
    if gpu_memory_gb:
        head.append(f"fits {gpu_memory_gb:g} GiB")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in (stage for row in rows for stage in row.get("stages", [row])):
        stage = r["inputs"].get("stage")
        cells = [r["inputs"]["strategy"] + (f" stage {stage}" if stage is not None else "")] + [_gib(r[k]) for k in
                 ("params", "grads", "optimizer_states", "activations", "logits", "temporary", "total", "host_ram",
                  "nvme")]  # fmt: skip
        if gpu_memory_gb:
            cells.append("yes" if r["total"] <= gpu_memory_gb * GiB else "no")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def largest(args, overrides: dict, strategies: list[Strategy], ds: dict | None) -> str:
    """One line per strategy: the largest size predicted to fit this machine (or the capacities given)."""
    here = capacity(args.nvme_path)
    have = Capacity(
        int(args.gpu_memory_gb * GiB) if args.gpu_memory_gb else here.gpu_free,
        int(args.host_memory_gb * GiB) if args.host_memory_gb else here.host_free,
        int(args.disk_gb * GiB) if args.disk_gb else here.disk_free,
    )  # fmt: skip
    per_host = args.ranks_per_host or args.num_gpus
    free = {"GPU memory": have.gpu_free, "host RAM": have.host_free, "NVMe disk": have.disk_free}
    lines = [f"{args.num_gpus} ranks, {per_host} per host; free: " + ", ".join(
        f"{where} {n / GiB:.1f} GiB" for where, n in free.items() if n is not None)]  # fmt: skip
    for s in strategies:
        launch = Launch(s, per_host, args.precision, args.micro_batch, args.seq_len, args.activation_checkpointing,
                        ds if s.family == "deepspeed" else None, args.bf16_gradient_reduction)  # fmt: skip
        found = largest_that_fits(launch, have, overrides)
        if found is None:
            lines.append(f"{s.name}: nothing fits, not even the smallest preset")
            continue
        name, config = found
        need = ", ".join(f"{where} {n / GiB:.2f} GiB" for where, n in needs(config, launch, have.gpu_free is not None))
        flags = name.replace(" num_hidden_layers=", " --config_overrides num_hidden_layers=")
        lines.append(f"{s.name}: --preset {flags} ({layout(config).psi / 1e9:.3f}B parameters); per host: {need}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default="llama-1b", choices=tuple(PRESETS), help="a model preset (python -m model lists them)"
    )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size"):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--num_gpus", type=int, default=8, help="data-parallel GPUs (world size)")
    p.add_argument("--strategy", default="all", help=f"one or more of {', '.join(STRATEGIES)} (a,b), or all")
    p.add_argument("--precision", default="bf16", choices=sorted(BYTES))
    p.add_argument("--micro_batch", type=int, default=1, help="sequences per GPU per forward")
    p.add_argument("--seq_len", type=int, default=2048, help="tokens per sequence (--block_size)")
    p.add_argument("--activation_checkpointing", action="store_true", help="--gradient_checkpointing")
    p.add_argument(
        "--bf16_gradient_reduction",
        action="store_true",
        help="as recipes/train.py's flag: ZeRO accumulates gradients in bf16 where the JSON says auto",
    )
    p.add_argument("--ds_config", default=None, help="a DeepSpeed JSON instead of ds_configs/ (ZeRO strategies)")
    p.add_argument("--gpu_memory_gb", type=float, default=None, help="GPU memory in GiB: say what fits")
    p.add_argument("--pipeline_parallel_degree", type=int, default=1, help="pipeline stages, one per rank")
    p.add_argument("--pipeline_parallel_schedule", default="1F1B", choices=PIPELINE_SCHEDULES)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro batches per step (a pipeline's)")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--largest", action="store_true", help="name the largest size that fits, per strategy")
    p.add_argument("--host_memory_gb", type=float, default=None, help="--largest: RAM in GiB (default: available)")
    p.add_argument("--nvme_path", default=None, help="--largest: the NVMe offload folder whose free disk counts")
    p.add_argument("--disk_gb", type=float, default=None, help="--largest: free disk in GiB at the NVMe folder")
    p.add_argument("--ranks_per_host", type=int, default=None, help="--largest: ranks per host (default: all)")
    args = p.parse_args(argv)

    overrides = {k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "vocab_size") if getattr(args, k) is not None}  # fmt: skip
    try:
        config = ShardGPTConfig.from_preset(args.preset, **overrides)
        pp = args.pipeline_parallel_degree
        pipelined = ("ddp", "fsdp", "fsdp-shard-grad-op")  # what a pipeline's stages run under (training/pipeline.py)
        names = (pipelined if pp > 1 else STRATEGIES) if args.strategy == "all" else args.strategy.split(",")
        strategies = [Strategy.from_name(name, args.num_gpus) for name in names]
        if pp > 1:
            strategies = [replace(s, pp_size=pp, pp_schedule=args.pipeline_parallel_schedule) for s in strategies]
        ds = load_json(args.ds_config) if args.ds_config else None
        if args.largest:
            print(largest(args, overrides, strategies, ds))
            return
        rows = [
            predict(config, s, args.precision, args.micro_batch, args.seq_len, args.activation_checkpointing,
                    ds if s.family == "deepspeed" else None,
                    bf16_gradient_reduction=args.bf16_gradient_reduction,
                    micro_batches=args.gradient_accumulation_steps)
            for s in strategies
        ]  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
        return
    psi = rows[0]["inputs"]["psi"]
    model = args.preset + "".join(f" {k}={v}" for k, v in overrides.items())
    print(f"{model}: {psi / 1e9:.3f}B parameters, {args.num_gpus} GPUs, {args.precision}, "
          f"micro batch {args.micro_batch} x {args.seq_len} tokens, activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}; GiB per GPU (host and NVMe: per GPU)")  # fmt: skip
    if args.pipeline_parallel_degree > 1:
        print(f"pipeline: {args.pipeline_parallel_degree} stages, {args.pipeline_parallel_schedule}, "
              f"{args.gradient_accumulation_steps} micro batches a step")  # fmt: skip
    print(table(rows, args.gpu_memory_gb))
    if len(rows) == 1:
        print("\n".join(f"  {k}: {_gib(v)} GiB" for k, v in rows[0]["detail"].items()))


if __name__ == "__main__":
    main()
