"""Checks of one launch: its accelerate YAML and DeepSpeed JSON resolved for its world size, the
training flags validated as the training script would, the planner's memory for it, and what it sends per step.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from training.doctor.machine import check_nvme
from training.doctor.report import FAIL, NA, OK, WARN, Report, size
from training.paths import ROOT

if TYPE_CHECKING:  # training.strategy imports torch and accelerate: the doctor imports it where it is used
    from training.strategy import Strategy

DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "FSDP", "DEEPSPEED", "XLA")


# ---------------------------------------------------------------------------------------------- the launch


def read_launch_config(path: str | os.PathLike) -> dict:
    """An accelerate YAML as a dict (empty for an empty file)."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def find_file(path: str) -> Path:
    """A path as given, else relative to the repository (configs name `ds_configs/...` from the root)."""
    p = Path(path)
    return p if p.exists() or p.is_absolute() else (ROOT / p if (ROOT / p).exists() else p)


def check_launch_config(report: Report, path: str, num_processes: int | None, found: list[dict]) -> dict | None:
    """The accelerate YAML: readable, a known distributed type, not dropping DeepSpeed/FSDP, ranks vs GPUs."""
    p = find_file(path)
    if not p.is_file():
        report.add(
            "accelerate config", FAIL, f"--config_file {path!r}: no such file; pick one of accelerate_configs/*.yaml"
        )
        return None
    try:
        launch = read_launch_config(p)
    except Exception as e:
        report.add("accelerate config", FAIL, f"--config_file {path!r} is not valid YAML: {e}")
        return None
    kind = str(launch.get("distributed_type", "NO"))
    machines = int(launch.get("num_machines", 1))
    world = num_processes or int(launch.get("num_processes", 1))
    problems = []
    if kind not in DISTRIBUTED_TYPES:
        problems.append(f"distributed_type {kind!r} is unknown; choose one of {', '.join(DISTRIBUTED_TYPES)}")
    if launch.get("use_cpu") and kind in ("DEEPSPEED", "FSDP"):
        problems.append(
            "use_cpu: true makes accelerate drop DeepSpeed/FSDP: set use_cpu: false (the script uses gloo on CPU)"
        )
    if kind == "DEEPSPEED" and not (launch.get("deepspeed_config") or {}):
        problems.append("distributed_type DEEPSPEED without a deepspeed_config section")
    per_node = world // max(machines, 1)
    if world % max(machines, 1):
        problems.append(f"num_processes {world} is not a multiple of num_machines {machines}")
    if found and per_node > len(found):
        problems.append(
            f"{per_node} processes per node but {len(found)} GPU(s) here: pass --num_processes {len(found)}"
        )
    detail = f"{p.name}: {kind}, {world} process(es) on {machines} machine(s)"
    status = FAIL if problems else OK
    if not problems and not found and per_node > (os.cpu_count() or 1):
        status, detail = WARN, detail + f"; {per_node} CPU ranks share {os.cpu_count()} cores"
    report.add("accelerate config", status, "; ".join([detail, *problems]))
    launch["_world"] = world
    launch["_path"] = p
    return launch


def parse_train_flags(report: Report, flags: list[str]):
    """The training script's own parser; problems become a FAIL naming the flag."""
    from training.arguments import parse_run_config

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg, rest = parse_run_config(flags, remaining=True, prog="recipes/train.py")
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "cannot parse the flags"
        report.add("training flags", FAIL, message)
        return None
    if rest:
        report.add("training flags", FAIL, f"unknown flags {rest}: `python recipes/train.py --help` lists them")
        return None
    return cfg


def launched_environment(launch: dict | None, world: int):
    """The environment the launch's ranks get: made from its YAML by accelerate's own launcher code, or a plain one
    of `world` ranks (torchrun, the deepspeed launcher)."""
    from training.environment import Environment

    return Environment.of_accelerate_config(launch["_path"], world) if launch else Environment(world=world)


def check_training(report: Report, args, launch: dict | None, found: list[dict], bf16_ok: bool) -> None:
    """The launch resolved exactly as the training script resolves it at start-up (training/launch.py), from the
    environment accelerate makes of the YAML: the flags, the DeepSpeed JSON, the strategy and its checks."""
    from training import launch as launching
    from training.config import RunConfig

    flags = list(args.train_flags)
    if args.deepspeed:
        flags += ["--deepspeed", str(find_file(args.deepspeed))]
    if args.nvme_path and not any(f.startswith("--nvme_path") for f in flags) and Path(args.nvme_path).is_dir():
        flags += ["--nvme_path", args.nvme_path]
    cfg: RunConfig | None = parse_train_flags(report, flags)
    if cfg is None:
        return
    world = launch["_world"] if launch else args.num_processes or max(len(found), 1)
    try:
        env = launched_environment(launch, world)
        # The ranks that train on different data: the world over the pipeline's and tensor-parallel degrees, as the
        # training script counts them.
        launched = launching.Launched.read(cfg.deepspeed, env)  # the DeepSpeed JSON, read once
        dp = launched.data_parallel_ranks(cfg)
        cfg = cfg.resolve(dp, env.precision)
    except Exception as e:
        report.add("training flags", FAIL, str(e))
        return
    from model.__main__ import count_parameters

    config = cfg.model_config()
    params = count_parameters(config)
    precision = cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32"
    report.add(
        "training flags",
        OK,
        f"preset {cfg.preset} ({params / 1e6:,.1f}M parameters before the tokenizer's vocabulary), {precision}, "
        f"global batch {cfg.global_batch(dp)} = micro {cfg.per_device_train_batch_size} x accumulation "
        f"{cfg.gradient_accumulation_steps} x {f'world {world}' if dp == world else f'data-parallel ranks {dp}'}",
    )
    if cfg.bf16 and not bf16_ok:
        report.add("precision", FAIL, "--bf16 is set but bf16 does not work here (see the bf16 check): drop --bf16")
    try:
        strategy = launching.requested_strategy(cfg, launched)
    except Exception as e:  # the DeepSpeed JSON, or a strategy the training script refuses
        report.add("DeepSpeed config" if launched.deepspeed else "strategy", FAIL, str(e))
        return  # what follows (NVMe need, memory plan) depends on the resolved launch
    ds = strategy.deepspeed
    if ds is not None:
        ds_file = cfg.deepspeed or env.deepspeed_config_file
        report.deepspeed = ds
        report.resolved.update(describe_deepspeed(strategy, ds_file or strategy.deepspeed_source))
        named = Path(ds_file).name if ds_file else "the inline deepspeed_config"
        report.add("DeepSpeed config", OK, f"{named} resolves: no unknown keys, no leftover auto")
    if strategy.family == "fsdp" and env.fsdp:
        fsdp = env.fsdp_env
        report.resolved.update({
            "FSDP version": strategy.fsdp_version,
            "reshard after forward": fsdp.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true",
            "offload params": strategy.offloads,
            "state dict": fsdp.get("FSDP_STATE_DICT_TYPE"),
            "global batch": f"{cfg.global_batch(dp)} (= micro x accumulation x data-parallel ranks {dp})",
            "precision": precision,
        })  # fmt: skip
    report.resolved = {"strategy": f"{strategy.name} on {world} rank(s)", **report.resolved}
    axes(report, strategy, cfg.pipeline_parallel_degree)

    # NVMe offload: this node's ranks swap their shards of the fp32 weights, master copies and Adam states.
    per_node = world // int((launch or {}).get("num_machines", 1) or 1)
    need = 16 * params * per_node // world
    zero = (ds or {}).get("zero_optimization") or {}
    nvme_paths = {(zero.get(k) or {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
                  if (zero.get(k) or {}).get("device") == "nvme"}  # fmt: skip
    for path in sorted(p for p in nvme_paths - {args.nvme_path} if p):
        check_nvme(report, path, "the config's nvme_path", args.write_mb, need)
    if args.nvme_path and nvme_paths:
        args.nvme_need = need
    plan(report, config, strategy, per_node, cfg, ds)
    traffic(report, config, strategy, cfg, ds)


def axes(report: Report, strategy: Strategy, pp: int) -> None:
    """The model-parallel axes the launch asks for, against the axes table (training/axes/table.py): each under a
    wrapper that trains it, and alone or with the axes it composes with (COMPOSED)."""
    from training.axes.table import AXES, composes, composes_with, wrapper

    held_by = wrapper(strategy.family, strategy.zero_stage)
    degrees = {"pp": pp, "tp": strategy.tp_size, "sp": strategy.sp_size, "cp": strategy.cp_size}
    asked = {axis: degree for axis, degree in degrees.items() if degree > 1}
    if not asked:
        return
    wrong = [f"{AXES[a].name} does not train under {held_by} (it trains under {', '.join(AXES[a].trains_under)})"
             for a in asked if not composes(a, held_by)]  # fmt: skip
    pairs = [(a, b) for a in asked for b in asked if a < b]
    if any(AXES[a].alone or AXES[b].alone or not composes_with(a, b, held_by) for a, b in pairs):
        wrong.append(f"{' with '.join(AXES[a].name for a in asked)}: these axes do not train together under {held_by}")
    seen = ", ".join(f"{AXES[a].name} {d} under {held_by}" for a, d in asked.items())
    report.add("parallel axes", FAIL if wrong else OK, "; ".join(wrong) if wrong else seen)


def global_batch_line(strategy: Strategy) -> str:
    """The global batch of a resolved DeepSpeed launch: micro x accumulation x data-parallel ranks (a tensor-parallel
    group trains on one batch; DeepSpeed's own `train_batch_size` counts every rank)."""
    ds, world, tp, sp = strategy.deepspeed, strategy.world_size, strategy.tp_size, strategy.sp_size
    batch = ds["train_batch_size"] // tp  # under sequence parallelism DeepSpeed's count is world / sp already
    if sp > 1:
        return f"{batch} (= micro x accumulation x data-parallel ranks {world // sp}: world {world} / sp {sp})"
    if tp == 1:
        return f"{batch} (= micro x accumulation x world {world})"
    return f"{batch} (= micro x accumulation x data-parallel ranks {world // tp}: world {world} / autotp_size {tp})"


def describe_deepspeed(strategy: Strategy, source: str) -> dict:
    """The resolved DeepSpeed values that decide memory and speed."""
    ds = strategy.deepspeed
    return {
        "DeepSpeed config": source,
        "ZeRO stage": strategy.zero_stage,
        "offload optimizer": strategy.offload_optimizer,
        "offload params": strategy.offload_param,
        "micro batch per rank": ds["train_micro_batch_size_per_gpu"],
        "gradient accumulation": ds["gradient_accumulation_steps"],
        "global batch": global_batch_line(strategy),
        "precision": "bf16" if ds["bf16"]["enabled"] else "fp16" if ds["fp16"]["enabled"] else "fp32",
        "gradient clipping": ds.get("gradient_clipping"),
        "optimizer": (ds.get("optimizer") or {}).get("type", "torch AdamW from the script"),
        "reduce bucket": (ds.get("zero_optimization") or {}).get("reduce_bucket_size"),
    }


def plan(report: Report, config, strategy: Strategy, per_node: int, cfg, ds) -> None:
    """The check the training script makes before it starts (`training/plan/memory/fit.py`): the memory planner's
    prediction for this launch against this host's free GPU memory, RAM and NVMe disk, with the cheapest fix."""
    from training.plan.memory.fit import (
        MemoryFitError,
        capacity,
        check_memory_fit,
        needs,
        nvme_path,
        planned_config,
        training_launch,
    )

    launch = training_launch(cfg, strategy, per_node, ds)
    if launch is None:
        report.add("memory plan", NA, f"the planner does not model {strategy.name}")
        return
    config = planned_config(cfg, config)  # the vocabulary the run will have, as the training script plans it
    nvme = nvme_path(ds)
    try:
        have = capacity(nvme if nvme and Path(nvme).is_dir() else None)
        need = needs(config, launch, have.gpu_free is not None)
        check_memory_fit(config, launch, have)
    except MemoryFitError as e:
        report.add("memory plan", FAIL, str(e))
        return
    except Exception as e:
        report.add("memory plan", WARN, f"plan_memory.predict failed: {type(e).__name__}: {e}")
        return
    free = {"GPU memory": have.gpu_free, "host RAM": have.host_free, "NVMe disk": have.disk_free}
    parts = [f"{size(n)} of {size(free[where])} {where} free" for where, n in need if free[where] is not None]
    status = WARN if any(n > 0.9 * free[where] for where, n in need if free[where] is not None) else OK
    host = f"predicted for the {launch.ranks_per_host} rank(s) of this host: "
    report.add("memory plan", status, host + "; ".join(parts))


def traffic(report: Report, config, strategy: Strategy, cfg, ds: dict | None) -> None:
    """What each rank will send per step (training/plan/communication.py's closed form for the settings in force,
    measured to the byte on CPU ranks: the data-parallel strategies', AutoTP's and Ulysses'), against the ZeRO paper's
    volume, and
    what the DeepSpeed settings that change it would save."""
    from collections import Counter

    import torch

    from model import ShardGPTForCausalLM
    from training.axes.tensor.checks import tp_plan_styles
    from training.plan.communication import ModelShape, paper_volume, step_payloads
    from training.plan.memory.fit import planned_config

    zero = (ds or {}).get("zero_optimization") or {}
    threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if strategy.zero_stage == 3 else 0
    model_config = planned_config(cfg, config)
    shape = ModelShape.of(model_config, threshold)
    element = 2 if (ds or {}).get("communication_data_type") in ("bf16", "fp16") else 4  # else fp32 gradients
    micro_tokens, accumulation = cfg.per_device_train_batch_size * cfg.block_size, cfg.gradient_accumulation_steps
    split = None
    if strategy.tp_size > 1:  # the modules AutoTP splits, from the model's plan (on the meta device: no weights)
        with torch.device("meta"):
            split = dict(Counter(tp_plan_styles(ShardGPTForCausalLM(model_config)).values()))

    def volume(s: Strategy) -> float | None:  # the paper's volume in Psi: an all-reduce of S counts 2S
        payloads = step_payloads(s, shape, model_config, micro_tokens, accumulation, split, element, optim=cfg.optim)
        if payloads is None:
            return None
        return sum(2 * n if kind == "all_reduce" else n for kind, n in payloads.items()) / (element * shape.parameters)

    psi = volume(strategy)
    if psi is None:
        accumulation = cfg.gradient_accumulation_steps
        per_step = f" with {accumulation} micro batches a step" if accumulation > 1 else ""
        report.add("communication", NA, f"no closed form for {strategy.name}{per_step} (strategy.json measures a run)")
        return
    step = size(psi * element * shape.parameters)
    micro = f" of {accumulation} micro batches" if accumulation > 1 else ""
    detail = f"{psi:.2f} Psi ({step}) per rank and step{micro}, {element}-byte elements"
    if strategy.tp_size > 1:
        detail += " (AutoTP's all-reduces of the activations included)"
    elif strategy.sp_size > 1:
        detail += " (Ulysses' all-to-alls included)"
    paper = paper_volume(strategy, shape.parameters)
    if paper is not None and accumulation == 1:  # the paper counts a step of one micro batch
        detail += f"; the ZeRO paper's {paper // (4 * shape.parameters)} Psi"
    # The settings that change it, each against the value in force (ds_configs' JSONs ship DeepSpeed's defaults).
    if strategy.zero_stage in (1, 2) and strategy.tp_size == 1 and zero.get("use_multi_rank_bucket_allreduce", True):
        reduced = {**zero, "use_multi_rank_bucket_allreduce": False}
        other = replace(strategy, deepspeed={**ds, "zero_optimization": reduced})
        detail += (f"; use_multi_rank_bucket_allreduce is true (all-reduced gradient buckets): false reduces them, "
                   f"{volume(other):.2f} Psi")  # fmt: skip
    if strategy.zero_stage == 3:
        limits = ("stage3_max_live_parameters", "stage3_max_reuse_distance")
        kept = {**zero, **dict.fromkeys(limits, max(shape.parameters, int(1e9)))}
        saved = psi - volume(replace(strategy, deepspeed={**ds, "zero_optimization": kept}))
        if saved > 0:
            detail += (f"; {' and '.join(limits)} below the {shape.parameters:,} parameters re-gather in the backward: "
                       f"at least that, {psi - saved:.2f} Psi (more memory held)")  # fmt: skip
    report.add("communication", OK, detail)
