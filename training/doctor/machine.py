"""Checks of the machine alone: versions, GPUs, process groups, bf16, DeepSpeed's ops, libaio,
pinned memory, and an NVMe path's free space and write speed.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import io
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from training.core.ops import (
    build_dir,
    check_op_cache,
    left_by_killed_build,
    op_build_environment,
    stale_lock,
    used_ops,
)
from training.doctor.report import FAIL, NA, OK, WARN, Report, size

SLOW_DISK_MBPS = 500  # below this, NVMe offload's swapping dominates the step (a local NVMe writes > 1 GB/s)


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

    op_build_environment()  # into this environment's cache, where its launches look
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
