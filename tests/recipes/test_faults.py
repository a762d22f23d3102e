"""Faults a cluster throws: a preemption signal saves the run, a full disk says so, a damaged checkpoint is refused.

The unit tests drive the checkpoint marker's verification and the preemption plumbing directly; the launched tests
(2 CPU ranks, `debug` preset, a few seconds each) signal, fill and damage real runs of every strategy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from launching import (
    BIN,
    ROOT,
    Run,
    build_deepspeed_ops,
    check_new_checkpoints,
    deepspeed_ops,
    free_port,
    launch,
    launch_env,
    launcher_command,
    log_launch,
)
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
from training.config import RunConfig
from training.core.ranks import PREEMPTED, Preempted, run_rank
from training.launch import keep_global_batch
from training.loop.preemption import SIGNALS, PreemptionWatch

STEPS = 12
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4", "--save_total_limit=5",
]  # fmt: skip
LAUNCH_TIMEOUT = 300
STOP_LINE = re.compile(r"preempted by (SIG\w+) after step (\d+): saved (\S+); run the same command with")


# ---------------------------------------------------------------------- helpers


def write_checkpoint(root: Path, step: int, files: dict[str, bytes], state: dict | None = None) -> Path:
    """A checkpoint directory as save_checkpoint leaves it: the files, the trainer state, the marker last."""
    path = root / f"checkpoint-{step}"
    for name, data in {**files, STATE: json.dumps({"step": step, **(state or {})}).encode()}.items():
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
        ("ddp", "kill_in_background_save@10"),
        pytest.param("fsdp", "kill@7", marks=pytest.mark.matrix),
        pytest.param("fsdp", "kill_in_background_save@10", marks=pytest.mark.matrix),
        pytest.param("zero3", "kill@7", marks=pytest.mark.matrix),
    ],
)
def test_a_lost_rank_is_restarted_and_resumes_by_itself(config, fault, corpus, tmp_path, tmp_path_factory):
    """`accelerate launch --max_restarts 1`, no --resume_from_checkpoint: after step 7, between the checkpoints of
    steps 5 and 10, rank 0 is SIGKILLed (`kill@7`), or the last rank freezes (`stall@7`: the step watchdog, here
    --step_timeout 8, ends every rank with status 124), or, under --save_async, rank 0 is SIGKILLed while
    checkpoint-10 is written in the background (`kill_in_background_save@10`: its first file written, no marker);
    torch elastic restarts both ranks, which form a new process group (the dead generation's keys in the agent's
    store no longer in the way: training/core/accelerator.py) and resume from checkpoint-5, the newest intact, by
    themselves. The launcher exits 0, every step is logged once, with the straight run's losses (its saves
    synchronous), the final weights are the straight run's bitwise, and metrics.jsonl records what the fault cost."""
    straight = cell_run("accelerate", config, corpus, tmp_path_factory)
    cmd = launcher_command("accelerate", config)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--max_restarts", "1"]
    out = tmp_path / "out"
    extra = {"stall": ["--step_timeout=8"], "kill_in_background_save": ["--save_async"]}.get(fault.split("@")[0], [])
    args = [*cell_args("accelerate", config, corpus, tmp_path), *extra]
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
    assert cost["step"] == 6 and cost["restart"] == 1 and cost["fault_s"] > 0
    # kill@7 and stall@7: steps 6 and 7; a kill in checkpoint-10's background write: 6 to 10 at least, the first
    # generation having gone on stepping while its thread wrote
    assert cost["steps_recomputed"] == 2 if fault.endswith("@7") else cost["steps_recomputed"] >= 5, cost
    summary = f"restart 1 resumed at step 5: {cost['steps_recomputed']} steps recomputed, {cost['fault_s']:.1f} s from"
    assert summary in run.stdout, run.stdout[-2000:]  # the run summary says it too
    closing = run.records[-1]  # where the launch's time and host memory went: the resume's load and the last save
    assert closing["checkpoint_load_s"] > 0 and closing["checkpoint_save_s"] > 0, closing
    assert len(closing["checkpoint_load_peak_rss_gb"]) == len(closing["checkpoint_save_peak_rss_gb"]) == 2, closing
    print(f"{config} {fault}: {cost['fault_s']} s from the last record before the fault to the first step after it")


def elastic_agents(nproc: int, args: list[str], out: Path, tmp_path: Path) -> tuple[Run, Run]:
    """Two torchrun agents of `nproc` ranks each on this machine, as two nodes of one elastic job: `--nnodes 1:2`,
    c10d rendezvous hosted by the first (as node 0 hosts it on a cluster; the store dies with its host), one restart
    allowed, the rendezvous timeouts short (docs/checkpoints.md [13]). The second agent's ranks kill it, and
    themselves, after step 6 (`kill_node@6`). Returns the two agents' runs, the survivor's first."""
    endpoint = f"localhost:{free_port()}"
    rdzv = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    agents, runs = [], []
    with contextlib.ExitStack() as files:
        for name, host, fault in (("survivor", "true", ""), ("lost", "false", "kill_node@6")):
            cmd = [str(BIN / "torchrun"), "--nnodes=1:2", f"--nproc_per_node={nproc}", "--max-restarts=1",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=elastic",
                   f"--rdzv_conf={rdzv},is_host={host}", str(ROOT / "recipes" / "train.py")]  # fmt: skip
            build_deepspeed_ops(deepspeed_ops(cmd, args))
            logs = [files.enter_context(open(tmp_path / f"{name}.{stream}", "w+")) for stream in ("out", "err")]
            job = subprocess.Popen([*cmd, *args, "--output_dir", str(out)], cwd=ROOT, stdout=logs[0],
                                   stderr=logs[1], env=launch_env({"SHARDGPT_FAULT": fault}),
                                   start_new_session=True)  # fmt: skip
            agents.append((cmd, job, logs))
        started = time.perf_counter()
        try:
            for cmd, job, logs in agents:
                job.wait(timeout=LAUNCH_TIMEOUT)
                logs[0].seek(0), logs[1].seek(0)
                runs.append(Run(out, logs[0].read(), logs[1].read(), job.returncode))
                log_launch(cmd, args, runs[-1], time.perf_counter() - started)
        finally:
            for _, job, _ in agents:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
    return runs[0], runs[1]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "strategy, nproc", [("ddp", 1), pytest.param("zero3", 2, marks=pytest.mark.matrix)], ids=["ddp-1x2", "zero3-2x2"]
)
def test_a_lost_node_shrinks_the_world_and_the_run_goes_on(strategy, nproc, corpus, tmp_path):
    """An elastic job of two agents (`torchrun --nnodes 1:2`, `nproc` ranks each), no resume flag, no
    --global_batch_size: one agent is SIGKILLed with its ranks after step 6, between checkpoints 4 and 8. The survivor's
    agent re-forms the job on its own ranks, half the world; the restarted generation resumes from checkpoint-4,
    converted to the smaller world, keeping the global batch of 8 per agent's rank by doubling the accumulation; the
    job ends with exit status 0, each step logged once, and losses within 1e-5 of a straight run of the smaller world
    resumed from that checkpoint (a copy of it)."""
    args = [*corpus["flags"], *TRAIN, "--save_steps=4", "--max_steps=14"]
    if strategy != "ddp":
        args.append(f"--deepspeed=ds_configs/{strategy}.json")
    out = tmp_path / "out"
    survivor, lost = elastic_agents(nproc, args, out, tmp_path)
    assert lost.returncode != 0 and survivor.returncode == 0, survivor.stderr[-4000:]
    check_new_checkpoints(out, 0)
    global_batch = 4 * 2 * nproc  # micro 4 on both agents' ranks
    assert "restart 1 of the launcher's workers: resuming from the newest intact checkpoint" in survivor.stderr
    assert (f"keeping checkpoint-4's global batch of {global_batch} on {nproc} data-parallel ranks: accumulation 2"
            in survivor.stderr)  # fmt: skip
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in survivor.stderr
    steps = [r["step"] for r in survivor.records if "loss" in r]
    assert steps == list(range(1, 15)), steps  # each step once: the lost generation's 5 and 6 dropped
    (cost,) = [r for r in survivor.records if "restart" in r]
    assert cost["resumed_at_step"] == 4 and cost["steps_recomputed"] == 2 and cost["fault_s"] > 0
    # The smaller world's straight run from the same checkpoint.
    shutil.copytree(out / "checkpoint-4", tmp_path / "smaller" / "checkpoint-4")
    cmd = launcher_command("torchrun", nproc=nproc)
    smaller = launch(cmd, [*args, "--resume_from_checkpoint=auto", f"--global_batch_size={global_batch}"],
                     tmp_path / "smaller", timeout=LAUNCH_TIMEOUT)  # fmt: skip
    reference = smaller.own_losses
    assert sorted(reference) == list(range(5, 15))
    for step, loss in reference.items():
        assert survivor.losses[step] == pytest.approx(loss, rel=1e-5, abs=0), step
    print(
        f"{strategy}, {nproc} rank(s) an agent: {cost['fault_s']} s from the last record before the loss of the "
        "node to the first step after it"
    )


def test_a_restart_keeps_the_global_batch_or_says_why_it_cannot(tmp_path):
    """A restarted generation takes the global batch of the checkpoint it resumes from, whatever the world it
    re-formed on, unless --global_batch_size says otherwise; a world that cannot make it is refused in one line."""
    write_checkpoint(tmp_path, 4, {}, {"loader": {"global_batch_size": 12}})
    parsed = RunConfig(output_dir=str(tmp_path), resume_from_checkpoint="auto", per_device_train_batch_size=2)
    kept = keep_global_batch(parsed, 3)  # 12 = micro 2 x 3 ranks x accumulation 2
    assert kept.global_batch_size == 12 and kept.accumulation(3) == 2
    assert keep_global_batch(replace(parsed, global_batch_size=24), 3).global_batch_size == 24
    said = "restarted on 5 data-parallel ranks, the run cannot keep the global batch of 12 that checkpoint-4 trained"
    with pytest.raises(ValueError, match=rf"^{said} with: micro 2 x 5 ranks does not divide it; pass a"):
        keep_global_batch(parsed, 5)


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
