"""Which DeepSpeed ops a launch compiles, and the lock a killed build leaves behind (training/core/ops.py)."""

from __future__ import annotations

import json
import os
import time

import pytest
from launching import ROOT

from training.compat import build_lock_blocks
from training.core.ops import arch_list_deepspeed_parses, check_op_cache, launch_ops


def ds_config(name: str) -> dict:
    return json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())


@pytest.mark.parametrize(
    ("name", "on_gpu", "expected"),
    [
        ("zero1", False, ("deepspeed_shm_comm",)),
        ("zero3", False, ("deepspeed_shm_comm",)),
        ("zero2_offload", False, ("cpu_adam", "pin_memory", "deepspeed_shm_comm")),
        ("zero3_offload_nvme", False, ("cpu_adam", "async_io", "pin_memory", "deepspeed_shm_comm")),
        ("zero3_offload_nvme", True, ("cpu_adam", "async_io")),
        ("zero3_offload_cpu", True, ("cpu_adam",)),
    ],
)
def test_launch_ops_follow_the_offload_settings(name, on_gpu, expected):
    assert launch_ops(ds_config(name), on_gpu) == expected


def test_fused_adam_is_compiled_only_for_a_deepspeed_optimizer_on_gpus():
    assert launch_ops({"optimizer": {"type": "AdamW"}}, on_gpu=True) == ("fused_adam",)
    assert launch_ops({}, on_gpu=True) == ()  # the script's own torch AdamW


def test_the_op_cache_says_what_compiles_and_refuses_a_stale_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert check_op_cache(("cpu_adam", "async_io")) == ["cpu_adam", "async_io"]  # nothing built yet

    (tmp_path / "cpu_adam").mkdir(exist_ok=True)  # torch made it when asked for the build directory
    (tmp_path / "cpu_adam" / "cpu_adam.so").touch()
    assert check_op_cache(("cpu_adam", "async_io")) == ["async_io"]

    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir(exist_ok=True)
    lock.touch()
    assert check_op_cache(("async_io",)) == ["async_io"]  # just taken: a build may be starting
    old = time.time() - 2 * 3600
    os.utime(lock, (old, old))
    if build_lock_blocks():  # torch <= 2.13: the file itself is the lock, and nobody will remove it
        with pytest.raises(ValueError, match=f"rm {lock}"):
            check_op_cache(("cpu_adam", "async_io"))
    else:  # torch >= 2.14: an OS lock on the file, released by a killed build; the file left behind blocks nothing
        assert check_op_cache(("cpu_adam", "async_io")) == ["async_io"]


@pytest.mark.parametrize("arch_list", ["9.0a", "8.0;9.0a+PTX", "10.0f 12.0"])
def test_an_arch_specific_cuda_arch_list_is_read_plain_for_deepspeed(arch_list, monkeypatch, capsys):
    """torch takes arch-specific TORCH_CUDA_ARCH_LIST entries ("9.0a"); DeepSpeed's op builder fails on them before
    building. Set to their plain form, DeepSpeed's own parser reads them (as a JIT build does on a GPU)."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    def parse():
        builder = AsyncIOBuilder()
        builder.jit_mode = True
        return builder.compute_capability_args()

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    with pytest.raises(ValueError, match="invalid literal for int"):
        parse()  # fails before it rewrites the variable
    arch_list_deepspeed_parses()
    assert "a" not in os.environ["TORCH_CUDA_ARCH_LIST"] and "f" not in os.environ["TORCH_CUDA_ARCH_LIST"]
    assert arch_list in capsys.readouterr().err
    assert parse() == []  # jit mode: torch makes the -gencode flags from the variable
