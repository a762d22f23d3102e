"""A DeepSpeed JSON resolved against the run's flags: every `"auto"` replaced by the value a flag gives, so the same
JSON serves the `deepspeed` launcher, `accelerate launch` and the HF Trainer. A value the JSON fixes that disagrees
with a flag is an error naming both and the fix; so is a key DeepSpeed does not know.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from training.axes.table import AXES
from training.mesh import Mesh

if TYPE_CHECKING:
    from training.config import RunConfig

# Top-level keys DeepSpeed 0.19 reads (runtime/config.py and the feature configs it builds). DeepSpeed itself
# ignores unknown keys, so a typo ("zero_optimisation") silently trains without ZeRO; here it is an error.
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast", "amp", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "wall_clock_breakdown", "memory_breakdown", "flops_profiler", "tensorboard",
    "wandb", "csv_monitor", "comet", "monitor_config", "aio", "communication_data_type",
    "seq_parallel_communication_data_type", "checkpoint", "data_types", "dataloader_drop_last",
    "disable_allgather", "dump_state", "elasticity", "autotuning", "compression_training", "data_efficiency",
    "curriculum_learning", "pipeline", "hybrid_engine", "nebula", "timers", "quantize_training", "eigenvalue",
    "progressive_layer_drop", "sparse_attention", "weight_quantization", "compile", "tensor_parallel",
    "use_data_before_expert_parallel", "graph_harvesting", "log_level", "disable_python_gc",
    "zenflow", "use_node_local_storage", "legacy_fusion", "sequence_parallel_size",
}  # fmt: skip


@dataclass(frozen=True)
class DeepSpeedJSON:
    """The DeepSpeed config a launch names, as written ("auto" unresolved; the YAML's sequence-parallel degree joined
    in: training/launch.py), and how messages name it."""

    raw: dict
    source: str


def load_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------- reading the JSON


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def offload_devices(ds: dict) -> dict[str, str]:
    zero = ds.get("zero_optimization") or {}
    return {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}


def autotp_size(ds: dict) -> int:
    """Ranks each layer is split over by DeepSpeed AutoTP (`tensor_parallel.autotp_size`); 1 without it."""
    return degree("tensor_parallel.autotp_size", (ds.get("tensor_parallel") or {}).get("autotp_size"))


def sequence_parallel_size(ds: dict) -> int:
    """Ranks each sequence is split over (DeepSpeed Ulysses' `sequence_parallel_size`); 1 without it."""
    return degree("sequence_parallel_size", ds.get("sequence_parallel_size"))


def degree(key: str, value) -> int:
    """A DeepSpeed config's parallel degree `key` (1 where it is absent or null), refused unless a whole number of
    at least 1."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the DeepSpeed config's {key} is {value!r}: set a whole number of ranks, 1 or more")
    return value


def data_parallel_size(ds: dict, world_size: int, source: str) -> int:
    """Ranks that train on different data: the world divided by the tensor-parallel and sequence-parallel sizes."""
    if autotp_size(ds) > 1 and sequence_parallel_size(ds) > 1 and AXES["sp"].alone:
        raise ValueError(
            f"sequence parallelism (sp_size {sequence_parallel_size(ds)}) with DeepSpeed AutoTP (autotp_size "
            f"{autotp_size(ds)}) in {source}: DeepSpeed does not combine the two; remove tensor_parallel from the "
            "DeepSpeed config, or the sequence-parallel setting"
        )
    try:
        return Mesh.of_world(world_size, tp=autotp_size(ds), sp=sequence_parallel_size(ds)).dp
    except ValueError as e:
        raise ValueError(f"DeepSpeed config {source}: {e}") from None


def gradient_reduction_dtype(bf16: bool, bf16_gradient_reduction: bool) -> str:
    """The dtype DeepSpeed reduces and accumulates gradients in where the JSON says "auto": fp32, or bf16 when
    bf16 training opts in with --bf16_gradient_reduction."""
    return "bf16" if bf16 and bf16_gradient_reduction else "fp32"


# ---------------------------------------------------------------------------------------------- unknown keys


def check_deepspeed_keys(ds: dict, source: str) -> None:
    """Unknown keys are errors, with the closest known key as the fix. Keys starting with `_` are comments."""
    for key in ds:
        if key.startswith("_") or key in DEEPSPEED_KEYS:
            continue
        close = difflib.get_close_matches(key, DEEPSPEED_KEYS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would silently ignore it)"
        raise ValueError(f"DeepSpeed config {source}: unknown key {key!r}; {hint}")
    zero = ds.get("zero_optimization")
    if zero is not None:
        # DeepSpeed's own pydantic model of the section, in strict mode: unknown fields are errors.
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        try:
            DeepSpeedZeroConfig(strict=True, **{k: v for k, v in zero.items() if v != "auto"})
        except Exception as e:  # pydantic.ValidationError
            raise ValueError(f"DeepSpeed config {source}: {zero_config_error(e, DeepSpeedZeroConfig)}") from None


def zero_config_error(error, model) -> str:
    """The first problem of a pydantic ValidationError of `zero_optimization`, with its fix."""
    first = error.errors()[0] if hasattr(error, "errors") else {"loc": (), "msg": str(error), "type": ""}
    field = ".".join(str(part) for part in ("zero_optimization", *first["loc"]))
    if first["type"] == "extra_forbidden":
        known = [n for name, f in model.model_fields.items() for n in (name, f.alias) if n]
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would silently ignore it)"
        return f"unknown key {field}; {fix}"
    return f"{field} = {first.get('input')!r}: {first['msg']}; fix the value (DeepSpeed's ZeRO config reference)"


# ---------------------------------------------------------------------------------------------- "auto" values


def resolve_deepspeed(
    ds: dict, cfg: RunConfig, world_size: int, hidden_size: int, source: str, cpu_ranks: bool = False
) -> dict:
    """The JSON with every `"auto"` replaced by the value the flags give, after checking that every value
    the JSON fixes agrees with the flags; on `cpu_ranks` its buckets capped (`CPU_BUCKETS`). Returns a new dict;
    `ds` is left as it was."""
    check_deepspeed_keys(ds, source)
    ds = copy.deepcopy(ds)
    resolve_batch(ds, cfg, world_size, source)
    resolve_precision(ds, cfg, source)
    if "optimizer" in ds:
        resolve_optimizer(ds["optimizer"].setdefault("params", {}), cfg, source)
    if "scheduler" in ds:
        params = ds["scheduler"].setdefault("params", {})
        for key, value in (
            ("warmup_min_lr", 0.0), ("warmup_max_lr", cfg.learning_rate), ("warmup_num_steps", cfg.num_warmup_steps),
            ("total_num_steps", cfg.max_steps),
        ):  # fmt: skip
            if params.get(key) == "auto":
                params[key] = value
        check_deepspeed_scheduler(ds["scheduler"], source)
    resolve_zero(ds.get("zero_optimization") or {}, cfg, hidden_size, source, cpu_ranks)
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ValueError(
            f'DeepSpeed config {source}: no flag resolves {", ".join(leftover)} = "auto"; set them to values in '
            "the JSON (the flags fill batch sizes, clipping, precision, optimizer and scheduler values and ZeRO's "
            "bucket sizes)"
        )
    return ds


def own(section: dict, key: str, value, flag: str, source: str, where: str = "") -> None:
    """Fill an `"auto"` (or absent) value of `section` with the flag's; a fixed one must equal it."""
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value and not (isinstance(value, float) and abs(float(current) - value) <= 1e-12):
        given = f"{flag} gives {value!r}" if not isinstance(value, bool) else f"{flag} is {'on' if value else 'off'}"
        pass_it = (
            f"pass {flag} {current}" if not isinstance(value, bool) else f"{'' if current else 'do not '}pass {flag}"
        )
        raise ValueError(
            f"DeepSpeed config {source}: {where}{key} = {current!r} but {given}; "
            f'set {where}{key} to "auto" in the JSON, or {pass_it}'
        )


def resolve_batch(ds: dict, cfg: RunConfig, world_size: int, source: str) -> None:
    """Micro batch, accumulation, the global batch they make over the data-parallel ranks, and clipping."""
    micro, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    own(ds, "train_micro_batch_size_per_gpu", micro, "--per_device_train_batch_size", source)
    own(ds, "gradient_accumulation_steps", accum, "--gradient_accumulation_steps", source)
    # The ranks of a tensor-parallel group train on the same batch: the global batch counts data-parallel ranks.
    dp = data_parallel_size(ds, world_size, source)
    global_batch = micro * accum * dp
    if ds.get("train_batch_size", "auto") not in ("auto", global_batch):
        tp = world_size // dp
        ranks = f"data-parallel ranks {dp} (world {world_size} / autotp_size {tp})" if tp > 1 else f"world {world_size}"
        raise ValueError(
            f"DeepSpeed config {source}: train_batch_size = {ds['train_batch_size']} but micro {micro} x "
            f'accumulation {accum} x {ranks} = {global_batch}; set train_batch_size to "auto", or '
            "change --per_device_train_batch_size / --gradient_accumulation_steps / the number of ranks"
        )
    # DeepSpeed's own batch check (runtime/config.py:602, 0.19.8) counts every rank as data-parallel, as it is
    # given no mpu when it is built (accelerate and the Trainer give none): under AutoTP its train_batch_size
    # counts each tensor-parallel group's one batch autotp_size times. Under sequence parallelism accelerate hands
    # it the sequence-parallel groups and it counts world / sequence_parallel_size (runtime/config.py:458-469).
    ds["train_batch_size"] = micro * accum * world_size // sequence_parallel_size(ds)
    own(ds, "gradient_clipping", float(cfg.max_grad_norm), "--max_grad_norm", source)


def resolve_precision(ds: dict, cfg: RunConfig, source: str) -> None:
    """bf16 / fp16 as the flags say, and the dtype gradients are reduced and accumulated in."""
    for dtype, flag in (("bf16", cfg.bf16), ("fp16", cfg.fp16)):
        section = ds.setdefault(dtype, {})
        own(section, "enabled", flag, f"--{dtype}", source, where=f"{dtype}.")
    if ds["bf16"]["enabled"] and ds["fp16"]["enabled"]:
        raise ValueError(f"DeepSpeed config {source}: bf16 and fp16 are both enabled: enable one")
    # Gradients reduced and accumulated in fp32 (DeepSpeed's default is the model's dtype, bf16 under bf16):
    # the project's one definition of mixed precision (docs/precision.md); --bf16_gradient_reduction opts out.
    reduce = gradient_reduction_dtype(cfg.bf16, cfg.bf16_gradient_reduction)
    own(ds, "communication_data_type", reduce, "--bf16_gradient_reduction", source)
    own(ds.setdefault("data_types", {}), "grad_accum_dtype", reduce, "--bf16_gradient_reduction", source,
        where="data_types.")  # fmt: skip


def resolve_optimizer(params: dict, cfg: RunConfig, source: str) -> None:
    """The JSON's own optimizer (`optimizer.params`): AdamW's values from the flags."""
    own(params, "lr", cfg.learning_rate, "--learning_rate", source, "optimizer.params.")
    own(params, "weight_decay", cfg.weight_decay, "--weight_decay", source, "optimizer.params.")
    own(params, "eps", cfg.adam_epsilon, "--adam_epsilon", source, "optimizer.params.")
    betas = [cfg.adam_beta1, cfg.adam_beta2]
    if params.get("betas", "auto") == "auto":
        params["betas"] = betas
    elif list(params["betas"]) != betas:
        raise ValueError(
            f"DeepSpeed config {source}: optimizer.params.betas = {params['betas']} but --adam_beta1/"
            f'--adam_beta2 give {betas}; set betas to "auto", or pass the same betas as flags'
        )


# The one place CPU ranks differ from GPUs in a DeepSpeed config. The shipped JSONs size their buckets for GPUs
# (DeepSpeed's defaults: 5e8-element reduce and all-gather buckets, a 5e7 prefetch); ZeRO-1/2 allocate their two
# reduce buckets whole, which the memory planner then counts, and CPU ranks (the test suite's, a laptop's) have no
# use for collectives that large: there each is capped at 1e7 elements, and the run logs the change.
CPU_BUCKETS = {"reduce_bucket_size": 10_000_000, "allgather_bucket_size": 10_000_000,
               "stage3_prefetch_bucket_size": 10_000_000}  # fmt: skip


# DeepSpeed's defaults of the `zero_optimization` keys the memory and step-time planners read, where a JSON leaves
# them out (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig; tests/training/test_config.py holds them to it).
ZERO_DEFAULTS = {
    "contiguous_gradients": True, "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000, "stage3_model_persistence_threshold": sys.maxsize,
}  # fmt: skip


def zero_defaults(zero: dict) -> dict:
    """`zero` with DeepSpeed's defaults where it leaves a key out; `overlap_comm` defaults on under ZeRO-3 only."""
    stage = int(zero.get("stage", 0))
    return {"overlap_comm": stage == 3, **ZERO_DEFAULTS, **zero}


def auto_buckets(zero: dict, hidden_size: int) -> dict:
    """The values of `zero`'s "auto" communication buckets, sized from the model as the HF Trainer sizes them."""
    sizes = {"reduce_bucket_size": hidden_size * hidden_size,
             "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
             "stage3_param_persistence_threshold": 10 * hidden_size}  # fmt: skip
    return {key: value for key, value in sizes.items() if zero.get(key) == "auto"}


def cpu_capped(zero: dict) -> dict:
    """The buckets of a `zero_optimization` section that CPU ranks cap, at their caps."""
    return {key: cap for key, cap in CPU_BUCKETS.items() if float(zero.get(key, 0)) > cap}


def resolve_zero(zero: dict, cfg: RunConfig, hidden_size: int, source: str, cpu_ranks: bool = False) -> None:
    """`zero_optimization`: offload that the stage supports, buckets sized from the model (capped on CPU ranks),
    NVMe folders that exist."""
    stage = int(zero.get("stage", 0))
    if (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        raise ValueError(
            f"DeepSpeed config {source}: zero_optimization.offload_param needs stage 3 (stage is {stage}); "
            "DeepSpeed would silently keep the parameters on the GPU: set stage to 3, or remove offload_param "
            "(offload_optimizer works with stages 1-3)"
        )
    zero.update(auto_buckets(zero, hidden_size))
    capped = cpu_capped(zero) if cpu_ranks else {}
    if capped:
        logging.getLogger("shardgpt").info(
            "CPU ranks: DeepSpeed %s",
            ", ".join(f"{key} {float(zero[key]):.0e} -> {float(cap):.0e}" for key, cap in capped.items()),
        )
        zero.update(capped)
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if section.get("device") == "nvme":
            if cfg.nvme_path:
                section["nvme_path"] = cfg.nvme_path
            path = section.get("nvme_path")
            if not path or not Path(path).is_dir():
                raise FileNotFoundError(
                    f"DeepSpeed config {source}: zero_optimization.{key}.nvme_path = {path!r} does not exist: "
                    f"create it on a fast local disk, or pass --nvme_path DIR"
                )
            check_libaio(source)


# Scheduler params that DeepSpeed (runtime/lr_schedules.py, 0.19.8) requires to be positive integers; it raises
# "warmup_num_steps must be a positive integer" only inside `deepspeed.initialize`, after the process group.
POSITIVE_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_num_steps",),
    "WarmupDecayLR": ("warmup_num_steps", "total_num_steps"),
    "WarmupCosineLR": ("warmup_num_steps", "total_num_steps"),
}
SCHEDULER_FIX = {
    "warmup_num_steps": "pass --warmup_steps 1 or more (or a --warmup_ratio that gives at least one step)",
    "total_num_steps": 'pass --max_steps, or set it to "auto"',
}


def check_deepspeed_scheduler(scheduler: dict, source: str) -> None:
    """The JSON's scheduler block, after its "auto" values are filled, as DeepSpeed would take it: a known type,
    parameters its class accepts, and positive step counts."""
    from deepspeed.runtime import lr_schedules

    kind, params = scheduler.get("type"), scheduler.get("params", {})
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ValueError(
            f"DeepSpeed config {source}: scheduler.type = {kind!r} is not a DeepSpeed scheduler; choose one of "
            f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}, or remove the scheduler block (the flags' schedule is used)"
        )
    accepted = set(inspect.signature(getattr(lr_schedules, kind)).parameters) - {"self", "optimizer"}
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"DeepSpeed config {source}: scheduler.params.{key} is not a parameter of {kind}; remove it "
                f"({kind} takes {', '.join(sorted(accepted))})"
            )
    for key in POSITIVE_SCHEDULER_PARAMS.get(kind, ()):
        value = params.get(key)
        if key in params and not (isinstance(value, int) and value > 0):
            raise ValueError(
                f"DeepSpeed config {source}: scheduler.params.{key} = {value!r}, but DeepSpeed's {kind} needs a "
                f"positive integer: {SCHEDULER_FIX[key]}"
            )


def check_libaio(source: str) -> None:
    """NVMe offload runs through DeepSpeed's async_io op, which compiles against libaio at first use; a
    missing libaio would otherwise fail minutes later, inside `deepspeed.initialize`."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise RuntimeError(
            f"DeepSpeed config {source} offloads to NVMe, but DeepSpeed's async_io op cannot be built here: "
            "install libaio (apt-get install libaio-dev, or conda install -c conda-forge libaio), or choose a "
            "CPU-offload config such as ds_configs/zero3_offload_cpu.json"
        )


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
