"""Bad launches end before any training, with one line naming the field, the value and the fix."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from launching import ROOT, accelerate_with, launch, launcher_command

from training.compat import build_lock_blocks

FAST = ["--preset=debug", "--max_steps=3", "--warmup_steps=1", "--sample_max_new_tokens=0"]


def write_json(path: Path, obj: dict) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def zero2_with(tmp_path, **changes) -> str:
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds.update(changes)
    return write_json(tmp_path / "ds.json", ds)


# case: (extra flags, what the error names, the fix it gives)
CASES = {
    "typo key": (lambda t: [f"--deepspeed={zero2_with(t, zero_optimisation={'stage': 2})}"],
                 "unknown key 'zero_optimisation'", "did you mean 'zero_optimization'?"),
    "batch conflict": (lambda t: [f"--deepspeed={zero2_with(t, train_micro_batch_size_per_gpu=16)}"],
                       "train_micro_batch_size_per_gpu = 16 but --per_device_train_batch_size gives 8",
                       "or pass --per_device_train_batch_size 16"),
    "offload_param without ZeRO-3": (
        lambda t: [f"--deepspeed={zero2_with(t, zero_optimization={'stage': 2, 'offload_param': {'device': 'cpu'}})}"],
        "offload_param needs stage 3 (stage is 2)", "set stage to 3, or remove offload_param"),
    "both precisions": (lambda t: ["--bf16", "--fp16"], "--bf16 and --fp16 are both set", "choose one precision"),
    "missing train file": (lambda t: [f"--train_file={t}/nope.txt"], "--train_file", "matches no file: pass an "
                           "existing path or glob"),
    "missing nvme path": (lambda t: ["--deepspeed=ds_configs/zero3_offload_nvme.json"],
                          "nvme_path = '/local_nvme' does not exist", "or pass --nvme_path DIR"),
    "unknown optimizer": (lambda t: ["--optim=lion"], "--optim: invalid choice 'lion'",
                          "choose from adamw_torch, muon"),
    "muon with an offload": (lambda t: ["--optim=muon", "--deepspeed=ds_configs/zero3_offload_cpu.json"],
                             "--optim muon under zero3-offload-cpu: an offloaded optimizer", "or --optim adamw_torch"),
    "muon with a JSON optimizer": (
        lambda t: ["--optim=muon", f"--deepspeed={zero2_with(t, optimizer={'type': 'AdamW', 'params': {}})}"],
        "the DeepSpeed JSON defines its own optimizer (AdamW)", "or drop --optim muon"),
    "cannot fit": (lambda t: ["--preset=llama-7b", "--config_overrides=num_hidden_layers=200"],
                   "is predicted not to fit: host RAM needs", "cheapest fix: "),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_fast_with_the_fix(case, corpus, tmp_path):
    extra, field, fix = CASES[case]
    out = tmp_path / "out"
    run = launch(launcher_command("python"), [*corpus["flags"], *FAST, *extra(tmp_path)], out, check=False)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and field in last and fix in last, last
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_use_cpu_true_does_not_silently_drop_deepspeed(corpus, tmp_path):
    """With `use_cpu: true` plain accelerate drops the DeepSpeed plugin and every rank trains alone on the
    whole dataset. The script builds its Accelerator from the resolved JSON itself, so the run is still
    ZeRO-2 on 2 ranks, as `verify_strategy` confirms (it would refuse otherwise: see the next test)."""
    yaml = (ROOT / "accelerate_configs" / "zero2.yaml").read_text().replace("use_cpu: false", "use_cpu: true")
    config = tmp_path / "zero2_cpu.yaml"
    config.write_text(yaml)
    cmd = launcher_command("accelerate", "zero2")
    cmd[cmd.index("--config_file") + 1] = str(config)
    run = launch(cmd, [*corpus["flags"], *FAST, "--per_device_train_batch_size=4"], tmp_path / "out")
    assert run.strategy["strategy"] == "zero2" and run.strategy["engine"] == "DeepSpeedEngine"
    assert run.strategy["world_size"] == 2


def test_verify_refuses_a_world_size_mismatch():
    """What the silent trap looks like from inside: 2 ranks launched, accelerate running 1 process."""
    from types import SimpleNamespace

    import torch

    from training.core.inspection import verify_strategy
    from training.strategy import Strategy

    net = torch.nn.Linear(4, 4)
    fake = SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO", unwrap_model=lambda m: m)
    with pytest.raises(RuntimeError, match=r"the launcher started 2 ranks but accelerate runs 1 process\(es\)"):
        verify_strategy(fake, net, Strategy.of("deepspeed", 2, zero_stage=2))


# What `verify_strategy` says when the prepared model is not what was asked for (tests/recipes/verify_worker.py).
REFUSALS = {
    "fsdp": {
        "as launched": "ok",
        "asked for FSDP": "ok",
        "asked for ZeRO-2": "the prepared model is a FSDPShardGPTForCausalLM, not a DeepSpeedEngine",
        "asked for ZeRO-3": "the prepared model is a FSDPShardGPTForCausalLM, not a DeepSpeedEngine",
        "asked for DDP": "the prepared model is a FSDPShardGPTForCausalLM, not DistributedDataParallel",
        "as launched, not sharded": "parameters (FSDP should hold about 1/2)",
    },
    "autotp": {
        "as launched": "ok",
        "asked for ZeRO-2": "the engine runs ZeRO stage 1",
        "asked for ZeRO-3": "the engine runs ZeRO stage 1",
        "asked for FSDP": "accelerate runs DistributedType.DEEPSPEED",
        "asked for DDP": "the prepared model is a DeepSpeedEngine, not DistributedDataParallel",
        "asked for no tensor parallelism": "the engine splits layers over 2 ranks",
        "as launched, rows and columns swapped": (
            "model.layers.0.self_attn.q_proj (rowwise) holds a weight of (32, 64), not 1/2 of (64, 64) along dim 1"
        ),
        "as launched, not sharded": "ok",  # AutoTP's shares are its split shapes, checked above
    },
    "zero3": {
        "as launched": "ok",
        "asked for ZeRO-3": "ok",
        "asked for ZeRO-2": "the engine runs ZeRO stage 3",
        "asked for FSDP": "accelerate runs DistributedType.DEEPSPEED",
        "asked for DDP": "the prepared model is a DeepSpeedEngine, not DistributedDataParallel",
        "as launched, not sharded": "parameters (ZeRO-3 should hold about 1/2)",
    },
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", sorted(REFUSALS))
def test_verify_strategy_refuses_what_is_not_in_force(config, tmp_path):
    """Each refusal branch of `verify_strategy`, forced on a real 2-rank launch: the wrong engine, the wrong ZeRO
    stage, the wrong wrapper, and a model that is not sharded. Every refusal names the fix."""
    cmd = launcher_command("accelerate", config)
    cmd[-1] = str(ROOT / "tests" / "recipes" / "verify_worker.py")
    launch(cmd, ["--preset=debug"], tmp_path / "out")
    seen = json.loads((tmp_path / "out" / "refusals.json").read_text())
    assert seen.keys() == REFUSALS[config].keys()
    for case, expected in REFUSALS[config].items():
        if expected == "ok":
            assert seen[case] == "ok", f"{case}: {seen[case]}"
        else:
            assert expected in seen[case] and "the launch's config was not applied as written" in seen[case], (
                f"{case}: {seen[case]}"
            )


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp_wrap_class_missing_is_refused(corpus, tmp_path):
    yaml = (ROOT / "accelerate_configs" / "fsdp.yaml").read_text()
    yaml = yaml.replace(
        "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
    )
    config = tmp_path / "fsdp_wrap.yaml"
    config.write_text(yaml)
    cmd = launcher_command("accelerate", "fsdp")
    cmd[cmd.index("--config_file") + 1] = str(config)
    run = launch(cmd, [*corpus["flags"], *FAST, "--per_device_train_batch_size=4"], tmp_path / "out", check=False)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    # One line from each rank, before any process group; the launcher may stop the second rank before it prints.
    assert len(errors) in (1, 2), run.stderr[-3000:]
    assert all(
        "fsdp_transformer_layer_cls_to_wrap names ['LlamaDecoderLayer'], which this model does not have; set it to "
        "['ShardGPTDecoderLayer'] or remove it" in line
        for line in errors
    ), errors
    assert "Traceback" not in run.stderr.split(errors[-1])[0] and not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("body", "code", "stream", "text"), [
    ("print('finished', end='')", 0, "stdout", "finished"),
    ("raise ValueError('--block_size 0 must be at least 1')", 2, "stderr", "error: --block_size 0 must be at least 1"),
])  # fmt: skip
def test_a_launched_rank_ends_with_its_status_and_all_its_output(body, code, stream, text):
    """`run_rank` ends a launched rank without interpreter finalization; what the rank printed into a pipe
    (block-buffered) still arrives, and bad input still ends with one line and status 2."""
    import os
    import subprocess
    import sys

    script = f"from training.core.ranks import run_rank\ndef main():\n    {body}\nrun_rank(main)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == code, p.stderr[-2000:]
    assert getattr(p, stream).strip() == text


@pytest.mark.slow
@pytest.mark.skipif(not build_lock_blocks(), reason="torch >= 2.14 locks builds with an OS lock a killed build frees")
def test_a_stale_op_build_lock_fails_fast_instead_of_hanging(corpus, tmp_path):
    """torch waits for as long as an op's build lock exists; one left by a killed build used to hang every rank
    of every later DeepSpeed launch, silently. The script names the file and the fix instead."""
    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 2 * 3600,) * 2)
    out = tmp_path / "out"
    args = [*corpus["flags"], *FAST, "--deepspeed=ds_configs/zero1.json"]
    run = launch(launcher_command("python"), args, out, check=False, timeout=120,
                 env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"rm {lock}" in last, last
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_tensor_parallel_degree_that_splits_no_head_evenly_is_refused(corpus, tmp_path):
    """accelerate_configs/fsdp_tp.yaml with its block changed to tp 4 on the 4 ranks: the `debug` model's 2
    key-value heads cannot be split 4 ways, and every rank stops before its process group, naming the key, the
    model's count and the degrees that would."""
    yaml = (ROOT / "accelerate_configs" / "fsdp_tp.yaml").read_text()
    yaml = yaml.replace("parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 1")
    config = tmp_path / "fsdp_tp4.yaml"
    config.write_text(yaml.replace("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 4"))
    run = launch(accelerate_with(str(config)), [*corpus["flags"], *FAST], tmp_path / "out", check=False)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    want = "parallelism_config_tp_size = 4 does not divide the model's num_key_value_heads (2)"
    assert errors and all(want in e and "set parallelism_config_tp_size to one of [1, 2]" in e for e in errors), (
        run.stderr[-3000:]
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("config", "want"), [
    ("fsdp1", "--optim muon with fsdp_version: 1: FSDP1 hands the optimizer flat parameters"),
    ("fsdp_tp", "--optim muon with tensor parallelism of degree 2: Muon orthogonalizes each matrix whole"),
])  # fmt: skip
def test_muon_under_a_strategy_that_splits_its_matrices_is_refused(config, want, corpus, tmp_path):
    """FSDP1's flat parameters and tensor parallelism's split weights hold no matrix whole: every rank stops
    before its process group, naming the strategy and the configs that would run."""
    cmd = launcher_command("accelerate", config)
    run = launch(cmd, [*corpus["flags"], *FAST, "--optim=muon"], tmp_path / "out", check=False)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(want in e and "or --optim adamw_torch" in e for e in errors), run.stderr[-3000:]
    # the launcher's own traceback (a rank exited with 2) follows the ranks' lines; none precedes them
    assert "Traceback" not in run.stderr.split(errors[0])[0] and not (tmp_path / "out" / "metrics.jsonl").exists()
