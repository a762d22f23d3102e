"""DeepSpeed's C++ ops and torch's JIT build cache, checked before a launch needs them.

DeepSpeed compiles an op the first time a process loads it (minutes, printing nothing), caching it in torch's
extension directory (TORCH_EXTENSIONS_DIR; here `<virtualenv>/torch_extensions/<op>/` unless set:
`use_environment_op_cache`). While it compiles, torch holds
`<op>/lock`. Up to torch 2.13 every other process that loads the op waits for as long as that file exists: a build
killed midway (a rank killed by a timeout, a cut-off job) leaves it behind, and every later launch hangs silently.
From torch 2.14 the lock is an OS lock on that file, released when its holder dies: the file stays after every
build and blocks nothing (`training.compat.build_lock_blocks`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path

from training.compat import build_lock_blocks
from training.deepspeed_config import offload_devices

# The ops a launch of this project can JIT-compile: the optimizer (fused Adam on GPUs, CPU Adam under offload),
# async I/O for NVMe offload and, on CPU ranks, pinned buffers and shared-memory collectives.
GPU_OPS = ("fused_adam", "cpu_adam", "async_io")
CPU_OPS = ("cpu_adam", "async_io", "pin_memory", "deepspeed_shm_comm")
STALE_LOCK_S = 3600  # no op build takes an hour: an older lock file was left by a killed build


def use_environment_op_cache() -> None:
    """Keep DeepSpeed's compiled ops in this Python environment's own folder, `<virtualenv>/torch_extensions`, unless
    TORCH_EXTENSIONS_DIR says where. torch's default, ~/.cache/torch_extensions/<python>_<accelerator>/, is shared by
    every environment of one Python version: two checkouts, or a torch 2.11 and a torch 2.13 environment, would each
    rebuild the other's ops (minutes each time, an ABI mismatch if they did not). Outside a virtualenv, torch's
    default stays. Set before anything loads an op; the launched ranks inherit it."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")


def used_ops() -> tuple[str, ...]:
    """Every op a launch on this machine's accelerator may compile."""
    import torch

    return GPU_OPS if torch.cuda.is_available() else CPU_OPS


def launch_ops(ds: dict, on_gpu: bool) -> tuple[str, ...]:
    """The ops a launch with the resolved DeepSpeed config `ds` loads."""
    devices = offload_devices(ds)
    ops = []
    if on_gpu and "optimizer" in ds and devices["offload_optimizer"] == "none":
        ops.append("fused_adam")
    if devices["offload_optimizer"] != "none":
        ops.append("cpu_adam")
    if "nvme" in devices.values():
        ops.append("async_io")
    if not on_gpu:
        if set(devices.values()) != {"none"}:
            ops.append("pin_memory")
        ops.append("deepspeed_shm_comm")  # DeepSpeed's CPU accelerator loads it for its collectives
    return tuple(ops)


def build_dir(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def stale_lock(directory: Path) -> Path | None:
    """The lock file of an extension build that nobody is running any more, else None.

    torch's JIT build holds `<directory>/lock` while ninja compiles in that directory."""
    if not build_lock_blocks():  # torch >= 2.14: an OS lock, released when its holder dies; the file blocks nothing
        return None
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age >= STALE_LOCK_S:
        return lock
    if age < 60 or not Path("/proc").is_dir():  # just taken (ninja may not have started), or no way to look
        return None
    for cwd in Path("/proc").glob("[0-9]*/cwd"):  # ninja and the compiler run in the build directory
        with contextlib.suppress(OSError):
            if cwd.resolve() == directory.resolve():
                return None
    return lock


def left_by_killed_build(name: str, lock: Path) -> str:
    return f"{lock} was left by a killed build of DeepSpeed's {name} op; every rank that loads it would wait forever"


def arch_list_deepspeed_parses() -> None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it: torch accepts arch-specific entries ("9.0a", Hopper's
    wgmma; "10.0f"), which DeepSpeed 0.19.8's `compute_capability_args` parses as integers and fails on ("invalid
    literal for int() with base 10: '0a'") before building anything. Such an entry is set to its plain form for this
    process and the ranks it launches (the ops build the same, without arch-specific instructions), with one line
    saying so."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return
    entries = value.replace(";", " ").split()
    plain = [re.sub(r"^(\d+\.\d+)[af]", r"\1", e) for e in entries]  # "9.0a+PTX" -> "9.0+PTX"
    if plain != entries:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(plain)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node
            print(
                f"note: TORCH_CUDA_ARCH_LIST={value!r} read as {';'.join(plain)!r} for DeepSpeed's op builds "
                "(DeepSpeed parses no arch suffix)",
                file=sys.stderr,
            )


def op_build_environment() -> None:
    """The environment DeepSpeed's op builds read, set before anything loads an op (the launched ranks inherit it):
    this environment's cache (`use_environment_op_cache`) and an arch list DeepSpeed parses
    (`arch_list_deepspeed_parses`)."""
    use_environment_op_cache()
    arch_list_deepspeed_parses()


def check_op_cache(names: tuple[str, ...]) -> list[str]:
    """Refuse a launch that would wait forever on a lock left by a killed build; return the ops of `names`
    that are neither installed prebuilt nor in the JIT cache, i.e. that this launch will compile. The cache is this
    environment's (`op_build_environment`, set here first)."""
    from deepspeed.git_version_info import installed_ops

    op_build_environment()
    to_build = []
    for name in names:
        if installed_ops.get(name):
            continue
        directory = build_dir(name)
        lock = stale_lock(directory)
        if lock is not None:
            raise ValueError(f"{left_by_killed_build(name, lock)}: remove it (rm {lock}) and launch again")
        if not any(directory.glob(f"{name}*.so")):
            to_build.append(name)
    return to_build
