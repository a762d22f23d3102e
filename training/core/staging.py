"""--save_async's part before the step goes on: a rank's share of the state copied to host memory, and the writes
that put the copy on disk, for a thread to run (training/checkpoints/background.py). One process and DDP copy the
weights and AdamW's states (`host_copy`) and write accelerate's own files from the copy; FSDP2 and the pipelines hand
their state dicts to torch.distributed.checkpoint's `async_save` (`dcp_async_save`), which copies them
(`ReusedCopy`) and writes in a thread, its collectives on gloo groups of their own (`save_group`) so that they never
interleave with the step's. The small files every strategy writes alike (the random states, the schedule) are
written at once (`write_small_files`). Each copy is kept for the next save to write over: a fresh buffer's first
touch costs about 5x the copy itself.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from training.compat import copy_into_host


def host_copy(obj, into=None, memo: dict | None = None):
    """`obj` (a state dict, nested) with every tensor copied to host memory: what a later step changes in place is
    not in the copy. Tensors that share memory (tied weights) share it in the copy too, as safetensors expects.
    `into`: the previous save's copy, whose tensors of the same shape and type are written over rather than
    allocated again: a fresh buffer's first touch costs about 5x the copy itself (docs/checkpoints.md)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        if key not in memo:
            fits = isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype
            memo[key] = into.copy_(obj.detach()) if fits else obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return type(obj)((k, host_copy(v, into.get(k), memo)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        into = into if isinstance(into, list | tuple) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(host_copy(v, was, memo) for v, was in zip(obj, into, strict=True))
    return copy.deepcopy(obj)


def durable(files: list[Path]) -> None:
    """fsync every file of `files` that exists: the page cache's copy alone does not survive the machine."""
    for file in files:
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


_GROUPS: list = []


def save_group(index: int):
    """The `index`-th gloo process group that torch.distributed.checkpoint's background saves run their collectives
    on, made once (a collective: every rank makes it at its first asynchronous save), as torchtitan's async mode makes
    one. Each of a checkpoint's concurrent saves has its own: their collectives run in threads of their own."""
    import torch.distributed as dist

    while len(_GROUPS) <= index:
        _GROUPS.append(dist.new_group(backend="gloo"))  # collective
    return _GROUPS[index]


def write_small_files(accelerator, scheduler, path: Path) -> list[Path]:
    """The files every strategy writes alike, by accelerate's own writer as its save_state calls it: this rank's
    random states (taken now: the step goes on), rank 0's schedule (and loss scaler). Returns them."""
    from accelerate.checkpointing import save_accelerator_state

    path.mkdir(parents=True, exist_ok=True)
    each_node = accelerator.project_configuration.save_on_each_node
    save_accelerator_state(str(path), [], [], [scheduler], [], accelerator.process_index, accelerator.step,
                           accelerator.scaler, save_on_each_node=each_node)  # fmt: skip
    return [path / f"random_states_{accelerator.process_index}.pkl", path / "scheduler.bin", path / "scaler.pt"]


class ReusedCopy:
    """torch.distributed.checkpoint's stager (its `AsyncStager` protocol) that copies a state dict into the host
    buffers of the previous save, DTensors and all, with DCP's own helpers, as its writer's
    `cache_staged_state_dict` does, which pins its buffers and so needs a GPU; here pinned only where one is."""

    _synchronize_after_execute = False  # the copy is complete when `stage` returns

    def __init__(self):
        self.copy = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict:
        self.copy = copy_into_host(state_dict, self.copy)
        return self.copy

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def dcp_async_save(accelerator, scheduler, path: Path, weights: dict, moments: dict, staged: dict) -> list:
    """This rank's share of the weights and AdamW's states as accelerate's FSDP folders and keys
    (`pytorch_model_fsdp_0` {"model"}, `optimizer_0` {"optimizer"}) by torch.distributed.checkpoint's `async_save`:
    copied to host memory now (`ReusedCopy`), written by DCP's threads (fsynced, its collectives on `save_group`'s).
    Each folder's writer and copy are kept in `staged` for the next save. Returns the waits for them."""
    from functools import partial

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    small = write_small_files(accelerator, scheduler, path)
    waits = []
    for index, (folder, key, state) in enumerate((("pytorch_model_fsdp_0", "model", weights),
                                                  ("optimizer_0", "optimizer", moments))):  # fmt: skip
        writer = staged.setdefault(folder, FileSystemWriter(path / folder))
        stager = staged.setdefault(f"{folder} copy", ReusedCopy())
        # collective: DCP's plan, on a group of its own; the copy now, the files in DCP's thread
        saving = dcp.async_save({key: state}, checkpoint_id=path / folder, storage_writer=writer,
                                process_group=save_group(index), async_stager=stager)  # fmt: skip
        waits.append(saving.result)
    return [*waits, partial(durable, small)]


def sharded_only(strategy) -> str | None:
    """Why an FSDP2 launch cannot save in the background (its accelerate config asks for whole state dicts), or
    None."""
    kind = strategy.fsdp_env.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").upper()
    if kind == "SHARDED_STATE_DICT":
        return None
    return (f"--save_async with fsdp_state_dict_type: {kind}: the background save writes FSDP2's sharded folders; "
            "set fsdp_state_dict_type: SHARDED_STATE_DICT in the accelerate config, or drop --save_async")  # fmt: skip


def fsdp2_async_save(accelerator, net, optimizer, scheduler, path: Path, staged: dict) -> list:
    """FSDP2's background save: accelerate's folders and keys (`pytorch_model_fsdp_0` {"model"}, `optimizer_0`
    {"optimizer"}, as its save_fsdp_model and save_fsdp_optimizer write them) from this rank's shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from training.core.wrapped import uncompiled

    model = uncompiled(net)  # this rank's shards (DTensors), as accelerate's save_fsdp_model takes them
    weights, moments = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    return dcp_async_save(accelerator, scheduler, path, weights, moments, staged)
