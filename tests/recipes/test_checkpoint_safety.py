"""No checkpoint runs code: a file of each family's checkpoint swapped for one that runs a command when unpickled,
its completion marker rewritten with the new sizes and checksums, is refused before anything loads it, naming the
file and the callable; the command never runs. The payload is live: unpickled as DeepSpeed and DCP read it, it runs.
A resume that would lose a random state, the schedule or the data position says so, in one line, and stops.

Every checkpoint the suite writes passes the same check (tests/launching.py checks each launch's new checkpoints)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil

import pytest
import torch
from launching import launch
from parity import cell_run
from test_convert import TRAIN, command, source_run

from training.checkpoints.checkpoint import MARKER, check_resume, manifest, resolve_resume
from training.checkpoints.exact import InexactResumeError, check_resumable
from training.checkpoints.safety import ALLOWED, UnsafeCheckpointError, check_checkpoint, findings
from training.config import RunConfig
from training.strategy import Strategy

CALLABLE = f"{os.system.__module__}.system"  # posix.system: what the payload names


class Payload:
    """Unpickled, it runs `touch <marker>`: what a swapped checkpoint file carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def swap(file, marker, zip_format: bool = True) -> None:
    """Replace `file` by one that runs the payload when unpickled: a torch.save zip (as the file was), or a plain
    pickle (a torch.distributed.checkpoint `.metadata`)."""
    if zip_format:
        torch.save({"state": Payload(marker)}, file)
    else:
        file.write_bytes(pickle.dumps(Payload(marker), protocol=2))


def rewrite_marker(checkpoint) -> None:
    """The completion marker recomputed over the swapped files: whoever can swap a file can rewrite it."""
    step = json.loads((checkpoint / MARKER).read_text())["step"]
    (checkpoint / MARKER).write_text(json.dumps({"step": step, "files": manifest(checkpoint)}))


def copy_checkpoint(source, tmp_path, step: int = 3):
    out = tmp_path / "run"
    shutil.copytree(source.output_dir / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out, out / f"checkpoint-{step}"


def zero_file(checkpoint, name: str):
    return checkpoint / (checkpoint / "latest").read_text().strip() / name


def swap_dcp_item(checkpoint, folder: str, marker) -> str:
    """Point one non-tensor entry of a torch.distributed.checkpoint folder at a payload appended to its shard (DCP
    unpickles such entries with weights_only=False); returns how the check names it."""
    path = checkpoint / folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    index = next(i for i in metadata.storage_data if "param_groups" in i.fqn)
    info = metadata.storage_data[index]
    shard = path.parent / info.relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    path.write_bytes(pickle.dumps(metadata))
    return f"{shard} ({index.fqn})"


# The source run (tests/recipes/test_convert.py), the file swapped, its format, the strategy and flags of the resume.
FAMILIES = [
    pytest.param("ddp@1", "optimizer.bin", True, ("ddp", 1), [], id="one-process"),
    # DDP on 2 ranks: tests/recipes/parity.py's DDP cell (checkpoints every 5 steps), its second rank's random states
    pytest.param("ddp-cell", "random_states_1.pkl", True, ("ddp", 2), [], id="ddp"),
    pytest.param("fsdp@2", "optimizer_0/.metadata", False, ("fsdp", 2), [], id="fsdp2"),
    pytest.param("zero2@2", "zero:mp_rank_00_model_states.pt", True, ("zero2", 2), [], id="zero2"),
    pytest.param("zero3@2", "zero:zero_pp_rank_1_mp_rank_00_optim_states.pt", True, ("zero3", 2), [], id="zero3"),
    pytest.param(
        "pp2@2", "pytorch_model_fsdp_0/.metadata", False, ("ddp", 2), ["--pipeline_parallel_degree=2"], id="pipeline"
    ),  # fmt: skip
    # resumed under DDP on 2 ranks, the one-process checkpoint converts: its neutral form, as if converted before
    pytest.param("ddp@1", "neutral.pt", True, ("ddp", 2), ["--per_device_train_batch_size=2"], id="conversion"),
]


def resume_config(out, flags=()) -> RunConfig:
    fields = {"per_device_train_batch_size": 4, "output_dir": str(out), "resume_from_checkpoint": "auto"}
    for flag in flags:
        key, _, value = flag.removeprefix("--").partition("=")
        fields[key] = int(value)
    return RunConfig(**fields)


@pytest.mark.slow
@pytest.mark.multiproc  # the sources are 2-rank launches
@pytest.mark.parametrize(("source", "file", "zip_format", "target", "flags"), FAMILIES)
def test_a_swapped_file_is_refused_before_anything_loads(
    source, file, zip_format, target, flags, corpus, tmp_path, tmp_path_factory
):  # fmt: skip
    if source == "ddp-cell":
        out, checkpoint = copy_checkpoint(cell_run("accelerate", "ddp", corpus, tmp_path_factory), tmp_path, step=5)
    else:
        out, checkpoint = copy_checkpoint(source_run(source, corpus, tmp_path_factory), tmp_path)
    assert not list(findings_outside_allowed(checkpoint)), "the source checkpoint passes the check"
    swapped = zero_file(checkpoint, file.removeprefix("zero:")) if file.startswith("zero:") else checkpoint / file
    marker = tmp_path / "the-command-ran"
    swap(swapped, marker, zip_format)
    rewrite_marker(checkpoint)
    cfg = resume_config(out, flags)
    strategy = Strategy.from_name(*target)
    for check in (lambda: check_resume(cfg, strategy), lambda: check_resumable(resolve_resume("auto", str(out)))):
        with pytest.raises(UnsafeCheckpointError) as refused:
            check()  # before the process group, on every rank; then rank 0's pick after it
        message = str(refused.value)
        assert f"{swapped} names {CALLABLE}" in message and "--trust_checkpoint" in message, message
        assert "\n" not in message
    assert not marker.exists()
    # The payload is live: unpickled as DeepSpeed reads its files (and DCP its .metadata), it runs.
    if zip_format:
        torch.load(swapped, weights_only=False)
    else:
        pickle.loads(swapped.read_bytes())
    assert marker.exists()


def findings_outside_allowed(checkpoint):
    return [(where, sorted(found - ALLOWED.keys())) for where, found in findings(checkpoint) if found - ALLOWED.keys()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_entry_of_a_dcp_shard_is_refused(corpus, tmp_path, tmp_path_factory):
    """The entries DCP unpickles from inside an FSDP2 shard (the optimizer's groups) are read too, through the
    `.metadata` that says where they lie."""
    out, checkpoint = copy_checkpoint(source_run("fsdp@2", corpus, tmp_path_factory), tmp_path)
    marker = tmp_path / "the-command-ran"
    where = swap_dcp_item(checkpoint, "optimizer_0", marker)
    rewrite_marker(checkpoint)
    with pytest.raises(UnsafeCheckpointError) as refused:
        check_resume(resume_config(out), Strategy.from_name("fsdp", 2))
    assert f"{where} names {CALLABLE}" in str(refused.value)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("source", "file", "config", "flags"),
    [
        # DeepSpeed reads its engine's files with weights_only=False: the ZeRO-2 resume under ZeRO-2
        ("zero2@2", "zero:mp_rank_00_model_states.pt", "zero2", []),
        # a one-process checkpoint resumed under DDP on 2 ranks: the project's conversion reads it
        ("ddp@1", "optimizer.bin", "ddp", ["--per_device_train_batch_size=2", "--global_batch_size=4"]),
    ],
    ids=["zero2", "one-process-to-ddp"],
)
def test_a_launch_refuses_a_swapped_checkpoint(source, file, config, flags, corpus, tmp_path, tmp_path_factory):
    out, checkpoint = copy_checkpoint(source_run(source, corpus, tmp_path_factory), tmp_path)
    swapped = zero_file(checkpoint, file.removeprefix("zero:")) if file.startswith("zero:") else checkpoint / file
    marker = tmp_path / "the-command-ran"
    swap(swapped, marker)
    rewrite_marker(checkpoint)
    before = {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")}
    run = launch(command(config, 2), [*corpus["flags"], *TRAIN, *flags, "--resume_from_checkpoint=auto"], out,
                 check=False)  # fmt: skip
    assert run.returncode != 0, run.stderr[-3000:]  # the ranks exit 2, accelerate launch 1
    assert f"error: --resume_from_checkpoint: {swapped} names {CALLABLE}" in run.stderr
    assert "strategy in force" not in run.stderr  # refused before the process group and the model
    assert not marker.exists()
    assert {p: p.stat().st_mtime_ns for p in checkpoint.rglob("*")} == before  # nothing saved was touched


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_family_s_checkpoint_passes(corpus, tmp_path_factory):
    """The checkpoints of the suite's standard runs (and their sources), each strategy family's, pass the check
    and the exactness check; tests/launching.py checks every other launch's."""
    runs = [source_run(name, corpus, tmp_path_factory) for name in ("ddp@1", "fsdp@2", "zero2@2", "zero3@2", "pp2@2")]
    runs.append(cell_run("accelerate", "ddp", corpus, tmp_path_factory))
    for run in runs:
        for checkpoint in sorted(run.output_dir.glob("checkpoint-*")):
            check_resumable(checkpoint)
            assert not findings_outside_allowed(checkpoint)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_resume_that_would_lose_state_is_refused(corpus, tmp_path, tmp_path_factory, caplog):
    out, checkpoint = copy_checkpoint(source_run("ddp@1", corpus, tmp_path_factory), tmp_path)
    cfg, strategy = resume_config(out), Strategy.from_name("ddp", 1)
    states = checkpoint / "random_states_0.pkl"
    states.write_bytes(b"not a pickle")  # unreadable, the marker intact: accelerate would skip it with an info line
    rewrite_marker(checkpoint)
    with pytest.raises(InexactResumeError, match=f"{states} cannot be read .* pass --resume_inexact"):
        check_resume(cfg, strategy)
    check_resume(dataclasses.replace(cfg, resume_inexact=True), strategy)  # --resume_inexact: said, and resumed
    check_resumable(checkpoint, inexact=True)
    assert f"resuming inexactly (--resume_inexact): {states} cannot be read" in caplog.text
    states.unlink()
    rewrite_marker(checkpoint)
    with pytest.raises(InexactResumeError, match=f"{states} is missing"):
        check_resume(cfg, strategy)
    torch.save({"random_state": None}, states)
    rewrite_marker(checkpoint)
    with pytest.raises(InexactResumeError, match=f"{states} holds no numpy_random_seed"):
        check_resume(cfg, strategy)
    (checkpoint / "scheduler.bin").unlink()
    rewrite_marker(checkpoint)
    with pytest.raises(InexactResumeError, match="scheduler.bin is missing: the learning-rate schedule"):
        check_resume(dataclasses.replace(cfg, resume_inexact=True), strategy)  # never lost silently


@pytest.mark.slow
@pytest.mark.multiproc
def test_model_name_or_path_and_convert_inputs_are_checked(corpus, tmp_path, tmp_path_factory, caplog):
    from recipes.convert_checkpoint import main as convert

    folder = tmp_path / "start"
    folder.mkdir()
    marker = tmp_path / "the-command-ran"
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    swap(folder / "pytorch_model.bin", marker)
    with pytest.raises(UnsafeCheckpointError, match=f"--model_name_or_path: {folder / 'pytorch_model.bin'} names"):
        RunConfig(model_name_or_path=str(folder), output_dir=str(tmp_path / "out")).validate(1)
    _, checkpoint = copy_checkpoint(source_run("zero2@2", corpus, tmp_path_factory), tmp_path)
    swap(zero_file(checkpoint, "mp_rank_00_model_states.pt"), marker)
    rewrite_marker(checkpoint)
    assert convert([str(checkpoint), str(tmp_path / "hf")]) == 2
    assert not marker.exists() and not (tmp_path / "hf").exists()
    check_checkpoint(checkpoint, trust=True)  # --trust_checkpoint: skipped, said in one line
    assert "not checked for code its pickles could run (--trust_checkpoint)" in caplog.text


def test_the_allowlist_says_why_for_each_global():
    assert all(isinstance(why, str) and len(why) > 10 for why in ALLOWED.values())
    assert CALLABLE not in ALLOWED and "builtins.eval" not in ALLOWED and "builtins.getattr" not in ALLOWED


def test_the_allowlist_is_documented():
    from launching import ROOT

    text = (ROOT / "docs" / "checkpoints.md").read_text()
    section = text[text.index("## What a resume checks") : text.index("### A resume is exact")]
    missing = [name for name in ALLOWED if name.rpartition(".")[2] not in section]
    assert not missing, f"docs/checkpoints.md does not list {missing}"


def test_a_pickle_s_globals_are_read_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps({"a": [Payload(marker)], "b": io.BytesIO}, protocol=protocol)
        file = tmp_path / f"p{protocol}.pkl"
        file.write_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match=f"names {CALLABLE}|names _io.BytesIO"):
            check_checkpoint(file)
    assert not marker.exists()
