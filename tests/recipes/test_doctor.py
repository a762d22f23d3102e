"""recipes/doctor.py: the pre-launch checks on this machine, a good launch, bad launches, the NVMe write test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recipes import doctor
from training.compat import build_lock_blocks
from training.core import ops
from training.doctor import launch as launches
from training.doctor import machine
from training.doctor.report import Report

ROOT = Path(__file__).resolve().parents[2]


def run_doctor(capfd, *args: str) -> tuple[int, str]:
    """`python recipes/doctor.py ARGS`, in this process: (exit code, stdout)."""
    capfd.readouterr()
    code = doctor.main(list(args))
    return code, capfd.readouterr().out


def checks(stdout: str) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_good_launch_passes_and_reports_the_machine(tmp_path, capfd):
    code, out = run_doctor(
        capfd,
        "--config_file", "accelerate_configs/zero3_offload_nvme.yaml", "--nvme_path", str(tmp_path), "--write_mb", "8",
        "--json", "--", "--preset", "debug", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
        "2", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 0, out
    found = checks(out)
    assert not [c for c in found.values() if c["status"] == "FAIL"]
    if not machine.gpus():  # this machine: no GPU, said so, and gloo works
        assert found["GPUs"]["status"] == "WARN" and "no GPU" in found["GPUs"]["detail"]
        assert found["pinned memory"]["status"] == "n/a"
        assert "gloo all-reduce ok" in found["process group"]["detail"]
    assert found["DeepSpeed config"]["status"] == "OK"
    assert found["accelerate config"]["status"] == "OK"
    assert found[f"NVMe path {tmp_path}"]["status"] in ("OK", "WARN")
    assert "MiB/s" in found[f"NVMe path {tmp_path}"]["detail"]
    resolved = json.loads(out)["resolved"]
    assert resolved["strategy"] == "zero3-offload-nvme on 2 rank(s)"
    assert resolved["ZeRO stage"] == 3 and resolved["offload params"] == "nvme"
    assert resolved["micro batch per rank"] == 4 and resolved["gradient accumulation"] == 2
    assert resolved["global batch"].startswith("16 ")
    assert resolved["precision"] == "fp32"
    assert json.loads(out)["deepspeed"]["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    assert not list(tmp_path.glob(".shardgpt-doctor-*")), "the write test leaves no file behind"


def test_table_output_for_the_machine_alone():
    """The command line itself, in a fresh process: a table on stdout, exit 0 on this machine."""
    p = subprocess.run([sys.executable, "recipes/doctor.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[0].split() == ["check", "status", "detail"]
    for name in ("GPUs", "process group", "bf16", "DeepSpeed ops", "pinned memory", "libaio"):
        assert any(line.startswith(name) for line in p.stdout.splitlines()), name
    assert "0 FAIL: nothing blocks a launch" in p.stdout


def test_typo_key_and_missing_nvme_path_fail_naming_the_field(tmp_path, capfd):
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["zero_optimisation"] = ds.pop("zero_optimization")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(ds))
    code, out = run_doctor(
        capfd, "--deepspeed", str(bad), "--num_processes", "2", "--nvme_path", "/no/such/nvme", "--",
        "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 1, out
    fails = [line for line in out.splitlines() if "  FAIL  " in line]
    assert any("DeepSpeed config" in f and "'zero_optimisation'; did you mean 'zero_optimization'?" in f for f in fails)
    assert any("--nvme_path '/no/such/nvme' does not exist" in f for f in fails)
    assert "blocking problems" in out


def test_bad_accelerate_config_and_flags_fail(tmp_path, capfd):
    yaml = tmp_path / "cpu.yaml"
    yaml.write_text((ROOT / "accelerate_configs" / "zero2.yaml").read_text().replace("use_cpu: false", "use_cpu: true"))
    code, out = run_doctor(capfd, "--config_file", str(yaml), "--json", "--", "--output_dir", str(tmp_path))
    assert code == 1
    found = checks(out)
    assert found["accelerate config"]["status"] == "FAIL" and "use_cpu: true" in found["accelerate config"]["detail"]
    # The YAML's own problem stops the launch checks; a good YAML with a bad flag reaches them.
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/ddp.yaml", "--json", "--", "--max_steps", "0")
    assert code == 1
    assert "--max_steps 0 must be at least 1" in checks(out)["training flags"]["detail"]
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/nope.yaml", "--json")
    assert code == 1 and "no such file" in checks(out)["accelerate config"]["detail"]
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/ddp.yaml", "--json", "--", "--bogus", "1")
    assert code == 1 and "unknown flags ['--bogus', '1']" in checks(out)["training flags"]["detail"]


def test_write_speed_on_tmp_path(tmp_path):
    speed = machine.measure_write_speed(tmp_path, megabytes=4)
    assert speed > 0
    assert list(tmp_path.iterdir()) == []
    report = Report()
    machine.check_nvme(report, str(tmp_path), "--nvme_path", megabytes=4, need_bytes=None)
    (check,) = report.checks
    assert check.status in ("OK", "WARN") and "MiB/s (4 MiB, fsync)" in check.detail
    machine.check_nvme(report, str(tmp_path / "missing"), "--nvme_path", megabytes=4, need_bytes=None)
    assert report.checks[-1].status == "FAIL" and "does not exist" in report.checks[-1].detail
    machine.check_nvme(report, str(tmp_path), "--nvme_path", megabytes=4, need_bytes=2**60)
    assert report.checks[-1].status == "FAIL" and "need about" in report.checks[-1].detail


@pytest.mark.parametrize(
    "name", ["zero1", "fsdp", "fsdp_shard_grad_op", "zero3_offload_cpu", "fsdp_hybrid_multinode", "fsdp1", "autotp"]
)
def test_strategy_names_match_the_training_script(name):
    """The name doctor prints is the one training/strategy.py reports in strategy.json: both resolve the launch in
    training/launch.py, the doctor from the environment accelerate's launcher makes of the YAML."""
    from training.config import RunConfig
    from training.launch import resolve_launch

    launch = launches.read_launch_config(ROOT / "accelerate_configs" / f"{name}.yaml")
    launch["_path"] = ROOT / "accelerate_configs" / f"{name}.yaml"
    expected = {"zero1": "zero1", "fsdp": "fsdp", "fsdp_shard_grad_op": "fsdp-shard-grad-op",
                "zero3_offload_cpu": "zero3-offload-cpu", "fsdp_hybrid_multinode": "fsdp-hybrid", "fsdp1": "fsdp1",
                "autotp": "zero1-autotp"}  # fmt: skip
    world = launch["num_processes"]  # as written: 16 for the multi-node YAML, 2 for the others
    env = launches.launched_environment(launch, world)
    cfg = RunConfig(output_dir="/nonexistent/shardgpt-test", per_device_train_batch_size=2)
    assert resolve_launch(cfg, env).strategy.name == expected[name]


@pytest.mark.parametrize(("name", "world", "expected"), [("fsdp", 4, "fsdp-pp2"), ("ddp", 2, "single-pp2"),
                                                         ("ddp", 4, "ddp-pp2")])  # fmt: skip
def test_pipeline_launches_are_named_as_the_training_script_names_them(name, world, expected):
    """With --pipeline_parallel_degree 2 the doctor's strategy and the script's agree: pp outermost, the rest data
    parallel (one pipeline on 2 ranks has no data parallelism: single-pp2)."""
    from training.arguments import parse_run_config
    from training.launch import resolve_launch

    launch = launches.read_launch_config(ROOT / "accelerate_configs" / f"{name}.yaml")
    launch["_path"] = ROOT / "accelerate_configs" / f"{name}.yaml"
    cfg = parse_run_config(["--pipeline_parallel_degree", "2", "--gradient_accumulation_steps", "2",
                            "--output_dir", "/nonexistent/shardgpt-test"])  # fmt: skip
    assert resolve_launch(cfg, launches.launched_environment(launch, world)).strategy.name == expected


def test_a_lock_file_left_by_a_killed_build_is_reported_not_waited_on(tmp_path, monkeypatch):
    # torch waits on an extension's lock file for as long as it exists; the doctor names it, or removes it.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = tmp_path / "cpu_adam"
    build_dir.mkdir()
    lock = build_dir / "lock"
    lock.touch()
    assert ops.stale_lock(build_dir) is None  # just taken: a build may be starting
    old = time.time() - 120
    os.utime(lock, (old, old))
    if not build_lock_blocks():  # torch >= 2.14: an OS lock on the file, released by a killed build
        assert ops.stale_lock(build_dir) is None  # the file every build leaves behind blocks nothing
        return
    with subprocess.Popen(["sleep", "30"], cwd=build_dir) as compiler:  # a build is running in the directory
        try:
            assert ops.stale_lock(build_dir) is None
        finally:
            compiler.kill()
    assert ops.stale_lock(build_dir) == lock

    report = Report()
    machine.build_ops(report, names=("cpu_adam",))
    (check,) = report.checks
    assert check.status == "FAIL" and f"rm {lock}" in check.detail and lock.exists()

    report = Report()
    with monkeypatch.context() as m:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        m.setattr(ALL_OPS["cpu_adam"], "load", lambda verbose=False: None)  # no compiler run in the test
        machine.build_ops(report, names=("cpu_adam",), remove_stale_locks=True)
    assert [c.status for c in report.checks] == ["WARN", "OK"] and not lock.exists()


def test_memory_plan_refuses_what_the_training_script_refuses(tmp_path, capfd):
    """The doctor's memory plan is the training script's check (training/plan/memory/fit.py): same numbers, same fix."""
    code, out = run_doctor(
        capfd, "--config_file", "accelerate_configs/ddp.yaml", "--json", "--", "--preset", "llama-7b",
        "--config_overrides", "num_hidden_layers=200", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    plan = checks(out)["memory plan"]
    assert code != 0 and plan["status"] == "FAIL", plan
    assert "ddp on 2 rank(s), fp32" in plan["detail"] and "is predicted not to fit: host RAM needs" in plan["detail"]
    assert "cheapest fix: " in plan["detail"]


def test_communication_shows_what_a_deepspeed_setting_costs(tmp_path, capfd):
    """The per-step traffic of the launch, in the closed form the 4-rank launches measure to the byte
    (tests/recipes/test_communication.py), and the DeepSpeed settings that change it: ZeRO-2's all-reduced buckets
    against reduced ones, ZeRO-3's live-parameter limits at 0 against limits above the model's size."""
    from recipes.measure.comm_scaling import NO_LIVE, accelerate_config_with

    flags = ["--json", "--", "--preset", "debug", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path)]
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/zero2.yaml", *flags)
    detail = checks(out)["communication"]["detail"]
    assert code == 0 and detail.startswith("3.00 Psi") and "the ZeRO paper's 2 Psi" in detail, detail
    assert "use_multi_rank_bucket_allreduce is true" in detail and "false reduces them, 2.00 Psi" in detail, detail
    code, out = run_doctor(capfd, "--config_file", str(accelerate_config_with("zero3", NO_LIVE, tmp_path)), *flags)
    detail = checks(out)["communication"]["detail"]
    assert code == 0 and "the ZeRO paper's 3 Psi" in detail and "re-gather in the backward" in detail, detail
    assert "at least that, 2.00 Psi" in detail, detail
    # Gradient accumulation, AutoTP and Ulysses have their closed forms too (the 2- and 4-rank launches hold them to
    # the byte): 2 micro batches of ZeRO-2 reduce twice and gather once, 5 Psi.
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/zero2.yaml", *flags,
                           "--gradient_accumulation_steps", "2")  # fmt: skip
    detail = checks(out)["communication"]["detail"]
    assert code == 0 and detail.startswith("5.00 Psi") and "of 2 micro batches" in detail, detail
    for config, what in (("autotp", "AutoTP's all-reduces"), ("zero3_sp", "Ulysses' all-to-alls")):
        code, out = run_doctor(capfd, "--config_file", f"accelerate_configs/{config}.yaml", *flags)
        found = checks(out)["communication"]
        assert code == 0 and found["status"] == "OK" and what in found["detail"], found


def test_the_doctor_counts_the_modules_autotp_splits_as_the_launch_measures_them():
    """The meta-device model's plan (what the doctor reads) splits what test_strategies' AutoTP launch records."""
    from collections import Counter

    from model import ShardGPTConfig, ShardGPTForCausalLM
    from training.axes.tensor.checks import tp_plan_styles

    with torch.device("meta"):
        net = ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug"))
    counts = Counter(tp_plan_styles(net).values())
    assert counts == {"colwise": 10, "rowwise": 4, "embedding_rowwise": 1, "colwise_gather_output": 1}


def test_a_sequence_parallel_launch_is_read_as_the_training_script_reads_it(tmp_path, capfd):
    """zero3_sp.yaml: the YAML's sp degree joins the JSON, the global batch counts world / sp data-parallel ranks,
    the strategy is named as strategy.json names it and the planner plans each rank's share of the sequence."""
    flags = ["--json", "--", "--preset", "debug", "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path)]
    code, out = run_doctor(capfd, "--config_file", "accelerate_configs/zero3_sp.yaml", *flags)
    assert code == 0, out
    resolved = json.loads(out)["resolved"]
    assert resolved["strategy"] == "zero3-sp2 on 2 rank(s)"
    assert resolved["global batch"].startswith("8 (= micro x accumulation x data-parallel ranks 1: world 2 / sp 2)")
    found = checks(out)
    assert "data-parallel ranks 1" in found["training flags"]["detail"]
    assert found["memory plan"]["status"] == "OK", found["memory plan"]
