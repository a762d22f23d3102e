"""Seeing inside a run: --profile traces, an offline W&B run read back, --step_timeout naming a stalled rank, and
the exported model card.

Two DDP launches on 2 CPU ranks (`debug` preset, 6 steps) serve every launched assertion: one profiles steps 3-4
and reports to W&B (offline); the other, with the same flags and no profiler, has its last rank stall after step 5
under --step_timeout. Its losses of steps 1-5 must equal the profiled run's bitwise. TensorBoard under DDP and
ZeRO-3, and W&B under ZeRO-3, are read back in test_strategies.py; FSDP and ZeRO-3 with the profiler and the
watchdog (and DeepSpeed's own flops profiler and wall-clock breakdown) are `matrix` cells below.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import ROOT, launch, launcher_command
from trackers import assert_same_as_metrics, wandb_history

from training.checkpoints.checkpoint import damage, latest_checkpoint
from training.config import RunConfig
from training.limits import HUNG, parse_steps
from training.loop.watchdog import hang_report

STEPS = 6
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=4", "--save_steps=2", "--sample_max_new_tokens=0",
    "--per_device_train_batch_size=4",
]  # fmt: skip
PROFILE = ["--profile", "--profile_steps=3-4"]
STALL = {"SHARDGPT_FAULT": "stall@5"}
STEP_TIMEOUT = 8  # seconds; a `debug` step takes well under one on 2 loaded CPU cores
LAUNCH_TIMEOUT = 300


# ---------------------------------------------------------------------- unit


def test_profile_steps_are_parsed_and_checked():
    assert parse_steps("3-4") == (3, 4) and parse_steps("7") == (7, 7)
    for bad in ("0-2", "4-3", "x"):
        with pytest.raises(ValueError, match=rf"--profile_steps {bad!r}: give `first-last`"):
            parse_steps(bad)
    with pytest.raises(ValueError, match="--profile_steps 3-4 ends after --max_steps 2"):
        RunConfig(profile=True, max_steps=2, output_dir="unused").validate(1)
    with pytest.raises(ValueError, match=r"--profile_steps 2-3 spans checkpoint-2 \(--save_steps 2\): .* such as 3-4"):
        RunConfig(profile=True, profile_steps="2-3", save_steps=2, output_dir="unused").validate(1)
    with pytest.raises(ValueError, match="--step_timeout -1.0 must be 0"):
        RunConfig(step_timeout=-1.0, output_dir="unused").validate(1)


def test_trainer_path_refuses_step_timeout(tmp_path):
    from recipes import trainer

    with pytest.raises(ValueError, match="--step_timeout 5 needs recipes/train.py"):
        trainer.main(["--step_timeout=5", f"--output_dir={tmp_path}"])


def test_a_rank_without_a_stack_is_named_dead(tmp_path):
    (tmp_path / "rank0.txt").write_text(
        "rank 0 step 9 phase train_step: no progress for 5 s\nThread 0x1 (most recent call first):\n"
        '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 10 in broadcast\n'
        '  File "/repo/recipes/train.py", line 99 in main\n  File "/repo/recipes/train.py", line 300 in <module>\n'
    )
    report = hang_report(tmp_path, 2, 9, 5)
    assert "rank 0: step 9 phase train_step, waiting in collective broadcast" in report
    assert "called from recipes/train.py:99 main" in report
    assert "rank 1: wrote no stack: dead" in report


FROZEN_AFTER_A_SAVE = """
import sys, time
from training.loop.watchdog import StepWatchdog
watchdog = StepWatchdog(None, sys.argv[1], 0, 1, floor=0.5, ceiling=30)
for step in range(1, 5):  # four steps of about 50 ms: then a step's deadline is the floor, 0.5 s
    watchdog.arm(step)
    time.sleep(0.05)
    watchdog.phase("agree_on_stop")
print(watchdog.allowance("train_step"), flush=True)
watchdog.phase("save")  # a save of 2 s: under the ceiling, not the floor
time.sleep(2)
watchdog.phase("agree_on_stop")  # the rest of a step that saved: the ceiling too
time.sleep(1)
watchdog.arm(5)
time.sleep(60)  # frozen: the deadline ends it within the floor
"""


def test_the_default_deadline_is_measured_from_the_steps(tmp_path):
    """--step_timeout's default on CPU and GPU alike: after three steps, a training step may take 10x the slowest
    after the first, at least the floor; a save, and the rest of its step, the ceiling. Driven in a process of its own
    with a floor of 0.5 s and a ceiling of 30 s: a 2 s save and the 1 s after it pass, the frozen step 5 ends the
    process with status 124 within seconds, the report saying which deadline it was."""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", FROZEN_AFTER_A_SAVE, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == HUNG, run.stderr
    assert float(run.stdout.split()[0]) == 0.5
    assert time.monotonic() - started < 30
    report = (tmp_path / "hang" / "report.txt").read_text()
    assert report.startswith("error: step 5 made no progress for 0.5 s (--step_timeout's measured default)"), report
    frozen = FROZEN_AFTER_A_SAVE.splitlines().index("time.sleep(60)  # frozen: the deadline ends it within the floor")
    assert f"rank 0: step 5 phase train_step, at <string>:{frozen + 1} in <module>" in report, report


# ---------------------------------------------------------------------- launched


@pytest.fixture(scope="module")
def profiled(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled") / "out"
    # The user's WANDB_DIR is where the W&B run goes (without it: under --output_dir, test_strategies.py).
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(out.parent / "wandb_dir")}
    args = [*corpus["flags"], *TRAIN, *PROFILE, "--report_to=wandb"]
    return launch(launcher_command("accelerate", "ddp"), args, out, timeout=LAUNCH_TIMEOUT, env=env)


@pytest.fixture(scope="module")
def stalled(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("stalled") / "out"
    args = [*corpus["flags"], *TRAIN, f"--step_timeout={STEP_TIMEOUT}"]
    cmd = launcher_command("accelerate", "ddp")
    return launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env=STALL)


def assert_traces(out: Path, steps: tuple[int, int]) -> None:
    """Each rank's Chrome trace holds the profiled steps' ranges, operators with shapes, memory events, Python
    stacks and its rank; the steps outside are not in it."""
    for rank in (0, 1):
        (trace,) = (out / "profile" / f"rank{rank}").glob(f"rank{rank}.*.pt.trace.json")
        data = json.loads(trace.read_text())
        events = data["traceEvents"]
        ranges = {e["name"] for e in events if e.get("cat") == "user_annotation" and "optimizer_step#" in e["name"]}
        assert ranges == {f"optimizer_step#{s}" for s in range(steps[0], steps[1] + 1)}
        mm = [e for e in events if e.get("name") == "aten::mm"]
        assert mm and all("Input Dims" in e["args"] for e in mm)
        assert any(e.get("name") == "[memory]" for e in events)
        assert any(e.get("cat") == "python_function" for e in events)
        assert data["distributedInfo"]["rank"] == rank


@pytest.mark.slow
@pytest.mark.multiproc
def test_profile_writes_every_ranks_trace_and_one_summary(profiled):
    assert_traces(profiled.output_dir, (3, 4))
    summary = r"profile of steps 3-4 \(rank 0, top ops by self time\):\n(.+?)\nSelf CPU time total"
    table = re.findall(summary, profiled.stdout, re.S)
    assert len(table) == 1, profiled.stdout[-3000:]  # rank 0 alone
    assert "aten::mm" in table[0] and "python" not in table[0].lower()


@pytest.mark.slow
@pytest.mark.multiproc
def test_wandb_offline_history_is_metrics_jsonl(profiled):
    assert not (profiled.output_dir / "wandb").exists(), "WANDB_DIR was set: nothing belongs under --output_dir"
    assert_same_as_metrics(wandb_history(profiled.output_dir.parent / "wandb_dir"), profiled.records, "wandb")


@pytest.mark.slow
@pytest.mark.multiproc
def test_exported_folder_carries_a_model_card(profiled):
    """README.md with Hub front matter and what a reader needs: shape, parameters, data, tokenizer, strategy,
    precision, steps, the final losses and perplexity, the command."""
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    out = profiled.output_dir
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "ddp" in card.data.tags
    parameters = sum(t.numel() for t in load_file(out / "model.safetensors").values())
    final = [r for r in profiled.records if "eval_loss" in r][-1]  # the last evaluation
    config = json.loads((out / "config.json").read_text())
    for expected in (
        f"| parameters | {parameters:,} |",
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}",
        f"| data | {profiled_train_file(out)}, blocks of 64 tokens |",
        "| strategy | ddp (DistributedDataParallel) on 2 ranks |",
        "| precision | fp32; parameters float32 |",
        f"| steps | {STEPS} |",
        f"| final validation loss | {final['eval_loss']:.4f} (perplexity {final['eval_perplexity']:.2f}) |",
        f"| final training loss | {profiled.losses[STEPS]:.4f} |",
        "recipes/train.py --train_file=",
        "--profile",
    ):
        assert expected in card.text, expected


def profiled_train_file(out: Path) -> str:
    return json.loads((out / "run_config.json").read_text())["train_file"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stalled_rank_is_named_and_the_run_ends(stalled, profiled):
    """The last rank stops answering after step 5: within --step_timeout every rank dumps its stacks, rank 0 says
    once that rank 1 hangs in the fault and rank 0 waits in the stop agreement's all_reduce, both exit with
    HUNG, checkpoint-4 is intact. The steps before match the profiled run's bitwise: profiling changes no loss."""
    out = stalled.output_dir
    assert stalled.returncode != 0
    assert len(re.findall(rf"exitcode\s*: {HUNG} ", stalled.stderr)) == 2  # torch elastic's report of both ranks
    assert stalled.stderr.count(f"error: step 5 made no progress for {STEP_TIMEOUT} s (--step_timeout)") == 1
    report = (out / "hang" / "report.txt").read_text()
    assert re.search(r"rank 0: step 5 phase agree_on_stop, waiting in collective all_reduce \(.*preemption\.py", report)
    assert "rank 1: step 5 phase agree_on_stop, at training/faults.py:" in report and "in maybe_stall" in report
    for rank in (0, 1):
        assert "most recent call first" in (out / "hang" / f"rank{rank}.txt").read_text()
    assert latest_checkpoint(out) == out / "checkpoint-4" and damage(out / "checkpoint-4") is None
    assert stalled.losses == {s: profiled.losses[s] for s in range(1, 6)}


# ---------------------------------------------------------------------- matrix: FSDP and ZeRO-3


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
@pytest.mark.parametrize("config", ["fsdp", "zero3"])
def test_profiler_and_watchdog_under_sharding(config, corpus, tmp_path):
    """One launch per strategy: --profile of steps 3-4, then a stall after step 5 under --step_timeout. Under
    ZeRO-3 the DeepSpeed JSON's flops profiler and wall-clock breakdown also run (they pass through from it).
    Rank 0's summary of the profile after step 4 (10-30 s here, for the trace's Python stacks) is not timed."""
    args = [*corpus["flags"], *TRAIN, *PROFILE, f"--step_timeout={STEP_TIMEOUT}"]
    cmd = launcher_command("accelerate", config)
    if config == "zero3":
        ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        ds.update(
            steps_per_print=1,
            wall_clock_breakdown=True,
            flops_profiler={"enabled": True, "profile_step": 2, "detailed": False},
        )
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        cmd, args = launcher_command("deepspeed"), [*args, f"--deepspeed={tmp_path / 'ds.json'}"]
    out = tmp_path / "out"
    run = launch(cmd, args, out, check=False, timeout=LAUNCH_TIMEOUT, env=STALL)
    assert_traces(out, (3, 4))
    assert run.stdout.count("profile of steps 3-4 (rank 0") == 1
    report = (out / "hang" / "report.txt").read_text()
    assert "rank 0: step 5 phase agree_on_stop, waiting in collective" in report
    assert "rank 1: step 5 phase agree_on_stop, at training/faults.py:" in report
    assert latest_checkpoint(out) == out / "checkpoint-4" and damage(out / "checkpoint-4") is None
    if config == "zero3":
        logs = run.stdout + run.stderr
        assert "DeepSpeed Flops Profiler" in logs and "fwd_microstep" in logs


@pytest.mark.gpu
@pytest.mark.slow
def test_profile_on_a_gpu_records_cuda_kernels_and_a_memory_snapshot(corpus, tmp_path):
    """One process on a GPU: the trace holds CUDA kernels beside the CPU operators, and the allocator's history of
    the profiled steps is in memory_snapshot.pickle, with the allocations' stacks."""
    import pickle

    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA activity and torch.cuda.memory's snapshot need a CUDA GPU")
    args = [*corpus["flags"], *TRAIN, *PROFILE, "--per_device_train_batch_size=8"]
    launch(launcher_command("python"), args, tmp_path / "out", timeout=LAUNCH_TIMEOUT)
    folder = tmp_path / "out" / "profile" / "rank0"
    (trace,) = folder.glob("rank0.*.pt.trace.json")
    assert any(e.get("cat") == "kernel" for e in json.loads(trace.read_text())["traceEvents"])
    snapshot = pickle.loads((folder / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and any(events for events in snapshot["device_traces"])
