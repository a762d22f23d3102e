"""Checkpoints across strategies and numbers of ranks: a run saved at step 3 of 6 resumes under another strategy
with the same weights, Adam moments and step, and logs the straight run's losses for steps 4-6; the global batch
is kept or the resume refused; recipes/convert_checkpoint.py writes an HF folder offline."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from launching import ROOT, launch, launcher_command
from safetensors.torch import load_file

from training.checkpoints.checkpoint import MARKER, STATE, check_resume
from training.checkpoints.portable import NEUTRAL, read_checkpoint
from training.config import RunConfig
from training.strategy import Strategy

TRAIN = [
    "--preset=debug", "--max_steps=6", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4", "--save_steps=3",
]  # fmt: skip
TOLERANCE = 1e-5  # fp32: the strategies sum gradients in different orders

# Two pipeline stages on 2 ranks: the global batch of 8 as 2 micro batches of 4 (training/axes/pipeline/runtime.py).
PIPELINE = ["--pipeline_parallel_degree=2", "--gradient_accumulation_steps=2"]
# FSDP2 x TP x PP on 8 ranks (accelerate_configs/fsdp_tp.yaml's dp_shard 2 x tp 2, two stages): 2 micro batches of 2
# on each of 2 data-parallel ranks.
THREE_D = [*PIPELINE, "--per_device_train_batch_size=2"]
# Ulysses over the 2 ranks (one data-parallel rank): the global batch of 8 in one micro batch.
SEQUENCE = ["--per_device_train_batch_size=8"]
# Source runs: the accelerate config and number of ranks (and flags).
SOURCES = {
    "zero2@2": ("zero2", 2),
    "zero3@2": ("zero3", 2),
    "fsdp@2": ("fsdp", 2),
    "ddp@1": ("single", 1),
    "zero3-offload-cpu@2": ("zero3_offload_cpu", 2),
    "pp2@2": ("ddp", 2, PIPELINE),
    "zero3-sp2@2": ("zero3_sp", 2, SEQUENCE),
    "fsdp-tp2@4": ("fsdp_tp", 4),  # dp_shard 2 x tp 2: micro 4 on each of 2 data-parallel ranks, as the others
    "fsdp-tp2-pp2@8": ("fsdp_tp", 8, THREE_D),  # FSDP2 x TP x PP, 2 x 2 x 2
}
# (source, target config, target ranks, flags that keep the global batch)
TRANSITIONS = [
    pytest.param("zero2@2", "fsdp", 2, [], id="zero2@2->fsdp@2"),
    pytest.param("fsdp@2", "zero3", 2, [], id="fsdp@2->zero3@2"),
    pytest.param("zero2@2", "zero2", 1, ["--global_batch_size=8"], id="zero2@2->zero2@1", marks=pytest.mark.matrix),
    pytest.param("zero3@2", "ddp", 2, [], id="zero3@2->ddp@2", marks=pytest.mark.matrix),
    pytest.param(
        "ddp@1",
        "zero1",
        2,
        ["--per_device_train_batch_size=2", "--global_batch_size=4"],
        id="ddp@1->zero1@2",
        marks=pytest.mark.matrix,
    ),  # fmt: skip
    pytest.param(
        "zero3-offload-cpu@2",
        "fsdp",
        1,
        ["--global_batch_size=8"],
        id="zero3-offload-cpu@2->fsdp@1",
        marks=pytest.mark.matrix,
    ),  # fmt: skip
    # Pipeline checkpoints (torch.distributed.checkpoint folders of each rank's stages): the same layout resumes
    # bitwise; other strategies read them, and theirs are read under a pipeline, through the neutral form.
    pytest.param("pp2@2", "ddp", 2, PIPELINE, id="pp2@2->pp2@2"),
    pytest.param("pp2@2", "fsdp", 2, [], id="pp2@2->fsdp@2"),
    pytest.param("zero2@2", "ddp", 2, PIPELINE, id="zero2@2->pp2@2"),
    pytest.param("pp2@2", "zero3", 2, [], id="pp2@2->zero3@2", marks=pytest.mark.matrix),
    pytest.param(
        "pp2@2", "single", 1, ["--per_device_train_batch_size=8"], id="pp2@2->one@1", marks=pytest.mark.matrix
    ),  # fmt: skip
    pytest.param(
        "fsdp@2",
        "fsdp",
        4,
        [*PIPELINE, "--per_device_train_batch_size=2"],
        id="fsdp@2->fsdp-pp2@4",
        marks=pytest.mark.matrix,
    ),  # fmt: skip
    # FSDP2 x TP checkpoints (each rank's slice of its shard of every split matrix, torch.distributed.checkpoint):
    # FSDP2's and ZeRO-2's resume under it, and it resumes under itself exactly and under ZeRO-3.
    pytest.param("fsdp@2", "fsdp_tp", 4, [], id="fsdp@2->fsdp-tp2@4"),
    pytest.param("zero2@2", "fsdp_tp", 4, [], id="zero2@2->fsdp-tp2@4", marks=pytest.mark.matrix),
    pytest.param("fsdp-tp2@4", "fsdp_tp", 4, [], id="fsdp-tp2@4->fsdp-tp2@4", marks=pytest.mark.matrix),
    pytest.param("fsdp-tp2@4", "zero3", 2, [], id="fsdp-tp2@4->zero3@2", marks=pytest.mark.matrix),
    # FSDP2 x TP x PP checkpoints (each rank's shards of its stage's slices): under FSDP2, and ZeRO-2's under 3D.
    pytest.param("fsdp-tp2-pp2@8", "fsdp", 2, [], id="fsdp-tp2-pp2@8->fsdp@2", marks=pytest.mark.matrix),
    pytest.param("zero2@2", "fsdp_tp", 8, THREE_D, id="zero2@2->fsdp-tp2-pp2@8", marks=pytest.mark.matrix),
    # Sequence-parallel checkpoints (ZeRO-3's partitions over every rank of the sequence-and-data-parallel group).
    pytest.param("zero3-sp2@2", "fsdp", 2, [], id="zero3-sp2@2->fsdp@2"),
    pytest.param("fsdp@2", "zero3_sp", 2, SEQUENCE, id="fsdp@2->zero3-sp2@2"),
    pytest.param("zero3-sp2@2", "zero3_sp", 2, SEQUENCE, id="zero3-sp2@2->zero3-sp2@2", marks=pytest.mark.matrix),
    pytest.param("zero3-sp2@2", "single", 1, SEQUENCE, id="zero3-sp2@2->one@1", marks=pytest.mark.matrix),
    pytest.param("zero3-sp2@2", "zero3", 2, [], id="zero3-sp2@2->zero3@2", marks=pytest.mark.matrix),
    pytest.param("ddp@1", "zero3_sp", 2, [], id="ddp@1->zero3-sp2@2", marks=pytest.mark.matrix),
    pytest.param("zero3@2", "zero3_sp", 2, SEQUENCE, id="zero3@2->zero3-sp2@2", marks=pytest.mark.matrix),
]


def command(config: str, nproc: int, worker: bool = False) -> list[str]:
    """accelerate launch with `config` on `nproc` ranks, of recipes/train.py or of tests/recipes/resume_worker.py."""
    *cmd, script = launcher_command("accelerate", config)
    script = str(ROOT / "tests" / "recipes" / "resume_worker.py") if worker else script
    return [*cmd, "--num_processes", str(nproc), script]


_SOURCES: dict[str, object] = {}


def source_run(name: str, corpus, tmp_path_factory):
    """6 steps with a checkpoint at 3 (and 6), once per source for the whole module."""
    if name not in _SOURCES:
        config, nproc, *flags = SOURCES[name]
        out = tmp_path_factory.mktemp(f"source-{config}-{nproc}") / "run"
        _SOURCES[name] = launch(command(config, nproc), [*corpus["flags"], *TRAIN, *(flags[0] if flags else [])], out)
    return _SOURCES[name]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("source", "config", "nproc", "flags"), TRANSITIONS)
def test_resume_under_another_strategy(source, config, nproc, flags, corpus, tmp_path, tmp_path_factory):
    src = source_run(source, corpus, tmp_path_factory)
    checkpoint = src.output_dir / "checkpoint-3"
    out = tmp_path / "run"
    shutil.copytree(checkpoint, out / "checkpoint-3")
    args = [*corpus["flags"], *TRAIN, *flags, "--resume_from_checkpoint=auto"]

    # One launch: the training script resuming, which (tests/recipes/resume_worker.py, outside pipelines) first
    # writes what the prepared objects hold once loaded, gathered by the libraries' getters, then trains on.
    expected = read_checkpoint(checkpoint)
    pipelined = PIPELINE[0] in flags
    resumed = launch(command(config, nproc, worker=not pipelined), args, out)
    if not pipelined:
        loaded = torch.load(out / "loaded.pt")
        assert loaded["step"] == expected["step"] == 3
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            extra = set(expected[key]) - set(loaded[key])  # a pipeline's: lm_head.weight, the tied embedding's copy
            assert set(loaded[key]) <= set(expected[key]) and extra <= {"lm_head.weight"}, extra
            differ = [n for n in loaded[key] if not torch.equal(loaded[key][n], expected[key][n])]
            assert not differ, f"{key} differs after the resume: {differ}"
        lr_at_3 = [r["lr"] for r in src.records if r.get("step") == 3][0]
        assert loaded["lr"] == pytest.approx([lr_at_3] * 2, rel=1e-12)

    # The rest of the run: steps 4-6 log the straight run's losses.
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in resumed.stderr
    losses = resumed.own_losses
    assert sorted(losses) == [4, 5, 6], f"the resumed run logged steps {sorted(losses)}"
    diffs = {s: abs(losses[s] - src.losses[s]) for s in losses}
    print(f"{source} -> {config}@{nproc}: |loss - straight loss| at steps 4-6: {diffs}")
    assert max(diffs.values()) <= TOLERANCE, diffs
    if SOURCES[source] == (config, nproc, flags):  # the layout that wrote it: exactly the straight run
        assert max(diffs.values()) == 0, diffs


@pytest.mark.slow
@pytest.mark.multiproc  # the zero2@2 run it reads is a 2-rank launch
def test_a_resume_with_another_global_batch_is_refused(corpus, tmp_path, tmp_path_factory):
    src = source_run("zero2@2", corpus, tmp_path_factory)
    out = tmp_path / "run"
    shutil.copytree(src.output_dir / "checkpoint-3", out / "checkpoint-3")
    args = [*corpus["flags"], *TRAIN, "--resume_from_checkpoint=auto"]
    run = launch(launcher_command("python"), args, out, check=False)  # one process: a global batch of 4
    assert run.returncode == 2
    assert (
        "trained with a global batch of 8 (micro 4 x accumulation 1 x world 2); this launch gives 4 (micro 4 x "
        "accumulation 1 x world 1): pass --global_batch_size 8"
    ) in run.stderr
    assert "strategy in force" not in run.stderr  # refused before the process group and the model


@pytest.mark.slow
@pytest.mark.multiproc  # the zero2@2 run it reads is a 2-rank launch
def test_convert_checkpoint_writes_an_hf_folder_offline(corpus, tmp_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    src = source_run("zero2@2", corpus, tmp_path_factory)
    out = convert(src.output_dir / "checkpoint-3", tmp_path / "hf")
    neutral = torch.load(out / NEUTRAL)
    assert neutral["step"] == 3 and set(neutral) == {"step", "weights", "exp_avg", "exp_avg_sq"}
    net = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert all(torch.equal(p, neutral["weights"][name]) for name, p in net.named_parameters())
    # The checkpoint at step 6 holds the weights the run exported at its end; --llama writes a plain Llama folder.
    llama = convert(src.output_dir / "checkpoint-6", tmp_path / "llama", "--llama")
    assert json.loads((llama / "config.json").read_text())["model_type"] == "llama"
    converted, exported = load_file(llama / "model.safetensors"), load_file(src.output_dir / "model.safetensors")
    assert converted.keys() == exported.keys() and all(torch.equal(converted[k], exported[k]) for k in exported)


def convert(checkpoint, out, *flags):
    """recipes/convert_checkpoint.py in one process, as a user runs it."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "convert_checkpoint.py"), str(checkpoint), str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"wrote {out}" in done.stdout
    return out


# ---------------------------------------------------------------------- checks before the process group


def fake_checkpoint(tmp_path, strategy: str, world: int, micro: int = 4, accumulation: int = 1):
    path = tmp_path / "out" / "checkpoint-3"
    path.mkdir(parents=True)
    loader = {"epoch": 0, "step": 3, "seed": 0, "global_batch_size": micro * accumulation * world, "num_blocks": 64}
    state = {
        "step": 3, "loader": loader,
        "run_config": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation},
        "strategy": {"strategy": strategy, "world_size": world},
    }  # fmt: skip
    (path / STATE).write_text(json.dumps(state))
    # what an exact resume reads besides (training/checkpoints/exact.py): the schedule and every rank's random states
    torch.save({"last_epoch": 3}, path / "scheduler.bin")
    for rank in range(world):
        states = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                  "torch_manual_seed": torch.get_rng_state()}  # fmt: skip
        torch.save(states, path / f"random_states_{rank}.pkl")
    (path / MARKER).write_text("{}")
    return path


def test_global_batch_size_derives_the_accumulation(tmp_path):
    parsed = RunConfig(per_device_train_batch_size=4, global_batch_size=32, output_dir=str(tmp_path))
    cfg = parsed.resolve(2)
    assert cfg.gradient_accumulation_steps == 4 and cfg.global_batch(2) == 32
    assert parsed.gradient_accumulation_steps == 1  # the parsed flags are left as they were
    with pytest.raises(ValueError, match=r"30 is not a multiple of micro 4 x data-parallel ranks 2 = 8"):
        RunConfig(per_device_train_batch_size=4, global_batch_size=30).accumulation(2)
    with pytest.raises(ValueError, match="--gradient_accumulation_steps 3 contradicts --global_batch_size 32"):
        RunConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, global_batch_size=32).validate(2)


def test_resume_checks_before_the_process_group(tmp_path):
    path = fake_checkpoint(tmp_path, "zero2", 2)
    cfg = RunConfig(per_device_train_batch_size=4, output_dir=str(tmp_path / "out"), resume_from_checkpoint="auto")
    check_resume(cfg, Strategy.from_name("fsdp", 2))  # same global batch, a strategy that converts
    with pytest.raises(ValueError, match="pass --global_batch_size 8"):
        check_resume(cfg, Strategy.from_name("zero2", 4))
    with pytest.raises(ValueError, match="zero3-offload-nvme is not converted .* resume under the strategy and ranks"):
        check_resume(cfg, Strategy.from_name("zero3-offload-nvme", 2))
    fake_checkpoint(tmp_path / "fsdp1", "fsdp1", 2)
    cfg = dataclasses.replace(cfg, resume_from_checkpoint=str(tmp_path / "fsdp1" / "out" / "checkpoint-3"))
    with pytest.raises(ValueError, match="the checkpoint's fsdp1 is not converted"):
        check_resume(cfg, Strategy.from_name("zero3", 2))
    check_resume(cfg, Strategy.from_name("fsdp1", 2))  # the strategy and ranks that wrote it: loaded natively
    assert path.is_dir()
