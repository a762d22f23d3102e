"""bf16, --gradient_checkpointing and --torch_compile train the same model under every strategy (2 CPU ranks).

Each cell is a short launch (`debug` preset, STEPS steps, global batch 8) checked against one process in the same
precision at every step's loss and at the exported weights, with the precision in force read from the prepared
objects (strategy.json). Tolerances, from the worst case measured on 2 CPU cores over the cells below (per cell:
docs/precision.md):

- gradient checkpointing and torch.compile (fp32), against one eager fp32 process: test_strategies.py's fp32
  tolerance FP32_RTOL (1e-6 relative at step 1, 1e-5 after). Activation checkpointing is read off four of
  tests/recipes/parity.py's 20-step cells (DDP, FSDP2, ZeRO-2, ZeRO-3), which run with it. Measured: at most
  9.4e-8 with checkpointing, 9.8e-8 compiled (inductor's fused kernels round like eager here, several cells
  bitwise). Exported weights FP32_EXPORT: measured at most 1.9e-5 max and 2.6e-9 mean absolute difference.
- bf16, DDP and FSDP2, against one process under autocast: AUTOCAST_RTOL = 1e-3. Measured: DDP 3.1e-5; FSDP2
  3.0e-4: it computes with bf16 parameters and no autocast, rounding the weights autocast keeps in fp32
  (RMSNorm, embedding) and the activations between layers.
- bf16, ZeRO, against one process under DeepSpeed bf16 (`torchrun --nproc_per_node 1 recipes/train.py --deepspeed
  ds_configs/zero2.json --bf16`): like with like, ZERO_RTOL = 5e-4. Measured: at most 5.7e-5. bf16 weights and
  autocast differ by more than either differs from its own one-process run (measured: the two one-process runs
  differ by up to 2.8e-4), so comparing like with like proves more.
- bf16 exported weights BF16_EXPORT: Adam moves each weight by up to about the learning rate per step whatever the
  gradient's size, so a weight whose gradient is near zero can move the other way in bf16: the max absolute
  difference (measured 7.0e-3) says little; the mean (measured at most 5.1e-5) is the check.
The logged losses must not be bf16-rounded: every one must differ from its value rounded to bf16.

fp32 under every accelerate config is tests/recipes/test_strategies.py. The widest cells carry the `matrix` marker
(`make test-matrix`, also run by CI).
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import ROOT, launch, launcher_command
from parity import CHECKPOINTING, cell_run, reference_run
from safetensors.torch import load_file

from recipes.compare import parse_args, train_flags
from training.compare.report import Result, Spec, add_loss_differences, per_precision
from training.config import RunConfig
from training.core.fsdp import fsdp_precision
from training.deepspeed_config import load_json, resolve_deepspeed

STEPS = 4
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=1", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=2", "--save_steps=0", "--sample_max_new_tokens=0",
]  # fmt: skip
ONE, TWO = ["--per_device_train_batch_size=8"], ["--per_device_train_batch_size=4"]
FP32_RTOL = (1e-6, 1e-5)  # step 1, later steps: test_strategies.py's measured fp32 tolerance
AUTOCAST_RTOL = 1e-3  # bf16 against one process under autocast (DDP, FSDP2)
ZERO_RTOL = 5e-4  # bf16 ZeRO against one process under DeepSpeed bf16
FP32_EXPORT = (1e-4, 1e-7)  # max, mean absolute difference of the exported weights
BF16_EXPORT = (2e-2, 2.5e-4)
matrix = pytest.mark.matrix

# The precision the prepared objects must show under --bf16 (docs/precision.md).
AUTOCAST = {"parameter_dtypes": ["float32"], "autocast": True}
FSDP_BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": "float32"}
ZERO_BF16 = {"bf16": True, "fp16": False, "communication_data_type": "float32", "grad_accum_dtype": "float32"}


def cell(config: str, *marks, launcher: str = "accelerate"):
    """One launch of the matrix, named by its config (and its launcher unless accelerate's)."""
    name = config if launcher == "accelerate" else f"{launcher}-{config}"
    return pytest.param(launcher, config, id=name, marks=marks)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One-process runs, each launched once for all the cells of this module that need it: fp32, bf16 (autocast)
    and DeepSpeed bf16 (under torchrun: DeepSpeed needs the launcher's process group even for one rank)."""
    runs = {}
    kinds = {
        "fp32": ("python", []),
        "bf16": ("python", ["--bf16"]),
        "deepspeed-bf16": ("torchrun", ["--bf16", "--deepspeed=ds_configs/zero2.json"]),
    }

    def get(kind: str):
        if kind not in runs:
            launcher, extra = kinds[kind]
            out = tmp_path_factory.mktemp(f"reference-{kind}")
            runs[kind] = launch(launcher_command(launcher, nproc=1), [*corpus["flags"], *TRAIN, *ONE, *extra], out)
        return runs[kind]

    return get


def launch_cell(launcher, config, flags, corpus, tmp_path, script="train.py"):
    batch = ONE if config == "single" else TWO  # single.yaml: one process takes the whole global batch
    nvme = [f"--nvme_path={tmp_path}"] if "nvme" in config else []
    args = [*corpus["flags"], *TRAIN, *batch, *flags, *nvme]
    if launcher in ("deepspeed", "torchrun") and config:
        args.append(f"--deepspeed=ds_configs/{config}.json")
    return launch(launcher_command(launcher, config, script=script), args, tmp_path / "out")


def differences(run, ref) -> tuple[list[float], float, float]:
    """Per-step relative loss differences, and the largest and the mean absolute difference of the exported
    weights (which Adam moves by up to about the learning rate per step, so the mean says more in bf16)."""
    losses, ref_losses = run.losses, ref.losses
    assert sorted(losses) == sorted(ref_losses) == list(range(1, max(ref_losses) + 1))
    rel = [abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in sorted(ref_losses)]
    ours, theirs = load_file(run.output_dir / "model.safetensors"), load_file(ref.output_dir / "model.safetensors")
    assert ours.keys() >= theirs.keys()
    for key in ours.keys() - theirs.keys():  # the compiled Trainer's export also stores the tied lm_head
        assert any(torch.equal(ours[key], ours[k]) for k in theirs), f"{key} is not a copy of a tied weight"
    diff = torch.cat([(ours[k].float() - theirs[k].float()).abs().flatten() for k in theirs])
    worst, mean = diff.max().item(), diff.mean().item()
    print(f"loss relative differences per step {[f'{r:.2g}' for r in rel]}; exported weights: max abs {worst:.3g}, "
          f"mean abs {mean:.3g}")  # fmt: skip
    return rel, worst, mean


def assert_close(run, ref, rtol: tuple[float, float], export: tuple[float, float]) -> None:
    """Losses within `rtol` (step 1, later steps); exported weights within `export` (max, mean absolute)."""
    rel, worst, mean = differences(run, ref)
    assert rel[0] <= rtol[0] and max(rel) <= rtol[1], f"loss relative differences {rel} exceed {rtol}"
    assert worst <= export[0] and mean <= export[1], f"exported weights differ by up to {worst} (mean {mean})"


def assert_not_bf16_rounded(run) -> None:
    for step, loss in run.losses.items():
        rounded = torch.tensor(loss).to(torch.bfloat16).item()
        assert rounded != loss, f"step {step}: the logged loss {loss} is a bf16 value (rounded in the model)"


def assert_bf16_in_force(seen: dict) -> None:
    if seen["zero_stage"]:
        assert seen["parameter_dtypes"] == ["bfloat16"] and seen["deepspeed_precision"] == ZERO_BF16, seen
    elif "fsdp_mixed_precision" in seen:  # fp32 shards, gathered in bf16 for the forward and backward
        assert seen["fsdp_mixed_precision"] == FSDP_BF16 and seen["parameter_dtypes"] == ["float32"], seen
    else:
        assert {k: seen[k] for k in AUTOCAST} == AUTOCAST, seen


BF16_CELLS = [
    cell("ddp"), cell("fsdp"), cell("zero2"), cell("zero3", launcher="deepspeed"),
    *(cell(c, matrix) for c in ("single", "fsdp_shard_grad_op", "fsdp_offload", "zero1", "zero2_offload", "zero3",
                                "zero3_offload_cpu", "zero3_offload_nvme")),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config"), BF16_CELLS)
def test_bf16_trains_as_one_process_in_bf16(launcher, config, corpus, reference, tmp_path):
    """--bf16: the same losses as one process in bf16 (AUTOCAST_RTOL, ZERO_RTOL), never bf16-rounded, with the
    project's precision in force: bf16 compute, fp32 master weights, fp32 gradient reduction and loss."""
    run = launch_cell(launcher, config, ["--bf16"], corpus, tmp_path)
    assert_bf16_in_force(run.strategy)
    assert_not_bf16_rounded(run)
    zero = run.strategy["zero_stage"] > 0
    rtol = ZERO_RTOL if zero else AUTOCAST_RTOL
    assert_close(run, reference("deepspeed-bf16" if zero else "bf16"), (rtol, rtol), BF16_EXPORT)


@pytest.mark.slow
@pytest.mark.multiproc
@matrix
@pytest.mark.parametrize(("config", "nproc", "micro"), [("ddp", 2, 4), ("fsdp", 4, 2)], ids=["pp2", "fsdp-pp2"])
def test_bf16_pipeline_trains_as_one_process_in_bf16(config, nproc, micro, corpus, reference, tmp_path):
    """--bf16 under 2 pipeline stages (alone on 2 ranks; FSDP2-sharded stages on 4): the schedule runs under
    accelerate's autocast (and FSDP2's bf16 policy), losses as one process's in bf16, never bf16-rounded."""
    cmd = launcher_command("accelerate", config)
    cmd[-1:-1] = ["--num_processes", str(nproc)]  # before the script: an accelerate flag
    pipeline = [
        "--pipeline_parallel_degree=2",
        "--gradient_accumulation_steps=2",
        f"--per_device_train_batch_size={micro}",
    ]
    run = launch(cmd, [*corpus["flags"], *TRAIN, *pipeline, "--bf16"], tmp_path / "out")
    assert run.strategy["pipeline"]["degree"] == 2
    assert_bf16_in_force(run.strategy)
    assert_not_bf16_rounded(run)
    assert_close(run, reference("bf16"), (AUTOCAST_RTOL, AUTOCAST_RTOL), BF16_EXPORT)


MODE_CELLS = [cell("ddp"), cell("fsdp"), cell("zero2"), cell("zero3")]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "config"), MODE_CELLS)
def test_gradient_checkpointing_trains_the_same(launcher, config, corpus, tmp_path_factory):
    """--gradient_checkpointing recomputes each layer in the backward: fp32 tolerance of one process without it.
    The launches are tests/recipes/parity.py's cells of these configs, which run with it (20 steps), against its
    one process."""
    assert (launcher, config) in CHECKPOINTING
    run = cell_run(launcher, config, corpus, tmp_path_factory)
    assert json.loads((run.output_dir / "run_config.json").read_text())["gradient_checkpointing"] is True
    assert_close(run, reference_run(corpus, tmp_path_factory), FP32_RTOL, FP32_EXPORT)


@pytest.mark.slow
@pytest.mark.multiproc
@matrix
@pytest.mark.parametrize(("launcher", "config"), [*MODE_CELLS, cell("fsdp_tp")])
def test_torch_compile_trains_the_same(launcher, config, corpus, reference, tmp_path):
    """--torch_compile (inductor) under each strategy: each decoder layer is compiled before the strategy wraps the
    model (the `debug` preset's 2), the losses match one eager process within FP32_RTOL, the export works, and
    compile time is logged apart. FSDP2 x TP on 4 ranks too: the compiled first layer takes the embedding's
    reduce-scattered rows once they have arrived (training/axes/tensor/plan.arrive_before_compiled), and the compiled
    layers keep torch's layout of the saved activations."""
    run = launch_cell(launcher, config, ["--torch_compile"], corpus, tmp_path)
    assert run.strategy["compiled_blocks"] == 2, run.strategy
    assert_compiled_run(run, reference("fp32"))


@pytest.mark.slow
@pytest.mark.multiproc
@matrix
def test_trainer_path_compiles(corpus, reference, tmp_path):
    """recipes/trainer.py with --torch_compile (TrainingArguments.torch_compile) under ZeRO-2 via torchrun: compiled,
    compile time logged apart, the losses of one eager process within FP32_RTOL."""
    run = launch_cell("torchrun", "zero2", ["--torch_compile"], corpus, tmp_path, script="trainer.py")
    assert_compiled_run(run, reference("fp32"))


def assert_compiled_run(run, ref) -> None:
    assert run.strategy["compiled"] is True, run.strategy
    first = run.records[0]
    assert first["compile_time_s"] > 0 and first["tokens_per_sec"] is None, first
    assert all(r["tokens_per_sec"] > 0 for r in run.records[1:] if "loss" in r)
    assert_close(run, ref, FP32_RTOL, FP32_EXPORT)


@pytest.mark.slow
@pytest.mark.multiproc
@matrix
def test_trainer_in_bf16_trains_as_train_py(corpus, tmp_path):
    """The HF Trainer path (recipes/trainer.py) in bf16 under ZeRO-2 (torchrun) trains what recipes/train.py trains
    with the same launch: same JSON, same precision in force (the Trainer reads the JSON's fp32 communication and
    accumulation), losses within ZERO_RTOL, never bf16-rounded."""
    ref = launch_cell("torchrun", "zero2", ["--bf16"], corpus, tmp_path / "train")
    run = launch_cell("torchrun", "zero2", ["--bf16"], corpus, tmp_path / "trainer", script="trainer.py")
    assert_bf16_in_force(run.strategy)
    assert_not_bf16_rounded(run)
    assert_close(run, ref, (ZERO_RTOL, ZERO_RTOL), BF16_EXPORT)


# ------------------------------------------------------------------ the definition, without launching


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json")))
def test_every_deepspeed_json_reduces_and_accumulates_in_fp32(name, tmp_path):
    """Under --bf16 every JSON resolves to fp32 gradient communication and accumulation (DeepSpeed's default would
    be bf16); --bf16_gradient_reduction with a JSON that fixes fp32 is refused, naming the key, and sets bf16 in
    the one JSON that leaves both "auto" for it (zero3_offload_nvme_small_host.json)."""
    ds = load_json(ROOT / "ds_configs" / f"{name}.json")
    flags = {"output_dir": str(tmp_path), "bf16": True, "nvme_path": str(tmp_path)}
    out = resolve_deepspeed(ds, RunConfig(**flags), 2, 64, name)
    assert out["bf16"]["enabled"] is True
    assert (out["communication_data_type"], out["data_types"]) == ("fp32", {"grad_accum_dtype": "fp32"})
    if ds.get("communication_data_type") == "auto":
        assert name == "zero3_offload_nvme_small_host"
        out = resolve_deepspeed(ds, RunConfig(**flags, bf16_gradient_reduction=True), 2, 64, name)
        assert (out["communication_data_type"], out["data_types"]) == ("bf16", {"grad_accum_dtype": "bf16"})
        return
    with pytest.raises(ValueError, match="communication_data_type = 'fp32'.*--bf16_gradient_reduction"):
        resolve_deepspeed(ds, RunConfig(**flags, bf16_gradient_reduction=True), 2, 64, name)


def test_bf16_gradient_reduction_is_an_explicit_opt_in(tmp_path):
    """The opt-in fills "auto" with bf16 under DeepSpeed and lowers FSDP2's reduce_dtype; the loss stays fp32."""
    ds = {
        "zero_optimization": {"stage": 2},
        "communication_data_type": "auto",
        "data_types": {"grad_accum_dtype": "auto"},
    }
    low = RunConfig(output_dir=str(tmp_path), bf16=True, bf16_gradient_reduction=True)
    out = resolve_deepspeed(ds, low, 2, 64, "x")
    assert (out["communication_data_type"], out["data_types"]["grad_accum_dtype"]) == ("bf16", "bf16")
    policy = fsdp_precision(low)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16,) * 2 + (torch.float32,)
    policy = fsdp_precision(RunConfig(output_dir=str(tmp_path), bf16=True))
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16,) + (torch.float32,) * 2
    with pytest.raises(ValueError, match="--bf16_gradient_reduction needs --bf16"):
        RunConfig(output_dir=str(tmp_path), bf16_gradient_reduction=True).validate(1)


def test_compare_runs_every_strategy_in_each_precision():
    """recipes/compare.py --precisions: each strategy once per precision, with that precision's flag, and each
    run's loss difference taken from DDP in the same precision and from the same strategy in fp32."""
    args, extra = parse_args(["--strategies", "ddp,fsdp", "--precisions", "fp32,bf16"])
    specs = per_precision(
        [Spec(n, "accelerate", ROOT / "recipes" / "train.py") for n in ("ddp", "fsdp")], args.precisions
    )
    assert [s.name for s in specs] == ["ddp fp32", "ddp bf16", "fsdp fp32", "fsdp bf16"]
    assert ["--bf16" in train_flags(args, s, extra) for s in specs] == [False, True, False, True]
    losses = {"ddp fp32": 9.0, "ddp bf16": 9.5, "fsdp fp32": 9.25, "fsdp bf16": 10.0}
    results = [Result(s.name, "accelerate", "", s.precision, ok=True, losses={1: losses[s.name]}) for s in specs]
    add_loss_differences(results)
    fsdp_bf16 = results[-1]
    assert (fsdp_bf16.loss_diff_vs_ddp, fsdp_bf16.loss_diff_vs_fp32) == (0.5, 0.75)
    assert results[2].loss_diff_vs_ddp == 0.25 and results[2].loss_diff_vs_fp32 is None
    assert (results[0].loss_diff_vs_ddp, results[1].loss_diff_vs_ddp) == (0, 0)  # DDP's rows against themselves
    with pytest.raises(SystemExit):
        parse_args(["--precisions", "fp32,bf16", "--bf16"])  # the precision is compare.py's to set


def test_compiled_ddp_is_read_through_not_rewritten(tmp_path):
    """observe_strategy sees the DDP inside torch.compile's wrapper and leaves the wrapper's `_orig_mod` as it was
    (accelerate's `unwrap_model` would set it to the bare model, dropping DDP from the compiled forward). One gloo
    rank in this process; nothing is compiled until a forward, which this test does not run."""
    from torch.distributed import FileStore, destroy_process_group, init_process_group

    from training.core.inspection import observe_strategy
    from training.core.wrapped import uncompiled
    from training.strategy import Strategy

    init_process_group("gloo", store=FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        compiled = torch.compile(ddp)
        seen = observe_strategy(compiled, torch.optim.AdamW(ddp.parameters()), Strategy.of("single"))
        assert compiled._orig_mod is ddp and uncompiled(compiled) is ddp
        assert seen["compiled"] is True and seen["engine"] == "DistributedDataParallel", seen
    finally:
        destroy_process_group()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("launcher", "deepspeed"), [("python", None), ("torchrun", "zero2")], ids=["gradscaler", "zero2"]
)
def test_fp16_overflow_skips_the_step_and_is_counted(launcher, deepspeed, corpus, tmp_path):
    """fp16 with loss scaling (accelerate's GradScaler in one process, DeepSpeed's dynamic loss scale): a step
    whose loss and gradients are not finite (the `nan@3` fault) is skipped by the scaler and counted in
    `overflow_skipped_steps`, and the run goes on to its last step instead of stopping as fp32 and bf16 do."""
    if not torch.cuda.is_available():
        pytest.skip(
            "fp16 loss scaling needs a CUDA GPU: on CPU accelerate runs no fp16 AMP and the script refuses fp16"
        )
    cmd = launcher_command(launcher, nproc=1)
    args = [*corpus["flags"], *TRAIN, *ONE, "--fp16", "--max_steps=6"]
    if deepspeed:
        args.append(f"--deepspeed=ds_configs/{deepspeed}.json")
    run = launch(cmd, args, tmp_path / "out", env={"SHARDGPT_FAULT": "nan@3"})
    losses = run.own_losses
    assert sorted(losses) == list(range(1, 7)), f"the run stopped early: {sorted(losses)}"
    skipped = [r["overflow_skipped_steps"] for r in run.records if "overflow_skipped_steps" in r]
    assert skipped and skipped[-1] >= 1, f"no skipped step counted: {skipped}"
