"""Will this launch fit the machine? The memory planner's prediction (`training/plan/memory/planner.predict`) for the
launch, against what this host has free, before any process group, model or data exists.

Three places can run out, each compared for the ranks of one host together:
- GPU memory: one rank's prediction against the free memory of its GPU;
- host RAM: the host's ranks x what each keeps in host memory (the process itself, `PROCESS_BYTES`; offloaded
  states; on CPU ranks, everything; and the fp32 model each rank builds before `prepare`), against the RAM
  available;
- disk: the host's ranks x their NVMe-offloaded bytes, against the free space at `nvme_path`.

`largest_that_fits` names the largest preset, or depth of one, that a launch is predicted to fit
(`recipes/plan_memory.py --largest`).

A launch that does not fit is refused with the numbers and the cheapest change that the planner predicts would
fit (activation checkpointing, a smaller micro batch, a sharding strategy, offload, more hosts), unless
`--skip_memory_check`. `recipes/doctor.py` shows the same comparison.
"""

from __future__ import annotations

import copy
import math
import shutil
from dataclasses import dataclass, replace

import psutil
import torch

from training.axes.table import composes, wrapper
from training.strategy import Strategy

GiB = 2**30
# What a training process holds before any model state: Python, torch, DeepSpeed and accelerate with their ops,
# the tokenizer and the memory-mapped data; each rank's peak resident set of the debug preset (0.6M parameters)
# under ZeRO-3 on 2 CPU ranks, measured: 0.54 and 0.63 GiB (docs/benchmarks.md).
PROCESS_BYTES = int(0.6 * GiB)


class MemoryFitError(ValueError):
    """The planner predicts that the launch runs out of memory or disk (every rank finds the same)."""

    same_on_every_rank = True


@dataclass
class Planned:
    """What the prediction depends on: the strategy as the planner models it (`planner_strategy`), on its world
    size, and the launch's sizes."""

    strategy: Strategy
    ranks_per_host: int
    precision: str  # fp32, bf16 or fp16
    micro_batch: int
    seq_len: int
    checkpointing: bool
    ds_config: dict | None = None
    bf16_gradient_reduction: bool = False  # what "auto" gradient dtypes of ds_config resolve to
    micro_batches: int = 1  # a pipeline's micro batches per step (--gradient_accumulation_steps)

    @property
    def world_size(self) -> int:
        return self.strategy.world_size


@dataclass
class Capacity:
    """What one host has free: bytes of free GPU memory per GPU (None: CPU ranks), available RAM and free disk
    at the NVMe offload path (None: no NVMe offload)."""

    gpu_free: int | None
    host_free: int
    disk_free: int | None = None


def planner_strategy(strategy: Strategy) -> Strategy | None:
    """A launch's strategy as the planner models it: one process as DDP on one rank, FSDP1's flat parameters as
    FSDP2's shards (NO_SHARD as DDP), hybrid FSDP as FSDP over one shard group (the memory of a rank is that);
    a pipeline stage by stage (`stages.models_pipeline`); Ulysses by each rank's share of the sequence; FSDP2 x TP
    as it is; None for what the planner does not model (hybrid FSDP2 x TP among them)."""
    from training.plan.memory.layout import STRATEGIES
    from training.plan.memory.stages import models_pipeline

    if strategy.pp_size > 1:
        return strategy if models_pipeline(strategy) else None
    if strategy.family == "fsdp" and strategy.tp_size > 1:  # FSDP2 x TP, its model states measured to the byte
        return strategy if strategy.replicas == 1 and strategy.cp_size == 1 else None
    if strategy.family == "single" or strategy.fsdp_sharding == "NO_SHARD":
        strategy = Strategy.of("ddp", strategy.world_size)
    elif strategy.family == "fsdp":
        strategy = replace(strategy.with_degrees(strategy.shard_size, replicas=1, cp=1), fsdp_version=2)
    # Ulysses: the planner plans the ZeRO strategy with each rank's seq_len / sp positions.
    return strategy if strategy.with_degrees(sp=1).name in STRATEGIES else None


def capacity(nvme_path: str | None, local_rank: int = 0) -> Capacity:
    """This host's free memory and disk, now."""
    gpu_free = None
    if torch.cuda.is_available():
        gpu_free = torch.cuda.mem_get_info(local_rank % torch.cuda.device_count())[0]
    disk_free = shutil.disk_usage(nvme_path).free if nvme_path else None
    return Capacity(gpu_free, psutil.virtual_memory().available, disk_free)


def needs(config, launch: Planned, on_gpu: bool) -> list[tuple[str, int]]:
    """(place, bytes one host needs there) for `launch`, as the planner predicts it."""
    from training.plan.memory.planner import predict

    pred = predict(config, launch.strategy, launch.precision, launch.micro_batch, launch.seq_len,
                   launch.checkpointing, ds_config=launch.ds_config,
                   bf16_gradient_reduction=launch.bf16_gradient_reduction, cpu_ranks=not on_gpu,
                   micro_batches=launch.micro_batches)  # fmt: skip
    # On CPU ranks the "GPU" figures live in host RAM too. The full fp32 model a rank builds before `prepare`
    # shards it is the peak when it exceeds what the rank keeps afterwards.
    resident = pred["host_ram"] + (0 if on_gpu else pred["total"])
    out = [("host RAM", launch.ranks_per_host * (PROCESS_BYTES + max(resident, pred["host_ram_at_start"])))]
    if on_gpu:
        out.insert(0, ("GPU memory", pred["total"]))
    if pred["nvme"]:
        out.append(("NVMe disk", launch.ranks_per_host * pred["nvme"]))
    return out


def shortfalls(config, launch: Planned, have: Capacity) -> list[tuple[str, int, int]]:
    """(place, bytes needed, bytes free) for every place the launch is predicted not to fit."""
    free = {"GPU memory": have.gpu_free, "host RAM": have.host_free, "NVMe disk": have.disk_free}
    return [(where, need, free[where]) for where, need in needs(config, launch, have.gpu_free is not None)
            if free[where] is not None and need > free[where]]  # fmt: skip


def cheapest_fix(config, launch: Planned, have: Capacity) -> str:
    """The first change, in order of what it costs the run, that the planner predicts would fit."""
    on_gpu = have.gpu_free is not None
    candidates = []
    if not launch.checkpointing:
        candidates.append(("pass --gradient_checkpointing (about 30% slower)", replace(launch, checkpointing=True)))
    micro = launch.micro_batch // 2
    while micro >= 1:
        accumulation = f"x{launch.micro_batch // micro}" if launch.micro_batch % micro == 0 else "more"
        candidates.append((
            f"pass --per_device_train_batch_size {micro} and {accumulation} --gradient_accumulation_steps "
            "(same global batch)", replace(launch, micro_batch=micro,
                                           micro_batches=launch.micro_batches * launch.micro_batch // micro),
        ))  # fmt: skip
        micro //= 2
    world, now = launch.world_size, launch.strategy
    zero3 = Strategy.of("deepspeed", world, zero_stage=3)
    under_pipeline = now.pp_size > 1 and not composes("pp", wrapper("deepspeed", 3))  # ZeRO under no pipeline here
    if world > 1 and now != zero3 and not under_pipeline:
        candidates.append(("launch with accelerate_configs/zero3.yaml (ZeRO-3 shards every state)",
                           replace(launch, strategy=zero3, ds_config=None)))  # fmt: skip
    if on_gpu and not now.offloads and world > 1 and not under_pipeline:
        offloaded = replace(zero3, offload_param="cpu", offload_optimizer="cpu")
        candidates.append(("launch with accelerate_configs/zero3_offload_cpu.yaml (states in host RAM)",
                           replace(launch, strategy=offloaded, ds_config=None)))  # fmt: skip
    hosts = world // launch.ranks_per_host
    for more in (2, 4, 8, 16):
        if now.family in ("deepspeed", "fsdp"):
            candidates.append((f"launch on {more * hosts} hosts of {launch.ranks_per_host} ranks (more shards)",
                               replace(launch, strategy=now.with_degrees(more * world))))  # fmt: skip
    for fix, changed in candidates:
        if not shortfalls(config, changed, have):
            return fix
    return "no single change fits: choose a smaller --preset, or a larger machine"


def check_memory_fit(config, launch: Planned, have: Capacity) -> None:
    """Refuse `launch` in one line when it is predicted not to fit: the numbers and the cheapest fix."""
    short = shortfalls(config, launch, have)
    if not short:
        return
    per_host = f" for {launch.ranks_per_host} ranks on this host" if launch.ranks_per_host > 1 else ""
    numbers = "; ".join(f"{where} needs {need / GiB:.1f} GiB{per_host}, {free / GiB:.1f} GiB free"
                        for where, need, free in short)  # fmt: skip
    raise MemoryFitError(
        f"{launch.strategy.name} on {launch.world_size} rank(s), {launch.precision}, micro batch "
        f"{launch.micro_batch} x {launch.seq_len} tokens is predicted not to fit: {numbers}; cheapest fix: "
        f"{cheapest_fix(config, launch, have)} (or --skip_memory_check to start anyway)"
    )


def check_launch_fits(launch, config) -> None:
    """`check_memory_fit` for the launch the training script was started with (training/launch.py's `Launch`), on
    this host now: its ranks here (LOCAL_WORLD_SIZE, as every launcher exports it) and this rank's GPU."""
    cfg, strategy, env = launch.cfg, launch.strategy, launch.environment
    planned = training_launch(cfg, strategy, env.local_world or strategy.world_size, strategy.deepspeed)
    if cfg.skip_memory_check or planned is None:
        return
    have = capacity(nvme_path(strategy.deepspeed), env.local_rank)
    check_memory_fit(planned_config(cfg, config), planned, have)


def training_launch(cfg, strategy: Strategy, per_host: int, ds: dict | None) -> Planned | None:
    """The planner's view of a `recipes/train.py` launch with flags `cfg` and `strategy`, `per_host` of its ranks on
    each host, and the resolved DeepSpeed JSON `ds`; None for a strategy the planner does not model."""
    planned = planner_strategy(strategy)
    if planned is None:
        return None
    return Planned(
        planned, min(per_host, planned.world_size), cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32",
        cfg.per_device_train_batch_size, cfg.block_size, cfg.gradient_checkpointing, ds,
        micro_batches=cfg.gradient_accumulation_steps,
    )  # fmt: skip


def nvme_path(ds: dict | None) -> str | None:
    """The folder a DeepSpeed JSON offloads to NVMe (parameters or optimizer states), if any."""
    zero = (ds or {}).get("zero_optimization") or {}
    return next((zero[k].get("nvme_path") for k in ("offload_param", "offload_optimizer")
                 if (zero.get(k) or {}).get("device") == "nvme"), None)  # fmt: skip


def planned_config(cfg, config):
    """`config` with the vocabulary the run will have, where the flags already tell it: a fresh model with the
    default BPE gets at most `--tokenizer_vocab_size` tokens, padded to a multiple of 128
    (`training/core/build.py`); a checkpoint keeps its own, and `--tokenizer_name` keeps the preset's (read only
    with the data)."""
    if cfg.model_name_or_path is not None or cfg.tokenizer_name is not None:
        return config
    planned = copy.deepcopy(config)
    planned.vocab_size = 128 * math.ceil(cfg.tokenizer_vocab_size / 128)
    return planned


def candidate_sizes(overrides: dict | None = None) -> list[tuple[str, object]]:
    """(name, config) of every preset with `overrides` applied (a tokenizer's vocab_size, say), smallest first,
    each preceded by the depths of it that are larger than the preset before (`--config_overrides
    num_hidden_layers=N`): neighbouring presets are about 3x apart in parameters, too coarse to say what fits."""
    from model import PRESETS, ShardGPTConfig
    from training.plan.memory.layout import layout

    def build(name: str, **depth) -> ShardGPTConfig:
        return ShardGPTConfig.from_preset(name, **{**(overrides or {}), **depth})

    out, below = [], 0
    for psi, name in sorted((layout(build(name)).psi, name) for name in PRESETS):
        layers = build(name).num_hidden_layers
        one = layout(build(name, num_hidden_layers=1)).psi  # every further layer adds the same parameters
        per_layer = (psi - one) // max(1, layers - 1)
        out += [(f"{name} num_hidden_layers={depth}", build(name, num_hidden_layers=depth))
                for depth in range(1, layers) if one + (depth - 1) * per_layer > below]  # fmt: skip
        out.append((name, build(name)))
        below = psi
    return out


def largest_that_fits(launch: Planned, have: Capacity, overrides: dict | None = None) -> tuple[str, object] | None:
    """The largest of `candidate_sizes` that `launch` is predicted to fit in `have` (None: not even the smallest).
    Memory grows with the size, so a bisection finds it in a few predictions."""
    sizes = candidate_sizes(overrides)
    lo, hi = 0, len(sizes)  # sizes[:lo] fit, sizes[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if shortfalls(sizes[mid][1], launch, have):
            hi = mid
        else:
            lo = mid + 1
    return sizes[lo - 1] if lo else None
