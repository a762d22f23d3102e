"""What to check before a big launch: this machine, and the launch's resolved config.

    python recipes/doctor.py                                           # the machine alone
    python recipes/doctor.py --config_file accelerate_configs/zero3.yaml -- --preset gpt2-124m --bf16
    python recipes/doctor.py --deepspeed ds_configs/zero3_offload_nvme.json --num_processes 8 \\
        --nvme_path /local_nvme -- --per_device_train_batch_size 4 --output_dir runs/big

Checks: GPUs and their memory, the NCCL/gloo process groups (a one-rank all-reduce), bf16, which DeepSpeed
ops can be built here (`is_compatible()`; `--build-ops` compiles the ones the configs use), libaio, pinned
host memory, an NVMe path's free space and measured write speed, and, given a launch (an accelerate YAML
and/or a DeepSpeed JSON, plus the training flags after `--`), the training script's own checks
(`RunConfig.validate`, `resolve_deepspeed` with the launch's world size) and the resolved values that
decide memory and speed. Prints a table (OK / WARN / FAIL / n/a per check); exits 1 when a check FAILs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from recipes.ops import CPU_OPS, GPU_OPS, build_dir, check_op_cache, left_by_killed_build, stale_lock, used_ops

ROOT = Path(__file__).resolve().parents[1]
OK, WARN, FAIL, NA = "OK", "WARN", "FAIL", "n/a"
DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "FSDP", "DEEPSPEED", "XLA")
SLOW_DISK_MBPS = 500  # below this, NVMe offload's swapping dominates the step (a local NVMe writes > 1 GB/s)


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    resolved: dict = field(default_factory=dict)  # key values of the launch, printed under the table
    deepspeed: dict | None = None  # the resolved DeepSpeed JSON

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)


# ---------------------------------------------------------------------------------------------- machine


def check_versions(report: Report) -> None:
    import accelerate
    import deepspeed
    import torch
    import transformers

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    report.add(
        "software",
        OK,
        f"python {platform.python_version()}, torch {torch.__version__} ({build}), transformers "
        f"{transformers.__version__}, accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}",
    )


def gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                      "free_gb": free / 2**30, "total_gb": total / 2**30})  # fmt: skip
    return found


def check_gpus(report: Report, found: list[dict]) -> None:
    if not found:
        report.add("GPUs", WARN, "no GPU: torch.cuda.is_available() is False; every strategy runs on CPU ranks (gloo)")
        return
    lines = [f"{g['index']}: {g['name']} (sm {g['capability']}), {g['free_gb']:.1f} of {g['total_gb']:.1f} GiB free"
             for g in found]  # fmt: skip
    busy = [g for g in found if g["free_gb"] < 0.9 * g["total_gb"]]
    status = WARN if busy else OK
    note = f"; GPU {', '.join(str(g['index']) for g in busy)} already in use" if busy else ""
    report.add("GPUs", status, f"{len(found)} GPU(s): " + "; ".join(lines) + note)


def check_process_groups(report: Report, found: list[dict]) -> None:
    """Which backends torch has, and a one-rank all-reduce through each usable one."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        report.add("process group", FAIL, "torch.distributed is not available in this torch build")
        return
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    if dist.is_initialized():  # called from inside a launched process: its group is the proof
        report.add("process group", OK, f"a {dist.get_backend()} group of {dist.get_world_size()} is initialized")
        return
    tried = []
    for name, available in backends.items():
        if not available or (name == "nccl" and not found):
            continue
        device = "cuda:0" if name == "nccl" else "cpu"
        try:
            store = dist.HashStore()
            dist.init_process_group(name, store=store, rank=0, world_size=1)
            x = torch.ones(4, device=device)
            dist.all_reduce(x)
            tried.append(f"{name} all-reduce ok")
        except Exception as e:
            tried.append(f"{name} failed: {type(e).__name__}: {e}")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items())
    detail = f"{have}; {'; '.join(tried) or 'none tried'}"
    if any("failed" in t for t in tried) or not any("ok" in t for t in tried):
        status = FAIL
    elif found and not backends["nccl"]:
        status, detail = WARN, detail + " (GPUs without NCCL: multi-GPU runs fall back to gloo, slowly)"
    else:
        status = OK
        if not found:
            detail += " (NCCL needs GPUs: CPU ranks use gloo)"
    report.add("process group", status, detail)


def bf16_support(found: list[dict]) -> tuple[bool, str]:
    import torch

    if found:
        ok = torch.cuda.is_bf16_supported()
        caps = ", ".join(sorted({g["capability"] for g in found}))
        return ok, f"CUDA bf16 {'supported' if ok else 'not supported'} (compute capability {caps}; needs 8.0+)"
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    try:
        err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max().item()
    except RuntimeError as e:
        return False, f"a bf16 matmul on CPU fails: {e}"
    cap = torch.backends.cpu.get_cpu_capability()
    ok = err < 1.0  # bf16 keeps 8 bits of mantissa: a 64-long dot product of N(0,1) is off by ~0.05
    return ok, f"CPU bf16 matmul {'works' if ok else 'is wrong'} (max abs err {err:.3f} vs fp32; CPU capability {cap})"


def check_bf16(report: Report, found: list[dict]) -> bool:
    ok, detail = bf16_support(found)
    report.add("bf16", OK if ok else WARN, detail + ("" if ok else "; train in fp32 (or --fp16 on GPUs)"))
    return ok


def check_ops(report: Report, build: bool) -> None:
    """DeepSpeed's ops for this accelerator: which can be compiled here (without compiling them)."""
    import deepspeed.git_version_info as info
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    compatible, incompatible = [], []
    with contextlib.redirect_stdout(io.StringIO()):  # some builders print why they are incompatible
        for name, builder in sorted(ALL_OPS.items()):
            if name == "deepspeed_not_implemented":
                continue
            try:
                (compatible if builder.is_compatible(verbose=False) else incompatible).append(name)
            except Exception:
                incompatible.append(name)
    prebuilt = [k for k, v in info.installed_ops.items() if v]
    toolchain = {"ninja": shutil.which("ninja"), "c++": shutil.which("c++") or shutil.which("g++")}
    missing = [k for k, v in toolchain.items() if not v]
    detail = f"buildable: {', '.join(compatible) or 'none'}"
    if incompatible:
        detail += f"; not buildable here: {', '.join(incompatible)}"
    detail += f"; prebuilt: {', '.join(prebuilt) or 'none (compiled at first use, JIT)'}"
    status = OK
    ops = used_ops()
    if missing and set(ops) - set(prebuilt):
        status, detail = WARN, detail + f"; no {' or '.join(missing)} on PATH: JIT builds will fail"
    if "cpu_adam" in incompatible:
        status, detail = WARN, detail + "; cpu_adam missing: CPU offload configs cannot run"
    try:  # last: a FAIL here must not be lowered to a WARN above
        uncached = check_op_cache(ops)
        detail += f"; not compiled yet (--build-ops): {', '.join(uncached)}" if uncached else "; launches' ops cached"
    except ValueError as e:  # a lock left by a killed build: a launch would hang on it
        status, detail = FAIL, f"{detail}; {e}"
    report.add("DeepSpeed ops", status, detail)
    if build:
        build_ops(report)


def build_ops(report: Report, names: tuple[str, ...] | None = None, remove_stale_locks: bool = False) -> None:
    """Compile (or load from the extension cache) `names`, by default the ops a launch here uses, so that no
    rank compiles them inside a timed launch. A lock file left by a killed build fails the op's check, or is
    removed with `remove_stale_locks`, instead of making this wait forever."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    for name in names or used_ops():
        builder = ALL_OPS.get(name)
        if builder is None or not builder.is_compatible(verbose=False):
            report.add(f"build {name}", NA, "not buildable for this accelerator")
            continue
        lock = stale_lock(build_dir(builder.name))
        if lock is not None:
            left = left_by_killed_build(name, lock)
            if not remove_stale_locks:
                report.add(f"build {name}", FAIL, f"{left}: remove it (rm {lock}) and rerun")
                continue
            lock.unlink(missing_ok=True)
            report.add(f"lock {name}", WARN, f"{left}: removed it")
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                builder.load(verbose=False)
            report.add(f"build {name}", OK, f"built or loaded in {time.perf_counter() - t0:.1f} s")
        except Exception as e:
            report.add(f"build {name}", FAIL, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")


def check_libaio(report: Report, needed: bool) -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    header = Path("/usr/include/libaio.h").is_file()
    lib = ctypes.util.find_library("aio")
    with contextlib.redirect_stdout(io.StringIO()):
        ok = AsyncIOBuilder().is_compatible(verbose=False)
    detail = f"libaio library {lib or 'not found'}, header {'found' if header else 'not found'}; async_io op "
    detail += "buildable" if ok else "not buildable"
    if ok:
        report.add("libaio", OK, detail)
    else:
        fix = " (apt-get install libaio-dev, or conda install -c conda-forge libaio)"
        report.add(
            "libaio", FAIL if needed else WARN, detail + fix + ("; the launch offloads to NVMe" if needed else "")
        )


def check_pinned_memory(report: Report, found: list[dict]) -> None:
    import torch

    if not found:
        report.add("pinned memory", NA, "needs CUDA: on CPU ranks pin_memory is a no-op")
        return
    try:
        n = 256 * 2**20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        dev.copy_(host, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        gbps = 4 * n / (time.perf_counter() - t0) / 1e9
        report.add("pinned memory", OK, f"256 MiB pinned; host-to-GPU copy {gbps:.1f} GB/s")
    except Exception as e:
        report.add("pinned memory", FAIL, f"pinned allocation failed: {type(e).__name__}: {e}")


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def measure_write_speed(directory: Path, megabytes: int = 64) -> float:
    """MiB/s of writing `megabytes` MiB in 1 MiB chunks with an fsync at the end; the file is removed."""
    chunk = os.urandom(2**20)
    fd, name = tempfile.mkstemp(prefix=".shardgpt-doctor-", suffix=".bin", dir=directory)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb", buffering=0) as f:
            for _ in range(megabytes):
                f.write(chunk)
            os.fsync(f.fileno())
        return megabytes / (time.perf_counter() - t0)
    finally:
        os.unlink(name)


def check_nvme(report: Report, path: str, source: str, megabytes: int, need_bytes: int | None) -> None:
    """An NVMe offload directory: exists, writable, free space, measured write speed."""
    name = f"NVMe path {path}"
    p = Path(path)
    if not p.exists():
        report.add(name, FAIL, f"{source} {path!r} does not exist: create it on a fast local disk (mkdir -p {path})")
        return
    if not p.is_dir():
        report.add(name, FAIL, f"{source} {path!r} is not a directory")
        return
    if not os.access(p, os.W_OK):
        report.add(name, FAIL, f"{source} {path!r} is not writable by this user")
        return
    free = shutil.disk_usage(p).free
    detail = f"{free / 2**30:.1f} GiB free"
    status = OK
    if need_bytes is not None:
        detail += f" (the offloaded model states need about {size(need_bytes)} on this node)"
        if free < need_bytes:
            status = FAIL
    if free < 2 * megabytes * 2**20:
        report.add(name, FAIL if status == FAIL else WARN, detail + "; too little space for the write test")
        return
    speed = measure_write_speed(p, megabytes)
    detail += f"; write {speed:,.0f} MiB/s ({megabytes} MiB, fsync)"
    if speed < SLOW_DISK_MBPS and status == OK:
        status = WARN
        detail += f": slower than {SLOW_DISK_MBPS} MiB/s, NVMe offload will wait on the disk"
    report.add(name, status, detail)


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
    from transformers import HfArgumentParser

    from recipes.config import RunConfig

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg, rest = HfArgumentParser(RunConfig, prog="recipes/train.py").parse_args_into_dataclasses(
                args=flags, return_remaining_strings=True
            )
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "cannot parse the flags"
        report.add("training flags", FAIL, message)
        return None
    if rest:
        report.add("training flags", FAIL, f"unknown flags {rest}: `python recipes/train.py --help` lists them")
        return None
    return cfg


def strategy_name(launch: dict | None, ds: dict | None, world: int) -> str:
    """The name `recipes/distributed.py` gives the strategy (zero3-offload-cpu, fsdp-shard-grad-op, ...)."""
    from recipes.config import offload_devices, zero_stage

    if ds is not None:
        devices = offload_devices(ds)
        offload = next((d for d in (devices["offload_param"], devices["offload_optimizer"]) if d != "none"), None)
        return f"zero{zero_stage(ds)}" + (f"-offload-{offload}" if offload else "")
    if launch and launch.get("distributed_type") == "FSDP":
        fsdp = launch.get("fsdp_config") or {}
        shard = (launch.get("parallelism_config") or {}).get("parallelism_config_dp_shard_size", world)
        name = "fsdp-hybrid" if shard < world else "fsdp"
        if fsdp.get("fsdp_sharding_strategy") == "SHARD_GRAD_OP" or fsdp.get("fsdp_reshard_after_forward") is False:
            name += "-shard-grad-op"
        return name + ("-offload" if fsdp.get("fsdp_offload_params") else "")
    return "ddp" if world > 1 else "single"


def check_training(report: Report, args, launch: dict | None, found: list[dict], bf16_ok: bool) -> None:
    """RunConfig.validate and resolve_deepspeed exactly as the training script runs them at start-up."""
    from recipes.config import RunConfig, load_json, resolve_deepspeed

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
        cfg.validate(world)
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
        f"global batch {cfg.global_batch(world)} = micro {cfg.per_device_train_batch_size} x accumulation "
        f"{cfg.gradient_accumulation_steps} x world {world}",
    )
    if cfg.bf16 and not bf16_ok:
        report.add("precision", FAIL, "--bf16 is set but bf16 does not work here (see the bf16 check): drop --bf16")
    if cfg.fp16 and not found:
        report.add("precision", WARN, "--fp16 on CPU ranks: fp16 matmuls are slow and untested here; use --bf16")

    launch = launch or {}
    ds_section = launch.get("deepspeed_config") or {}
    ds_file = cfg.deepspeed or ds_section.get("deepspeed_config_file")
    if launch.get("distributed_type") == "FSDP" and ds_file:
        report.add("strategy", FAIL, "both FSDP (the accelerate config) and DeepSpeed (--deepspeed) are requested")
        return
    yaml_precision = str(launch.get("mixed_precision", "no"))
    if yaml_precision not in ("no", cfg.mixed_precision):
        report.add(
            "strategy", FAIL,
            f"the accelerate config sets mixed_precision: {yaml_precision} but the flags give {cfg.mixed_precision}: "
            f"pass --{yaml_precision}, or set mixed_precision: 'no' in the YAML",
        )  # fmt: skip
    ds = None
    if ds_section and not ds_file:
        report.add("DeepSpeed config", WARN, "inline deepspeed_config fields: accelerate builds the JSON at launch")
    elif ds_file:
        try:
            ds = resolve_deepspeed(load_json(find_file(ds_file)), cfg, world, config.hidden_size, repr(str(ds_file)))
        except Exception as e:
            report.add("DeepSpeed config", FAIL, str(e))
            return  # what follows (strategy, NVMe need, memory plan) depends on the resolved JSON
        report.deepspeed = ds
        report.resolved.update(describe_deepspeed(ds, str(ds_file), world))
        report.add("DeepSpeed config", OK, f"{Path(ds_file).name} resolves: no unknown keys, no leftover auto")
    if launch.get("distributed_type") == "FSDP":
        fsdp = launch.get("fsdp_config") or {}
        report.resolved.update({
            "FSDP version": fsdp.get("fsdp_version", 1),
            "reshard after forward": fsdp.get("fsdp_reshard_after_forward", True),
            "offload params": fsdp.get("fsdp_offload_params", False),
            "state dict": fsdp.get("fsdp_state_dict_type"),
            "global batch": f"{cfg.global_batch(world)} (= micro x accumulation x world {world})",
            "precision": precision,
        })  # fmt: skip
    name = strategy_name(launch, ds, world)
    report.resolved = {"strategy": f"{name} on {world} rank(s)", **report.resolved}

    # NVMe offload: this node's ranks swap their shards of the fp32 weights, master copies and Adam states.
    per_node = world // int(launch.get("num_machines", 1) or 1)
    need = 16 * params * per_node // world
    zero = (ds or {}).get("zero_optimization") or {}
    nvme_paths = {(zero.get(k) or {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
                  if (zero.get(k) or {}).get("device") == "nvme"}  # fmt: skip
    for path in sorted(p for p in nvme_paths - {args.nvme_path} if p):
        check_nvme(report, path, "the config's nvme_path", args.write_mb, need)
    if args.nvme_path and nvme_paths:
        args.nvme_need = need
    plan(report, config, name, world, per_node, cfg, ds)


def describe_deepspeed(ds: dict, source: str, world: int) -> dict:
    """The resolved DeepSpeed values that decide memory and speed."""
    from recipes.config import offload_devices, zero_stage

    devices = offload_devices(ds)
    return {
        "DeepSpeed config": source,
        "ZeRO stage": zero_stage(ds),
        "offload optimizer": devices["offload_optimizer"],
        "offload params": devices["offload_param"],
        "micro batch per rank": ds["train_micro_batch_size_per_gpu"],
        "gradient accumulation": ds["gradient_accumulation_steps"],
        "global batch": f"{ds['train_batch_size']} (= micro x accumulation x world {world})",
        "precision": "bf16" if ds["bf16"]["enabled"] else "fp16" if ds["fp16"]["enabled"] else "fp32",
        "gradient clipping": ds.get("gradient_clipping"),
        "optimizer": (ds.get("optimizer") or {}).get("type", "torch AdamW from the script"),
        "reduce bucket": (ds.get("zero_optimization") or {}).get("reduce_bucket_size"),
    }


def plan(report: Report, config, name: str, world: int, per_node: int, cfg, ds) -> None:
    """The check the training script makes before it starts (`recipes/memory_fit.py`): the memory planner's
    prediction for this launch against this host's free GPU memory, RAM and NVMe disk, with the cheapest fix."""
    from recipes.memory_fit import Launch, MemoryFitError, capacity, check_memory_fit, needs, planner_strategy

    mapped = planner_strategy(name, world, None)
    if mapped is None:
        report.add("memory plan", NA, f"the planner does not model {name}")
        return
    zero = (ds or {}).get("zero_optimization") or {}
    nvme = next((zero[k].get("nvme_path") for k in ("offload_param", "offload_optimizer")
                 if (zero.get(k) or {}).get("device") == "nvme"), None)  # fmt: skip
    launch = Launch(
        mapped[0], mapped[1], min(per_node, mapped[1]), cfg.mixed_precision if cfg.mixed_precision != "no" else "fp32",
        cfg.per_device_train_batch_size, cfg.block_size, cfg.gradient_checkpointing, ds,
    )  # fmt: skip
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


# ---------------------------------------------------------------------------------------------- main


def run_checks(args) -> Report:
    report = Report()
    check_versions(report)
    found = gpus()
    check_gpus(report, found)
    check_process_groups(report, found)
    bf16_ok = check_bf16(report, found)
    check_ops(report, args.build_ops)
    check_pinned_memory(report, found)
    launch = None
    if args.config_file:
        launch = check_launch_config(report, args.config_file, args.num_processes, found)
    args.nvme_need = None
    asked = args.config_file or args.deepspeed or args.train_flags
    if asked and not (args.config_file and launch is None):  # a YAML that cannot be read has its FAIL already
        check_training(report, args, launch, found, bf16_ok)
    nvme = bool(report.deepspeed and "nvme" in json.dumps(report.deepspeed.get("zero_optimization", {})))
    check_libaio(report, needed=nvme)
    if args.nvme_path:
        check_nvme(report, args.nvme_path, "--nvme_path", args.write_mb, args.nvme_need)
    return report


def render(report: Report) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  {'-' * 40}"]
    lines += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in report.checks]
    if report.resolved:
        lines += ["", "resolved launch:"]
        key_width = max(len(k) for k in report.resolved)
        lines += [f"  {k:<{key_width}}  {v}" for k, v in report.resolved.items()]
    counts = {s: sum(c.status == s for c in report.checks) for s in (OK, WARN, FAIL)}
    verdict = "blocking problems: fix the FAIL lines before launching" if report.failed else "nothing blocks a launch"
    lines += ["", f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL: {verdict}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_flags = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Training flags (recipes/train.py --help) go after `--`."
    )
    p.add_argument("--config_file", help="The accelerate YAML of the launch (accelerate_configs/*.yaml).")
    p.add_argument("--deepspeed", help="A DeepSpeed JSON, as given to train.py under the deepspeed launcher/torchrun.")
    p.add_argument("--num_processes", type=int, help="World size (default: the YAML's num_processes, else GPUs or 1).")
    p.add_argument("--nvme_path", help="A directory for NVMe offload: free space and a measured write speed.")
    p.add_argument("--write_mb", type=int, default=64, help="MiB written by the NVMe write test.")
    p.add_argument(
        "--build-ops", "--build_ops", dest="build_ops", action="store_true",
        help=f"Compile (or load) the DeepSpeed ops launches use (GPUs: {', '.join(GPU_OPS)}; CPU ranks: "
        f"{', '.join(CPU_OPS)}): minutes the first time, cached in ~/.cache/torch_extensions.",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="Print the checks as JSON instead of a table.")
    p.add_argument("--show_ds_config", action="store_true", help="Also print the whole resolved DeepSpeed JSON.")
    args = p.parse_args(argv)
    args.train_flags = train_flags
    if args.num_processes is not None and args.num_processes < 1:
        p.error(f"--num_processes {args.num_processes} must be at least 1")
    if args.write_mb < 1:
        p.error(f"--write_mb {args.write_mb} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # the libraries' own prints: stdout is the table (or JSON)
        report = run_checks(args)
    if args.json:
        print(json.dumps({"checks": [c.__dict__ for c in report.checks], "resolved": report.resolved,
                          "deepspeed": report.deepspeed, "failed": report.failed}, indent=2, default=str))  # fmt: skip
    else:
        print(render(report))
        if args.show_ds_config and report.deepspeed is not None:
            print("\nresolved DeepSpeed JSON:\n" + json.dumps(report.deepspeed, indent=2))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
