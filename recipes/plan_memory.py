"""Predict the memory one GPU needs to train shardgpt under each strategy, before renting the GPUs, and with
--step_time which layout of a cluster trains fastest.

    python recipes/plan_memory.py --preset llama-1b --num_gpus 8 --strategy zero2 --precision bf16
    python recipes/plan_memory.py --preset llama-7b --num_gpus 8 --strategy all --gpu_memory_gb 80
    python recipes/plan_memory.py --preset llama-1b --hidden_size 2560 --num_gpus 16 --strategy all --json
    python recipes/plan_memory.py --largest --num_gpus 2 --strategy all --seq_len 128 --activation_checkpointing \
        --vocab_size 8192 --nvme_path /local_nvme
    python recipes/plan_memory.py --preset llama-1b --num_gpus 8 --strategy fsdp --pipeline_parallel_degree 4 \
        --pipeline_parallel_schedule 1F1B --gradient_accumulation_steps 8

    python recipes/plan_memory.py --step_time --config_file model/configs/llama-3-70b.json --num_gpus 1024 \
        --global_batch 1024 --seq_len 4096 --plot step_time.png
    python recipes/plan_memory.py --check_published

`--step_time`: every layout of --num_gpus GPUs of --gpu kind (data-parallel strategy, tensor, pipeline, sequence and
data-parallel degrees, schedule, micro batch, activation checkpointing; pin any with its flag) that recipes/train.py
runs (--any_layout: Megatron-LM's too, marked by whether the script runs them) and that fits in memory,
ranked by predicted tokens/s, each step split into compute, exposed communication, pipeline bubble and offload
(training/plan/step_time.py; the model and its checks against published runs: docs/step_time.md). Predictions,
not measurements. `--check_published`: published runs (Megatron-LM 2021's Tables 1 and 2, BLOOM-176B, llm-foundry's
across nodes; the calibration's single-node runs apart), predicted beside their published throughput.

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
from training.deepspeed_config import autotp_size, load_json
from training.flops import PEAK_FLOPS
from training.plan.hardware import GPU_KINDS, cluster
from training.plan.layouts import llama_config, plan
from training.plan.memory.fit import Capacity, Planned, capacity, largest_that_fits, needs
from training.plan.memory.layout import BYTES, STRATEGIES, GiB, layout
from training.plan.memory.planner import predict
from training.plan.memory.stages import PIPELINE_SCHEDULES
from training.plan.published import (
    BLOOM,
    CALIBRATION,
    LLAMA3_405B,
    LLM_FOUNDRY_A100,
    LLM_FOUNDRY_H100,
    MEGATRON_CORE_H100,
    MEGATRON_TABLE_1,
    MEGATRON_TABLE_2,
    TORCHTITAN_2025,
    TORCHTITAN_H100,
    compare,
    compare_mfu,
    compare_tuned,
)
from training.plan.step_compute import ATTN_IMPLEMENTATIONS
from training.plan.step_layout import DP_STRATEGIES, STACKS
from training.report.console import configure_console
from training.strategy import Strategy

OVERRIDES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size")  # fmt: skip

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
        launch = Planned(s, per_host, args.precision, args.micro_batch, args.seq_len, args.activation_checkpointing,
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


# ---------------------------------------------------------------------------------------------- step time


def step_time_arguments(p: argparse.ArgumentParser) -> None:
    """--step_time: the cluster, the global batch, the degrees a layout may be pinned to, and the outputs."""
    g = p.add_argument_group("step time (--step_time): rank the layouts that fit, by predicted tokens/s")
    g.add_argument("--step_time", action="store_true", help="predict a step's time for every layout that fits")
    g.add_argument("--config_file", default=None, help="a Llama config.json instead of --preset (model/configs/)")
    g.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(GPU_KINDS)}")
    g.add_argument("--gpus_per_node", type=int, default=8)
    g.add_argument("--peak_tflops", type=float, default=None, help="override the kind's dense bf16 peak")
    g.add_argument("--intra_node_gbps", type=float, default=None, help="override NVLink GB/s per GPU, one way")
    g.add_argument("--inter_node_gbps", type=float, default=None, help="override the NIC's GB/s per GPU, one way")
    g.add_argument("--pcie_gbps", type=float, default=None, help="override host-to-GPU GB/s (offload)")
    g.add_argument("--hbm_gbps", type=float, default=None, help="override the GPU memory's GB/s (memory-bound kernels)")
    g.add_argument("--compute_efficiency", type=float, default=None,
                   help="override the kind's matrix-unit share of peak")  # fmt: skip
    g.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS,
                   help="sdpa: FlashAttention's kernels (GPUs); eager: attention scores written out")  # fmt: skip
    g.add_argument("--global_batch", type=int, default=1024, help="sequences per step (of --seq_len tokens)")
    g.add_argument("--tensor_parallel_degree", type=int, default=None, help="pin tp (default: every one)")
    g.add_argument("--sequence_parallel_degree", type=int, default=None, help="pin Ulysses' sp")
    g.add_argument("--data_parallel_degree", type=int, default=None, help="pin dp")
    g.add_argument(
        "--virtual_stages",
        type=int,
        default=None,
        help="pin the stages each pipeline rank holds (above 1: interleaved 1F1B; default: every one)",
    )
    g.add_argument(
        "--selective_checkpointing",
        action="store_true",
        help="pin selective recomputation (torch's selective activation checkpointing)",
    )
    g.add_argument(
        "--runtime",
        default=None,
        choices=STACKS,
        help="pin whose runtime runs the layout (default: each layout's; megatron-core is Megatron-LM's layouts with "
        "--any_layout; megatron-lm-2021 models the 2021 published runs)",
    )
    g.add_argument(
        "--megatron_sequence_parallel",
        action="store_true",
        help="pin Megatron's sequence parallelism under tensor parallelism (--any_layout)",
    )
    g.add_argument(
        "--tp_comm_overlap",
        action="store_true",
        help="tensor-parallel collectives overlapped with their GEMMs (Megatron's --tp-comm-overlap, "
        "torchtitan's async TP; --any_layout)",
    )
    g.add_argument("--fp8", action="store_true", help="the layers' linear layers in fp8 (--any_layout)")
    g.add_argument("--torch_compile", action="store_true", help="memory-bound kernels fused by torch.compile")
    g.add_argument(
        "--any_layout",
        action="store_true",
        help="also layouts recipes/train.py does not run: Megatron-LM's (TP with DDP, ZeRO-1 x PP, under "
        "Megatron-Core's runtime) and torchtitan's (Megatron's sequence parallelism, async TP, fp8)",
    )
    g.add_argument("--top", type=int, default=10, help="layouts printed (--json: all)")
    g.add_argument("--plot", default=None,
                   help="save a plot here (.png): the fastest layouts' steps; with --check_published, predicted "
                        "against published")  # fmt: skip
    g.add_argument("--check_published", action="store_true",
                   help="predict published runs (Megatron-LM, BLOOM, llm-foundry) beside their throughput")  # fmt: skip


def step_time_main(args) -> None:
    """--step_time and --check_published: print (or --json) the ranked layouts, or the published comparison."""
    try:
        if args.check_published:
            rows = {
                "megatron": compare(MEGATRON_TABLE_1 + MEGATRON_TABLE_2 + BLOOM),
                "llm_foundry": compare_mfu(LLM_FOUNDRY_H100 + LLM_FOUNDRY_A100),
                "tuned": compare_tuned(MEGATRON_CORE_H100 + TORCHTITAN_H100 + TORCHTITAN_2025 + LLAMA3_405B),
                "calibration": compare_mfu(CALIBRATION),
            }
            if args.plot:
                plot_published(rows, args.plot)
            print(json.dumps(rows, indent=2) if args.json else published_tables(rows))
            return
        gpus = cluster(args.gpu, args.num_gpus, args.gpus_per_node, peak_tflops=args.peak_tflops,
                       memory_gib=args.gpu_memory_gb, intra_node_gbps=args.intra_node_gbps,
                       inter_node_gbps=args.inter_node_gbps, pcie_gbps=args.pcie_gbps, hbm_gbps=args.hbm_gbps,
                       efficiency=args.compute_efficiency)  # fmt: skip
        if args.strategy != "all" and args.strategy not in DP_STRATEGIES:
            raise ValueError(f"--strategy {args.strategy}: with --step_time choose one of {', '.join(DP_STRATEGIES)}")
        overrides = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
        if args.config_file:
            config = llama_config(args.config_file, **overrides)
        else:
            config = ShardGPTConfig.from_preset(args.preset, **overrides)
        fixed = dict(tp=args.tensor_parallel_degree, pp=args.pipeline_parallel_degree,
                     sp=args.sequence_parallel_degree, dp=args.data_parallel_degree,
                     strategy=None if args.strategy == "all" else args.strategy,
                     schedule=args.pipeline_parallel_schedule, micro_batch=args.micro_batch,
                     checkpointing=True if args.activation_checkpointing else None,
                     virtual_stages=args.virtual_stages, stack=args.runtime,
                     selective=True if args.selective_checkpointing else None,
                     sequence_parallel=True if args.megatron_sequence_parallel else None,
                     tp_overlap=args.tp_comm_overlap, fp8=args.fp8, compiled=args.torch_compile)  # fmt: skip
        result = plan(config, gpus, args.global_batch, args.seq_len, fixed, args.any_layout, args.attn_implementation)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.plot:
        plot_layouts(result["layouts"][: args.top], args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    model = args.config_file or args.preset
    fit, rejected = len(result["layouts"]), result["rejected_for_memory"]
    which = "layouts, recipes/train.py's and Megatron-LM's," if args.any_layout else "layouts recipes/train.py runs"
    print(f"{model}: {result['inputs']['parameters'] / 1e9:.2f}B parameters on {args.num_gpus} {args.gpu} "
          f"({gpus.gpus_per_node} per node), global batch {args.global_batch} x {args.seq_len} tokens; "
          f"predictions, not measurements; {fit} {which} fit, {rejected} do not")  # fmt: skip
    print(layouts_table(result["layouts"][: args.top], args.any_layout))


def layouts_table(rows: list[dict], runs_here: bool = False) -> str:
    """The ranked layouts, one a line; with `runs_here`, a column saying whether recipes/train.py runs each."""
    head = ["#", "layout", "step s", "compute", "bubble", "comm exposed", "offload", "tokens/s", "MFU", "GiB/GPU"]
    head += ["runs here"] if runs_here else []
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for i, r in enumerate(rows, 1):
        cells = [str(i), r["layout"]] + [f"{r[k]:.3g}" for k in ("step_seconds", "compute_seconds", "bubble_seconds",
                 "communication_seconds", "offload_seconds")]  # fmt: skip
        cells += [f"{r['tokens_per_second']:,.0f}", f"{r['mfu']:.1%}", f"{r['memory_gib']:.1f}"]
        cells += [("yes" if r["runs_here"] else "no")] if runs_here else []
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def published_tables(rows: dict[str, list[dict]]) -> str:
    """Megatron-LM 2021's and BLOOM's runs in TFLOP/s per GPU, the rest in MFU (the H100 runs tuned past what they
    state: the fastest layout under it): predicted beside published, with the error; the calibration's runs last,
    apart, and the mean |error| of the rest."""
    head = ["source", "model", "layout", "GPUs", "published", "predicted", "error"]
    lines = ["predicted against published (TFLOP/s per GPU; the rest: MFU)", " | ".join(head),
             " | ".join("---" for _ in head)]  # fmt: skip
    for r in rows["megatron"]:
        cells = [r["source"], r["parameters"], r["layout"], str(r["gpus"]), f"{r['published_tflops']:g}"]
        lines.append(" | ".join(cells + [f"{r['predicted_tflops']:.0f}", f"{r['error']:+.0%}"]))
    for r in rows["llm_foundry"] + rows["tuned"] + rows["calibration"]:
        layout = f"{r['layout']} {r['gpu']}"
        if r.get("memory_as_run"):  # the planner's memory model rejects what the run did: said, not hidden
            layout += f" (planned {r['memory_gib']:.0f} GiB a GPU; it ran)"
        elif r.get("published_memory_gib"):
            layout += f" (planned {r['memory_gib']:.0f} GiB a GPU; published {r['published_memory_gib']:g})"
        cells = [r["source"], r["parameters"], layout, str(r["gpus"]), f"{r['published_mfu']:.1%}"]
        lines.append(" | ".join(cells + [f"{r['predicted_mfu']:.1%}", f"{r['error']:+.0%}"]))
    checked = sorted(abs(r["error"]) for r in rows["megatron"] + rows["llm_foundry"] + rows["tuned"])
    median = (checked[(len(checked) - 1) // 2] + checked[len(checked) // 2]) / 2
    lines.append(f"outside the calibration, {len(checked)} runs: |error| mean {sum(checked) / len(checked):.1%}, "
                 f"median {median:.1%}")  # fmt: skip
    return "\n".join(lines)


def plot_published(rows: dict[str, list[dict]], path: str) -> None:
    """Predicted against published, each run's share of its GPUs' peak (Megatron-LM 2021's and BLOOM's TFLOP/s over
    the A100's 312, the rest's MFU), one marker per source, on the diagonal where they agree, with +-10% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = PEAK_FLOPS["A100"] / 1e12
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows["megatron"]:
        label = "Megatron-LM 2021, ZeRO-3" if r["sharding"] == "zero3" else r["source"].split(" (")[0]
        groups.setdefault(label, []).append((r["published_tflops"] / peak, r["predicted_tflops"] / peak))
    for r in rows["llm_foundry"] + rows["tuned"] + rows["calibration"]:
        label = f"llm-foundry {r['gpu']}" if r["source"].startswith("llm-foundry ") else r["source"]
        groups.setdefault(label, []).append((r["published_mfu"], r["predicted_mfu"]))
    fig, ax = plt.subplots(figsize=(7, 6))
    top = 0.05 + max(max(p) for points in groups.values() for p in points)
    line = [0, top]
    ax.plot(line, line, color="black", linewidth=0.8, label="predicted = published")
    ax.fill_between(line, [0.9 * x for x in line], [1.1 * x for x in line], color="grey", alpha=0.2, label="+-10%")
    for (label, points), marker in zip(groups.items(), "os^vDPX*<>phHd", strict=False):
        ax.scatter(*zip(*points, strict=True), label=label, marker=marker, s=28)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("published: share of peak (TFLOP/s / peak, or MFU)")
    ax.set_ylabel("predicted: share of peak (training/plan/step_time.py)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layouts(rows: list[dict], path: str) -> None:
    """Horizontal bars, fastest on top: each layout's step split into compute, bubble, exposed communication and
    offload, labelled with its tokens/s and MFU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("compute_seconds", "compute"), ("bubble_seconds", "pipeline bubble"),
             ("communication_seconds", "exposed communication"), ("offload_seconds", "offload (PCIe)")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    names = [r["layout"] for r in rows][::-1]
    left = [0.0] * len(rows)
    for key, label in parts:
        widths = [r[key] for r in rows][::-1]
        ax.barh(names, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, r in enumerate(rows[::-1]):
        ax.text(left[y], y, f" {r['tokens_per_second']:,.0f} tok/s, MFU {r['mfu']:.0%}", va="center", fontsize=8)
    ax.set_xlim(0, 1.4 * max(left, default=1))  # room for the labels
    ax.set_xlabel("predicted seconds per step (a prediction, not a measurement)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    configure_console()  # DeepSpeed's accelerator guess would otherwise land in --json's stdout
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default="llama-1b", choices=tuple(PRESETS), help="a model preset (python -m model lists them)"
    )
    for name in OVERRIDES:
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--num_gpus", type=int, default=8, help="data-parallel GPUs (world size)")
    p.add_argument("--strategy", default="all", help=f"one or more of {', '.join(STRATEGIES)} (a,b), or all")
    p.add_argument("--precision", default="bf16", choices=sorted(BYTES))
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per GPU per forward (default 1)")
    p.add_argument("--seq_len", type=int, default=2048, help="tokens per sequence (--block_size)")
    p.add_argument("--activation_checkpointing", action="store_true", help="--gradient_checkpointing")
    p.add_argument(
        "--bf16_gradient_reduction",
        action="store_true",
        help="as recipes/train.py's flag: ZeRO accumulates gradients in bf16 where the JSON says auto",
    )
    p.add_argument("--ds_config", default=None, help="a DeepSpeed JSON instead of ds_configs/ (ZeRO strategies)")
    p.add_argument("--gpu_memory_gb", type=float, default=None, help="GPU memory in GiB: say what fits")
    p.add_argument("--pipeline_parallel_degree", type=int, default=None, help="pipeline stages, one per rank")
    p.add_argument("--pipeline_parallel_schedule", default=None, choices=PIPELINE_SCHEDULES, help="default 1F1B")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro batches per step (a pipeline's)")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--largest", action="store_true", help="name the largest size that fits, per strategy")
    p.add_argument("--host_memory_gb", type=float, default=None, help="--largest: RAM in GiB (default: available)")
    p.add_argument("--nvme_path", default=None, help="--largest: the NVMe offload folder whose free disk counts")
    p.add_argument("--disk_gb", type=float, default=None, help="--largest: free disk in GiB at the NVMe folder")
    p.add_argument("--ranks_per_host", type=int, default=None, help="--largest: ranks per host (default: all)")
    step_time_arguments(p)
    args = p.parse_args(argv)
    if args.step_time or args.check_published:
        step_time_main(args)
        return
    for name, default in (("micro_batch", 1), ("pipeline_parallel_degree", 1), ("pipeline_parallel_schedule", "1F1B")):
        if getattr(args, name) is None:
            setattr(args, name, default)

    overrides = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    try:
        config = ShardGPTConfig.from_preset(args.preset, **overrides)
        pp = args.pipeline_parallel_degree
        pipelined = (
            "ddp",
            "fsdp",
            "fsdp-shard-grad-op",
        )  # what a pipeline's stages run under (training/axes/pipeline/runtime.py)
        names = (pipelined if pp > 1 else STRATEGIES) if args.strategy == "all" else args.strategy.split(",")
        strategies = [Strategy.from_name(name, args.num_gpus) for name in names]
        if pp > 1:
            strategies = [
                replace(s.with_degrees(pp=pp), pp_schedule=args.pipeline_parallel_schedule) for s in strategies
            ]
        ds = load_json(args.ds_config) if args.ds_config else None
        if ds is not None:  # AutoTP's degree is the JSON's
            strategies = [s.with_degrees(tp=autotp_size(ds)) if s.family == "deepspeed" and s.tp_size > 1 else s
                          for s in strategies]  # fmt: skip
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
