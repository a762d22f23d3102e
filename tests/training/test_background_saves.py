"""--save_async's pieces in one process: the copy a step waits for, the writer thread's outcome on rank 0, and the
launches refused in one line. Launched saves (every family's files equal to a synchronous save's, a kill during the
background write) are tests/recipes/test_faults.py's."""

import errno
import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

from training.checkpoints.background import WRITTEN, BackgroundSaves
from training.config import RunConfig
from training.core.staging import host_copy
from training.launch import resolve_launch

ROOT = Path(__file__).resolve().parents[2]


def test_the_copy_is_the_state_of_the_moment_and_keeps_tied_weights_tied():
    """What a later step changes in place is not in the copy; tensors sharing memory (tied embeddings) share it in
    the copy, as safetensors' writer expects of accelerate's state dict; the containers' types are kept."""
    embedding = torch.arange(6.0).reshape(3, 2)
    state = OrderedDict(embed=embedding, head=embedding.view(3, 2), step=torch.tensor(4.0))
    optimizer = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    weights, moments = host_copy(state), host_copy(optimizer)
    embedding.add_(100.0)
    optimizer["state"][0]["exp_avg"].mul_(7.0)
    optimizer["param_groups"][0]["lr"] = 0.5
    assert type(weights) is OrderedDict and list(weights) == ["embed", "head", "step"]
    assert torch.equal(weights["embed"], torch.arange(6.0).reshape(3, 2))
    assert weights["embed"].data_ptr() == weights["head"].data_ptr()  # one storage, as in the model
    assert weights["embed"].data_ptr() != embedding.data_ptr()
    assert torch.equal(moments["state"][0]["exp_avg"], torch.ones(3)) and moments["param_groups"][0]["lr"] == 1e-3


def test_rank_0_completes_the_checkpoint_only_after_every_rank_has_written(tmp_path):
    """Rank 0's thread waits for every rank's `.written-<rank>` before `finish` (the marker); the files are gone
    from the checkpoint by then, so the marker does not list them."""
    path = tmp_path / "checkpoint-4"
    path.mkdir()
    finished = []
    saves = BackgroundSaves(rank=0, world=2)
    saves.start(path, [lambda: (path / "weights").write_bytes(b"x")], lambda: finished.append(sorted(path.iterdir())))
    saves.thread.join(timeout=0.5)
    assert saves.thread.is_alive() and not finished  # rank 1 has not written yet
    (path / WRITTEN.format(rank=1)).write_text(json.dumps({"ok": True}))
    assert saves.wait() is None
    assert finished == [[path / "weights"]]


@pytest.mark.parametrize(
    "error, code",
    [(OSError(errno.ENOSPC, "No space left on device"), 2), (RuntimeError("the writer broke"), 1)],
    ids=["disk full", "another error"],
)
def test_a_failed_background_write_removes_the_partial_checkpoint_and_is_reported(tmp_path, error, code):
    """A write that fails (a full disk, or anything else) leaves no marker: rank 0 removes the partial checkpoint
    and `wait` returns the failure, kind and reason, for the collective that raises it on every rank."""
    path = tmp_path / "checkpoint-4"
    path.mkdir()
    finished = []

    def fail():
        raise error

    saves = BackgroundSaves(rank=0, world=1)
    saves.start(path, [fail], lambda: finished.append(True))
    failure = saves.wait()
    assert failure is not None and failure[0] == code and failure[1].startswith("rank 0: ")
    assert str(error).splitlines()[0] in failure[1]
    assert not path.exists() and not finished
    assert saves.wait() is None  # reported once


ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ROOT / "ds_configs/zero3.json")}
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}


@pytest.mark.parametrize(
    "variables, refusal",
    [
        (ZERO3, "--save_async under zero3: DeepSpeed's own background writer (checkpoint.writer.decoupled)"),
        ({**FSDP, "FSDP_VERSION": "1"}, "--save_async with fsdp_version: 1"),
        ({**FSDP, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, "--save_async with fsdp_state_dict_type: FULL_STATE"),
        ({}, None),
        (FSDP, None),
    ],
    ids=["zero3", "fsdp1", "fsdp2-full", "ddp", "fsdp2"],
)
def test_save_async_where_it_cannot_run_is_refused_in_one_line(monkeypatch, variables, refusal):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    (parsed,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(
        args=["--save_async", "--output_dir", "/nonexistent/shardgpt-test"]
    )
    if refusal is None:
        assert resolve_launch(parsed).cfg.save_async
        return
    with pytest.raises(ValueError) as err:
        resolve_launch(parsed)
    assert str(err.value).startswith(refusal) and "\n" not in str(err.value), str(err.value)


def test_the_next_copy_writes_over_the_previous_one():
    """A save's copy is written into the previous save's buffers (already in memory: no first-touch cost), and holds
    the new values; a tensor whose shape changed gets a buffer of its own."""
    state = {"w": torch.zeros(4), "b": torch.zeros(2)}
    first = host_copy(state)
    state["w"].add_(1.0)
    state["b"] = torch.ones(3)
    second = host_copy(state, first)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], torch.ones(4))
    assert second["b"].shape == (3,) and torch.equal(second["b"], torch.ones(3))


def test_the_trainer_path_refuses_save_async_in_one_line(tmp_path, monkeypatch):
    """The HF Trainer saves its checkpoints itself: --save_async there would do nothing, so it is refused."""
    from recipes.trainer import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="^--save_async needs recipes/train.py: the Trainer saves its checkpoints"):
        main(["--save_async", "--output_dir", str(tmp_path / "out")])


def test_a_disk_the_background_writes_filled_still_takes_their_status(tmp_path):
    """The writes fill the disk (ENOSPC): the rank's status, made at its full size before they started
    (`reserve`), is still written in place, so rank 0 learns of the failure, removes the partial checkpoint and
    reports a full disk, rather than waiting for a status that could not be written."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.decode().strip()}")
    try:
        path = disk / "checkpoint-4"
        path.mkdir()

        def fill():
            with open(path / "optimizer.bin", "wb") as f:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()

        saves = BackgroundSaves(rank=0, world=1)
        saves.reserve(path)
        saves.start(path, [fill], lambda: None)
        failure = saves.wait()
        assert failure is not None and failure[0] == 2 and "No space left" in failure[1], failure
        assert not path.exists()
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
