"""On one CUDA GPU (`make test-gpu`, `pytest -m gpu`; every test here skips without one): every config of
accelerate_configs/ and ds_configs/ that one GPU can run trains in bf16 as one process does, compiled training
trains, and a checkpoint resumes under another strategy. fp16 loss scaling and the CUDA profiler are checked by
test_precision.py and test_debugging.py (also marked gpu).

Each launch is the `tiny` preset on the suite's small corpus, bf16, 20 steps, one GPU. GPU kernels are not
bitwise deterministic and bf16 rounds every matmul, so the tolerance is looser than on CPU: every step's loss within
GPU_RTOL of one process in the same precision (autocast for DDP and FSDP, DeepSpeed bf16 for ZeRO), and the loss
falling over the run."""

from __future__ import annotations

import shutil

import pytest
import torch
from launching import ROOT, launch, launcher_command

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 20
GPU_RTOL = 2e-2  # relative, every step, against one process in the same precision
# 5e-4: at 1e-3 the loss spikes at step 9 (5.2 after 2.9), where two runs' bf16 rounding, a few 1e-4 apart before,
# lands 3-50% apart: no fixed tolerance holds there.
TRAIN = [
    "--preset=tiny", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=5e-4", "--logging_steps=1",
    "--eval_steps=0", "--save_steps=0", "--sample_max_new_tokens=0", "--per_device_train_batch_size=8", "--bf16",
]  # fmt: skip
ACCELERATE = ["single", "ddp", "fsdp", "fsdp_shard_grad_op", "fsdp_offload", "fsdp1", "zero1", "zero2", "zero2_offload",
              "zero3", "zero3_offload_cpu", "zero3_offload_nvme"]  # fmt: skip
DEEPSPEED = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload_cpu", "zero3_offload_nvme",
             "zero3_offload_nvme_small_host"]  # fmt: skip
# The configs one GPU cannot run, and why.
NOT_ON_ONE_GPU = {
    "accelerate_configs/autotp.yaml": "tensor parallelism splits each layer over 2 ranks",
    "ds_configs/autotp.json": "tensor parallelism splits each layer over 2 ranks",
    "accelerate_configs/fsdp_tp.yaml": "dp_shard 2 x tp 2: 4 ranks",
    "accelerate_configs/fsdp_hybrid_multinode.yaml": "two machines",
    "accelerate_configs/multinode_zero3.yaml": "two machines",
    **{
        f"accelerate_configs/{c}_sp.yaml": "sequence parallelism splits each sequence over 2 ranks"
        for c in ("zero1", "zero2", "zero3", "zero3_offload_cpu")
    },  # fmt: skip
}


def needs_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (make test-gpu on a GPU machine)")


def test_every_config_is_run_or_said_why_not():
    """No config escapes the one-GPU matrix unnoticed: each is launched below or listed with its reason."""
    configs = {str(p.relative_to(ROOT)) for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    configs |= {str(p.relative_to(ROOT)) for p in (ROOT / "ds_configs").glob("*.json")}
    launched = {f"accelerate_configs/{c}.yaml" for c in ACCELERATE} | {f"ds_configs/{c}.json" for c in DEEPSPEED}
    assert configs == launched | set(NOT_ON_ONE_GPU)


def one_gpu(launcher: str, config: str | None) -> list[str]:
    cmd = launcher_command(launcher, config, nproc=1)
    if launcher == "accelerate":  # the YAMLs say 2 processes
        cmd[-1:-1] = ["--num_processes", "1"]
    return cmd


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process in bf16 under autocast, and under DeepSpeed bf16 (bf16 weights), each launched once."""
    runs = {}

    def get(zero: bool):
        if zero not in runs:
            out = tmp_path_factory.mktemp(f"reference-{'deepspeed' if zero else 'autocast'}")
            extra = ["--deepspeed=ds_configs/zero2.json"] if zero else []
            runs[zero] = launch(
                one_gpu("torchrun" if zero else "python", None), [*corpus["flags"], *TRAIN, *extra], out
            )
        return runs[zero]

    return get


def assert_trains_like(run, ref) -> None:
    losses, ref_losses = run.losses, ref.losses
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    rel = {s: abs(losses[s] - ref_losses[s]) / ref_losses[s] for s in ref_losses}
    print(f"loss relative differences per step: {[f'{r:.2g}' for r in rel.values()]}")
    assert max(rel.values()) <= GPU_RTOL, rel
    assert losses[STEPS] < losses[1] - 0.5, f"the loss did not fall: {losses[1]} -> {losses[STEPS]}"


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("launcher", "config"),
    [("accelerate", c) for c in ACCELERATE] + [("deepspeed", c) for c in DEEPSPEED],
    ids=[f"accelerate-{c}" for c in ACCELERATE] + [f"deepspeed-{c}" for c in DEEPSPEED],
)
def test_config_trains_on_one_gpu_as_one_process(launcher, config, corpus, reference, tmp_path):
    needs_gpu()
    args = [*corpus["flags"], *TRAIN]
    if launcher == "deepspeed":
        args.append(f"--deepspeed=ds_configs/{config}.json")
    if "nvme" in config:
        args.append(f"--nvme_path={tmp_path}")
    run = launch(one_gpu(launcher, config), args, tmp_path / "out")
    assert run.strategy["world_size"] == 1
    assert_trains_like(run, reference(run.strategy["zero_stage"] > 0))


@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config"), [("python", None), ("accelerate", "fsdp"), ("accelerate", "zero3")])
def test_compiled_training_trains(launcher, config, corpus, reference, tmp_path):
    """--torch_compile on the GPU: gradients flow (a zero-gradient first step would stop the run), the compile time is
    logged apart and the losses are eager's within GPU_RTOL."""
    needs_gpu()
    run = launch(one_gpu(launcher, config), [*corpus["flags"], *TRAIN, "--torch_compile"], tmp_path / "out")
    assert run.strategy["compiled"] is True
    assert run.records[0]["compile_time_s"] > 0
    assert all(r["grad_norm"] > 0 for r in run.records if "loss" in r)
    assert_trains_like(run, reference(run.strategy["zero_stage"] > 0))


@pytest.mark.multiproc
def test_a_zero2_checkpoint_resumes_under_fsdp(corpus, tmp_path):
    """A ZeRO-2 run saved at step 10 (deepspeed launcher) continues under FSDP2 (accelerate): steps 11-20 log the
    straight run's losses within GPU_RTOL."""
    needs_gpu()
    flags = [*corpus["flags"], *TRAIN, "--save_steps=10"]
    straight = launch(one_gpu("deepspeed", "zero2"), [*flags, "--deepspeed=ds_configs/zero2.json"], tmp_path / "a")
    out = tmp_path / "b"
    shutil.copytree(straight.output_dir / "checkpoint-10", out / "checkpoint-10")
    resumed = launch(one_gpu("accelerate", "fsdp"), [*flags, "--resume_from_checkpoint=auto"], out)
    losses = resumed.own_losses
    assert sorted(losses) == list(range(11, STEPS + 1))
    rel = {s: abs(losses[s] - straight.losses[s]) / straight.losses[s] for s in losses}
    assert max(rel.values()) <= GPU_RTOL, rel
