"""Faults a cluster throws: a preemption signal saves the run, a full disk says so, a damaged checkpoint is refused.

The unit tests drive the checkpoint marker's verification and the preemption plumbing directly; the launched tests
(2 CPU ranks, `debug` preset, a few seconds each) signal, fill and damage real runs of every strategy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launching import BIN, ROOT, Run, free_port, launch, launcher_command
from parity import cell_args, cell_run
from safetensors.torch import load_file

from training.checkpoints.checkpoint import (
    BYTES_PER_PARAMETER,
    MARGIN,
    MARKER,
    STATE,
    damage,
    expected_size,
    latest_checkpoint,
    manifest,
    resolve_resume,
)
from training.core.ranks import PREEMPTED, Preempted, run_rank
from training.loop.preemption import SIGNALS, PreemptionWatch

STEPS = 12
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4", "--save_total_limit=5",
]  # fmt: skip
LAUNCH_TIMEOUT = 300
STOP_LINE = re.compile(r"preempted by (SIG\w+) after step (\d+): saved (\S+); run the same command with")


# ---------------------------------------------------------------------- helpers


def write_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """A checkpoint directory as save_checkpoint leaves it: the files, the trainer state, the marker last."""
    path = root / f"checkpoint-{step}"
    for name, data in {**files, STATE: json.dumps({"step": step}).encode()}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    (path / MARKER).write_text(json.dumps({"step": step, "files": manifest(path)}))
    return path


def truncate(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def flip_byte(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


def assert_damage_is_caught(checkpoint: Path, shard: str, tmp_path: Path) -> None:
    """Truncating, or flipping one byte of, `shard` (relative to the checkpoint) makes a resume refuse the
    checkpoint naming that file; the intact original passes."""
    assert damage(checkpoint) is None
    assert shard in json.loads((checkpoint / MARKER).read_text())["files"], "the marker must list every rank's shard"
    for hurt, what in ((truncate, "bytes"), (flip_byte, "CRC-32")):
        copy = tmp_path / hurt.__name__ / checkpoint.name
        shutil.copytree(checkpoint, copy)
        hurt(copy / shard)
        assert what in damage(copy) and str(copy / shard) in damage(copy)
        with pytest.raises(ValueError, match=rf"is damaged: {re.escape(str(copy / shard))} "):
            resolve_resume(str(copy), str(copy.parent))
    # Sizes only (--skip_checkpoint_checksum): the flipped byte goes unseen, the truncation does not.
    assert damage(tmp_path / "flip_byte" / checkpoint.name, checksums=False) is None
    assert damage(tmp_path / "truncate" / checkpoint.name, checksums=False) is not None


def stop_line(run) -> tuple[str, int, Path]:
    """The one preemption line of a run (rank 0's): the signal, the step and the checkpoint."""
    lines = STOP_LINE.findall(run.stderr)
    assert len(lines) == 1, f"expected one preemption line:\n{run.stderr[-4000:]}"
    sig, step, path = lines[0]
    return sig, int(step), Path(path)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_resumes_to_the_same_run(cmd, args, out: Path, straight, resumed_from: int) -> None:
    """A relaunch with --resume_from_checkpoint auto gives bitwise the straight run's later losses and weights."""
    resumed = launch(cmd, [*args, "--resume_from_checkpoint=auto"], out, timeout=LAUNCH_TIMEOUT)
    again = resumed.own_losses  # this run's records alone: a step it failed to log cannot pass
    assert again == {s: straight.losses[s] for s in range(resumed_from + 1, max(straight.losses) + 1)}
    final, expected = final_weights(out), final_weights(straight.output_dir)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


# ---------------------------------------------------------------------- integrity (unit)


def test_marker_records_size_and_checksum_of_every_file(tmp_path):
    path = write_checkpoint(tmp_path, 5, {"model.safetensors": b"w" * 100, "pytorch_model/zero_pp_rank_1.pt": b"s"})
    files = json.loads((path / MARKER).read_text())["files"]
    assert sorted(files) == ["model.safetensors", "pytorch_model/zero_pp_rank_1.pt", STATE]
    assert files["model.safetensors"]["size"] == 100
    assert re.fullmatch(r"[0-9a-f]{8}", files["model.safetensors"]["crc32"])


@pytest.mark.parametrize("hurt", [truncate, flip_byte, lambda f: f.unlink()], ids=["truncate", "flip", "missing"])
def test_damaged_file_is_refused_naming_it(hurt, tmp_path):
    path = write_checkpoint(tmp_path, 5, {"optimizer.bin": bytes(range(256)) * 64, "scheduler.bin": b"s" * 10})
    hurt(path / "optimizer.bin")
    with pytest.raises(ValueError, match=r"checkpoint-5' is damaged: .*optimizer\.bin (is|has)"):
        resolve_resume(str(path), str(tmp_path))


def test_unreadable_marker_is_damage(tmp_path):
    path = write_checkpoint(tmp_path, 5, {"optimizer.bin": b"o"})
    (path / MARKER).write_text('{"step": 5, "fi')  # cut by a bad copy
    with pytest.raises(ValueError, match=rf"is damaged: {re.escape(str(path / MARKER))} is not valid JSON"):
        resolve_resume(str(path), str(tmp_path))


def test_auto_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    for step in (5, 10, 15):
        write_checkpoint(tmp_path, step, {"optimizer.bin": bytes([step]) * 1000})
    flip_byte(tmp_path / "checkpoint-15" / "optimizer.bin")
    truncate(tmp_path / "checkpoint-10" / "optimizer.bin")
    assert resolve_resume("auto", str(tmp_path)) == tmp_path / "checkpoint-5"
    assert "skipping damaged checkpoint" in caplog.text and "checkpoint-15/optimizer.bin has CRC-32" in caplog.text
    truncate(tmp_path / "checkpoint-5" / "optimizer.bin")
    with pytest.raises(ValueError, match="every complete checkpoint in .* is damaged"):
        resolve_resume("auto", str(tmp_path))


def test_marker_without_file_records_is_resumed_unverified(tmp_path, caplog):
    path = write_checkpoint(tmp_path, 5, {"optimizer.bin": b"o"})
    (path / MARKER).write_text(json.dumps({"step": 5}))  # the marker's format before files were recorded
    assert resolve_resume("auto", str(tmp_path)) == path and "not verified" in caplog.text


def test_expected_checkpoint_size(tmp_path):
    assert expected_size(tmp_path, 1000) == BYTES_PER_PARAMETER * 1000 + MARGIN  # nothing saved yet: the estimate
    write_checkpoint(tmp_path, 5, {"optimizer.bin": b"o" * 5000})
    (tmp_path / "checkpoint-10").mkdir()  # an incomplete one is not a measure
    on_disk = sum(f.stat().st_size for f in (tmp_path / "checkpoint-5").iterdir() if f.name != MARKER)
    assert expected_size(tmp_path, 1000) == on_disk + MARGIN


# ---------------------------------------------------------------------- preemption (unit)


def test_a_signal_is_recorded_not_fatal_and_agreed_on():
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        watch = PreemptionWatch()
        assert watch.agreed(torch.device("cpu")) is None
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGTERM)  # a second signal changes nothing: the first names the stop
        assert watch.agreed(torch.device("cpu")) == signal.SIGUSR1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_preempted_run_exits_with_its_own_status(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)

    def main():
        raise Preempted("preempted by SIGTERM after step 3: saved out/checkpoint-3")

    with pytest.raises(SystemExit) as exit_:
        run_rank(main)
    assert exit_.value.code == PREEMPTED == 75
    assert capsys.readouterr().err == "preempted by SIGTERM after step 3: saved out/checkpoint-3\n"


# ---------------------------------------------------------------------- launched


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The uninterrupted DDP run every interrupted one must reproduce: tests/recipes/parity.py's DDP cell, 20 steps
    with checkpoints every 5."""
    return cell_run("accelerate", "ddp", corpus, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_to_the_launcher_saves_then_resume_is_exact(straight, corpus, tmp_path):
    """SIGTERM reaches `accelerate launch` after step 7 (sent by rank 0 to its parent, as a preemption sends it);
    the launcher forwards it; both ranks finish the step in flight, save a complete checkpoint and stop, one line
    names the signal and the checkpoint; the relaunch with auto ends bitwise where the straight run ended."""
    cmd = launcher_command("accelerate", "ddp")
    args = cell_args("accelerate", "ddp", corpus, tmp_path)  # the straight run's flags
    out = tmp_path / "out"
    stopped = launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env={"SHARDGPT_FAULT": "term_launcher@7"})
    sig, step, checkpoint = stop_line(stopped)
    assert sig == "SIGTERM" and 7 <= step < max(straight.losses) and checkpoint == out / f"checkpoint-{step}"
    # The launcher's own status: torch elastic re-raises the signal after its workers have ended.
    assert stopped.returncode != 0 and "SignalException" in stopped.stderr
    assert latest_checkpoint(out) == checkpoint and json.loads((checkpoint / STATE).read_text())["step"] == step
    assert max(stopped.losses) == step and not (out / "model.safetensors").exists()
    assert_resumes_to_the_same_run(cmd, args, out, straight, step)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "config, fault",
    [
        ("ddp", "kill@7"),
        ("ddp", "stall@7"),
        pytest.param("fsdp", "kill@7", marks=pytest.mark.matrix),
        pytest.param("zero3", "kill@7", marks=pytest.mark.matrix),
    ],
)
def test_a_lost_rank_is_restarted_and_resumes_by_itself(config, fault, corpus, tmp_path, tmp_path_factory):
    """`accelerate launch --max_restarts 1`, no --resume_from_checkpoint: after step 7, between the checkpoints of
    steps 5 and 10, rank 0 is SIGKILLed (`kill@7`), or the last rank freezes (`stall@7`: the step watchdog, here
    --step_timeout 8, ends every rank with status 124); torch elastic restarts both ranks, which form a new process
    group (the dead generation's keys in the agent's store no longer in the way: training/core/accelerator.py) and
    resume from checkpoint-5 by themselves. The launcher exits 0, every step is logged once, with the straight run's
    losses, the final weights are the straight run's bitwise, and metrics.jsonl records what the fault cost."""
    straight = cell_run("accelerate", config, corpus, tmp_path_factory)
    cmd = launcher_command("accelerate", config)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--max_restarts", "1"]
    out = tmp_path / "out"
    args = [*cell_args("accelerate", config, corpus, tmp_path), *(["--step_timeout=8"] if "stall" in fault else [])]
    run = launch(cmd, args, out, timeout=LAUNCH_TIMEOUT, env={"SHARDGPT_FAULT": fault})
    if "stall" in fault:  # the watchdog's report of the frozen rank, before the restart
        assert "error: step 7 made no progress for 8 s (--step_timeout)" in run.stderr
        assert re.search(r"rank 1: step 7 phase agree_on_stop, at training/faults.py:\d+ in maybe_stall", run.stderr)
    assert "restart 1 of the launcher's workers: resuming from the newest intact checkpoint" in run.stderr
    assert f"resumed from {out / 'checkpoint-5'} at step 5" in run.stderr
    steps = [r["step"] for r in run.records if "loss" in r]
    assert steps == sorted(straight.losses), steps  # each step once: the dead generation's 6 and 7 dropped
    assert run.losses == straight.losses
    weights, reference = load_file(out / "model.safetensors"), load_file(straight.output_dir / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)
    (cost,) = [r for r in run.records if "restart" in r]
    assert cost["step"] == 6 and cost["restart"] == 1 and cost["steps_recomputed"] == 2 and cost["fault_s"] > 0
    print(f"{config} {fault}: {cost['fault_s']} s from the last record before the fault to the first step after it")


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step(corpus, tmp_path):
    """Under torchrun and ZeRO-3, only the last rank gets SIGUSR1 (after step 4); rank 0 learns it through the
    per-step agreement, both save checkpoint-4 and exit with status 75. The marker covers rank 1's shards: cutting
    or altering one is caught."""
    cmd = [*launcher_command("torchrun"), "--deepspeed=ds_configs/zero3.json"]
    out = tmp_path / "out"
    args = [*corpus["flags"], *TRAIN, "--save_steps=0"]
    stopped = launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env={"SHARDGPT_FAULT": "usr1_last_rank@4"})
    assert stop_line(stopped) == ("SIGUSR1", 4, out / "checkpoint-4")
    assert len(re.findall(rf"exitcode\s*: {PREEMPTED} ", stopped.stderr)) == 2  # torchrun's report of both ranks
    assert_damage_is_caught(out / "checkpoint-4", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path)


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_path_preempted_then_resumed_is_exact(corpus, tmp_path):
    """The HF Trainer path under torchrun: SIGTERM to the launcher after step 5, the Trainer saves its checkpoint
    and stops; the relaunch with auto ends bitwise where an uninterrupted Trainer run ends."""
    cmd = launcher_command("torchrun", script="trainer.py")
    args = [*corpus["flags"], *TRAIN, "--save_steps=0"]
    straight = launch(cmd, args, tmp_path / "straight", timeout=LAUNCH_TIMEOUT)
    out = tmp_path / "out"
    stopped = launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env={"SHARDGPT_FAULT": "term_launcher@5"})
    sig, step, checkpoint = stop_line(stopped)
    assert sig == "SIGTERM" and 5 <= step < STEPS and checkpoint == out / f"checkpoint-{step}"
    assert (checkpoint / "trainer_state.json").is_file() and not (out / "model.safetensors").exists()
    assert_resumes_to_the_same_run(cmd, args, out, straight, step)


@pytest.mark.slow
@pytest.mark.multiproc
def test_damaged_newest_checkpoint_auto_resumes_from_the_one_before(straight, corpus, tmp_path):
    """One byte of the newest DDP checkpoint's optimizer state flipped after the save: a resume from it is refused
    in one line naming the file; `auto` warns, naming the file, resumes from the checkpoint before, and ends with
    the straight run's weights. Truncating or altering
    a file of either rank in the DDP checkpoint is caught."""
    assert_damage_is_caught(straight.output_dir / "checkpoint-10", "random_states_1.pkl", tmp_path / "ddp")
    out = tmp_path / "out"
    shutil.copytree(straight.output_dir, out)
    (out / "model.safetensors").unlink()
    flip_byte(out / "checkpoint-20" / "optimizer.bin")
    cmd = launcher_command("accelerate", "ddp")
    args = cell_args("accelerate", "ddp", corpus, tmp_path)  # the straight run's flags
    damaged = out / "checkpoint-20"
    refused = launch(cmd, [*args, f"--resume_from_checkpoint={damaged}"], out, check=False, timeout=LAUNCH_TIMEOUT)
    line = f"error: --resume_from_checkpoint '{damaged}' is damaged: {damaged / 'optimizer.bin'} has CRC-32"
    assert refused.returncode != 0 and refused.stderr.count(line) == 1  # one line, rank 0's, naming the file
    resumed = launch(cmd, [*args, "--resume_from_checkpoint=auto"], out, timeout=LAUNCH_TIMEOUT)
    assert f"skipping damaged checkpoint {damaged}: {damaged / 'optimizer.bin'} has CRC-32" in resumed.stderr
    assert f"resumed from {out / 'checkpoint-15'}" in resumed.stderr
    final, expected = final_weights(out), final_weights(straight.output_dir)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a tmpfs of a given size (mounting needs root, as the CI machine runs the suite)."""
    mounts = []

    def make(size: str) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs to fill (needs root): {done.stderr.decode().strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


@pytest.mark.slow
@pytest.mark.multiproc
def test_no_room_for_the_next_checkpoint_is_said_before_writing(corpus, small_disk):
    """FSDP on a 3.6 MB disk: checkpoint-2 (1.8 MB) fits, checkpoint-4 would not (the free space is below the size
    of checkpoint-2): every rank stops with the line naming the directory, the bytes and the fix, before anything
    is written; checkpoint-2 is intact. The marker covers rank 1's FSDP shard."""
    out = small_disk("3600k") / "out"
    args = [*corpus["flags"], *TRAIN, "--save_steps=2"]
    run = launch(launcher_command("accelerate", "fsdp"), args, out, check=False, timeout=LAUNCH_TIMEOUT)
    assert run.returncode != 0
    line = re.search(r"error: --output_dir '(.+)' has no space for checkpoint-4: it needs about ([\d,]+) bytes, "
                     r"([\d,]+) are free; .*--save_total_limit.*another --output_dir", run.stderr)  # fmt: skip
    assert line and line[1] == str(out), run.stderr[-4000:]
    assert run.stderr.count("error: --output_dir") == 1  # rank 0 says it for every rank
    assert re.search(r"^error: --output_dir", run.stderr, re.M), "the error line is glued to the progress bar"
    needed, free = (int(v.replace(",", "")) for v in line.groups()[1:])
    assert needed > free and needed == expected_size(out, 0)  # the size of checkpoint-2, as measured by its marker
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"] and latest_checkpoint(out)
    assert_damage_is_caught(out / "checkpoint-2", "pytorch_model_fsdp_0/__1_0.distcp", out.parent.parent / "fsdp")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_disk_filling_during_a_save_is_said_and_every_rank_exits(config, corpus, small_disk):
    """An 8 MB disk that another writer fills just as checkpoint-4 is being written (after the free-space check):
    the writes fail with ENOSPC (DDP: rank 0's; FSDP and ZeRO-3: every rank's shard), every rank learns it through
    the collective after the save and exits (no hang), one line says the disk is full; the partial checkpoint-4 is
    removed and checkpoint-2 is intact."""
    out = small_disk("8m") / "out"
    args = [*corpus["flags"], *TRAIN, "--save_steps=2"]
    cmd = launcher_command("accelerate", config)
    run = launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env={"SHARDGPT_FAULT": "fill_disk@4"})
    assert run.returncode != 0
    assert f"error: --output_dir '{out}' ran out of space while saving checkpoint-4: it needs about " in run.stderr
    assert run.stderr.count("error: --output_dir") == 1
    assert re.search(r"^error: --output_dir", run.stderr, re.M), "the error line is glued to the progress bar"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert latest_checkpoint(out) == out / "checkpoint-2" and max(run.losses) == 4


FAKE_SLURM = {
    # `scontrol show hostnames` names this machine; any other call (the requeue) is recorded.
    "scontrol": '[ "$1 $2" = "show hostnames" ] && echo localhost || echo "$@" >> "$FAKE_SLURM_LOG"\n',
    # srun without its options runs the one task here, in its place (as srun's task, it receives the signals).
    "srun": 'while [[ $1 == --* ]]; do shift; done\nexec "$@"\n',
}


@pytest.mark.slow
@pytest.mark.multiproc
def test_slurm_script_requeues_and_the_ranks_save_on_its_signal(corpus, tmp_path):
    """recipes/slurm/accelerate.sbatch on one node, with `srun` and `scontrol` replaced by stand-ins: SIGUSR1 to
    the batch script (what `--signal=B:USR1@300` sends before the time limit) requeues the job and makes both
    ranks save a complete checkpoint and stop; the script passes `--resume_from_checkpoint auto` for the rerun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "slurm.log"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_GPUS_ON_NODE": "2", "MAIN_PORT": str(free_port()), "FAKE_SLURM_LOG": str(log)}  # fmt: skip
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    args = [*corpus["flags"], *TRAIN, "--max_steps=5000", "--save_steps=0", "--output_dir", str(out)]
    script = ROOT / "recipes" / "slurm" / "accelerate.sbatch"
    job = subprocess.Popen(
        ["bash", str(script), str(ROOT / "accelerate_configs" / "ddp.yaml"), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert job.poll() is None and time.monotonic() < deadline, "the job ended or stalled before step 3"
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        _, stderr = job.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert log.read_text().split() == ["requeue", "4242"]
    assert "shardgpt: SIGUSR1 received: requeueing job 4242" in stderr
    sig, step, checkpoint = stop_line(Run(out, "", stderr, job.returncode))
    assert sig == "SIGTERM" and 3 <= step < 5000 and latest_checkpoint(out) == checkpoint
    assert json.loads((out / "run_config.json").read_text())["resume_from_checkpoint"] == "auto"
