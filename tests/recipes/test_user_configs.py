"""Configs in the shapes users bring them, written here as `accelerate config`, accelerate's, transformers' and
DeepSpeed's docs write them: each trains on 2 CPU ranks (gloo) the same model as one process, or is refused before
any process group in one `error:` line naming the field and the fix.

Parity: same seed, initial weights, data order and global batch (8 sequences). fp32 launches must equal the
one-process run at every step within the tolerances of test_strategies.py (1e-6 relative at step 1, 1e-5 after;
measured there at most 1.2e-7). The HF docs' JSONs bring DeepSpeed's own optimizer and `WarmupLR` scheduler, so
their reference is one rank of the same JSON. The strategy in force is read from `strategy.json`, which the script
writes from the prepared objects.
"""

from __future__ import annotations

import json

import pytest
from launching import BIN, ROOT, accelerate_with, free_port, launch, launcher_command

STEPS = 6
TRAIN = [
    "--preset=debug", f"--max_steps={STEPS}", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--max_eval_batches=2", "--save_steps=0", "--sample_max_new_tokens=0",
]  # fmt: skip
ONE, TWO = ["--per_device_train_batch_size=8"], ["--per_device_train_batch_size=4"]
# bf16 autocast against the fp32 reference: see test_bf16_from_the_yaml_is_in_force_and_trains_alike.
BF16_RTOL = 2e-2

LAUNCH_TAIL = """\
compute_environment: LOCAL_MACHINE
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def fsdp_yaml(mixed_precision: str = "'no'", **fields) -> str:
    """An FSDP YAML as `accelerate config` writes it (its keys sorted, as the questionnaire saves them)."""
    body = "".join(f"  {k}: {v}\n" for k, v in sorted(fields.items()))
    return f"distributed_type: FSDP\nfsdp_config:\n{body}mixed_precision: {mixed_precision}\n{LAUNCH_TAIL}"


def deepspeed_yaml(mixed_precision: str = "'no'", **fields) -> str:
    body = "".join(f"  {k}: {v}\n" for k, v in sorted(fields.items()))
    return f"deepspeed_config:\n{body}distributed_type: DEEPSPEED\nmixed_precision: {mixed_precision}\n{LAUNCH_TAIL}"


# The FSDP1 YAML of `accelerate config` (accelerate's docs' example, with this model's layer class).
FSDP1 = dict(
    fsdp_version=1, fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP", fsdp_backward_prefetch="BACKWARD_PRE",
    fsdp_cpu_ram_efficient_loading="true", fsdp_forward_prefetch="false", fsdp_offload_params="false",
    fsdp_sharding_strategy="FULL_SHARD", fsdp_state_dict_type="FULL_STATE_DICT", fsdp_sync_module_states="true",
    fsdp_transformer_layer_cls_to_wrap="ShardGPTDecoderLayer", fsdp_use_orig_params="true",
)  # fmt: skip
FSDP2 = dict(
    fsdp_version=2, fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP", fsdp_cpu_ram_efficient_loading="true",
    fsdp_offload_params="false", fsdp_reshard_after_forward="true", fsdp_state_dict_type="SHARDED_STATE_DICT",
    fsdp_transformer_layer_cls_to_wrap="ShardGPTDecoderLayer",
)  # fmt: skip
# The inline DeepSpeed YAML of `accelerate config`.
INLINE = dict(gradient_accumulation_steps=1, gradient_clipping=1.0, offload_optimizer_device="none",
              offload_param_device="none", zero3_init_flag="false", zero_stage=2)  # fmt: skip

# The HF docs' (transformers, "DeepSpeed" guide) all-"auto" ZeRO-2 and ZeRO-3 configs.
HF_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
HF_SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}}  # fmt: skip
HF_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"}, "optimizer": HF_OPTIMIZER, "scheduler": HF_SCHEDULER,
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}  # fmt: skip
HF_ZERO2 = {**HF_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True}}  # fmt: skip
HF_ZERO3 = {**HF_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}  # fmt: skip

HALF, WHOLE = 0.5, 1.0
# name: (YAML, the strategy in force, (parameter, gradient, optimizer-state) shares, other fields of strategy.json)
TRAINED = {
    "fsdp1-full-shard": (fsdp_yaml(**FSDP1), "fsdp1", (HALF, HALF, HALF),
                         {"engine": "FullyShardedDataParallel", "fsdp_sharding_strategy": ["FULL_SHARD"],
                          "fsdp_flat_parameters": 3}),
    "fsdp1-shard-grad-op-size-wrap": (
        fsdp_yaml(**{**FSDP1, "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                     "fsdp_min_num_params": 40000, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                     "fsdp_backward_prefetch": "BACKWARD_POST"}),
        "fsdp1-shard-grad-op", (HALF, HALF, HALF),
        {"engine": "FullyShardedDataParallel", "fsdp_sharding_strategy": ["SHARD_GRAD_OP"]}),
    "fsdp1-no-shard-no-wrap": (
        fsdp_yaml(**{**FSDP1, "fsdp_sharding_strategy": "NO_SHARD", "fsdp_auto_wrap_policy": "NO_WRAP"}),
        "fsdp1-no-shard", (WHOLE, WHOLE, WHOLE),
        {"engine": "FullyShardedDataParallel", "fsdp_sharding_strategy": ["NO_SHARD"], "fsdp_flat_parameters": 1}),
    "fsdp2-no-wrap": (fsdp_yaml(**{**FSDP2, "fsdp_auto_wrap_policy": "NO_WRAP"}), "fsdp", (HALF, HALF, HALF),
                      {"engine": "FSDPShardGPTForCausalLM", "reshard_after_forward": []}),
    "deepspeed-inline-zero1": (deepspeed_yaml(**{**INLINE, "zero_stage": 1}), "zero1", (WHOLE, HALF, HALF),
                               {"engine": "DeepSpeedEngine", "zero_stage": 1}),
    "deepspeed-inline-zero2-offload-cpu": (
        deepspeed_yaml(**{**INLINE, "offload_optimizer_device": "cpu"}), "zero2-offload-cpu", (WHOLE, HALF, HALF),
        {"engine": "DeepSpeedEngine", "zero_stage": 2, "offload_optimizer": "cpu"}),
    "deepspeed-inline-zero3-offload-cpu": (
        deepspeed_yaml(**{**INLINE, "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
                          "zero3_init_flag": "true", "zero3_save_16bit_model": "true"}),
        "zero3-offload-cpu", (HALF, HALF, HALF),
        {"engine": "DeepSpeedEngine", "zero_stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}),
}  # fmt: skip


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process, micro batch 8, fp32: the losses of every plain-optimizer launch below."""
    out = tmp_path_factory.mktemp("reference")
    return launch(launcher_command("python"), [*corpus["flags"], *TRAIN, *ONE], out)


@pytest.fixture(scope="module")
def deepspeed_reference(corpus, tmp_path_factory):
    """One rank of the HF docs' ZeRO-2 JSON: DeepSpeed's AdamW (its CPU Adam under offload) and WarmupLR, which
    ZeRO-3 runs alike (the stage changes where the numbers live, not the arithmetic)."""
    tmp = tmp_path_factory.mktemp("deepspeed_reference")
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()), str(ROOT / "recipes/train.py")]
    args = [*corpus["flags"], *TRAIN, *ONE, f"--deepspeed={write(tmp, 'hf_zero2.json', json.dumps(HF_ZERO2))}"]
    return launch(cmd, args, tmp / "out")


def assert_same_losses(run, reference, rtol: float | None = None) -> float:
    """Every step's loss equals the reference's; returns the worst relative difference."""
    losses, ref = run.losses, reference.losses
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    worst = max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"losses: worst relative difference {worst:.3g}")
    for step in ref:
        tol = rtol or (1e-6 if step == 1 else 1e-5)
        assert losses[step] == pytest.approx(ref[step], rel=tol), f"step {step}: {losses[step]} vs {ref[step]}"
    return worst


def assert_in_force(seen: dict, strategy: str, shares: tuple, fields: dict) -> None:
    assert seen["strategy"] == strategy and seen["world_size"] == 2, seen
    got = (seen["local_parameter_fraction"], seen["local_gradient_fraction"], seen["local_optimizer_state_fraction"])
    assert got == pytest.approx(shares, abs=0.02), f"(params, grads, optimizer states) {got}; {seen}"
    for key, value in fields.items():
        assert seen.get(key) == value, f"{key}: {seen}"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TRAINED))
def test_user_config_trains_the_same_model(name, corpus, reference, tmp_path):
    yaml, strategy, shares, fields = TRAINED[name]
    cmd = accelerate_with(write(tmp_path, f"{name}.yaml", yaml))
    run = launch(cmd, [*corpus["flags"], *TRAIN, *TWO], tmp_path / "out")
    assert_in_force(run.strategy, strategy, shares, {**fields, "mixed_precision": "no"})
    assert (run.output_dir / "model.safetensors").exists()
    assert_same_losses(run, reference)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "launcher"), [("hf-zero2-auto", "deepspeed"), ("hf-zero3-auto", "accelerate")], ids=str
)
def test_hf_docs_auto_json_trains_like_one_rank_of_it(name, launcher, corpus, deepspeed_reference, tmp_path):
    """The HF docs' JSONs, every value "auto", with DeepSpeed's optimizer and scheduler blocks: through the
    `deepspeed` launcher (ZeRO-2) and an accelerate YAML naming the file (ZeRO-3, with mixed_precision: 'no')."""
    ds = write(tmp_path, f"{name}.json", json.dumps(HF_ZERO2 if "zero2" in name else HF_ZERO3))
    args = [*corpus["flags"], *TRAIN, *TWO]
    if launcher == "deepspeed":
        cmd, args = launcher_command("deepspeed"), [*args, f"--deepspeed={ds}"]
    else:
        cmd = accelerate_with(write(tmp_path, f"{name}.yaml", deepspeed_yaml(deepspeed_config_file=ds)))
    run = launch(cmd, args, tmp_path / "out")
    stage = 2 if "zero2" in name else 3
    strategy, shares = ("zero2-offload-cpu", (WHOLE, HALF, HALF)) if stage == 2 else ("zero3-offload-cpu", (HALF,) * 3)
    fields = {"zero_stage": stage, "offload_optimizer": "cpu", "optimizer_chain": run.strategy["optimizer_chain"]}
    assert_in_force(run.strategy, strategy, shares, fields)
    assert run.strategy["optimizer_chain"][-1] == "DeepSpeedCPUAdam", run.strategy
    resolved = json.loads((run.output_dir / "ds_config.json").read_text())
    assert resolved["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2}
    assert_same_losses(run, deepspeed_reference)


@pytest.mark.slow
@pytest.mark.multiproc
def test_bf16_from_the_yaml_is_in_force_and_trains_alike(corpus, reference, tmp_path):
    """`mixed_precision: bf16` in an FSDP2 YAML, no precision flag: the run is bf16 (accelerate's autocast and
    FSDP2's parameter dtype), recorded in run_config.json, and its losses follow the fp32 run's. Tolerance: bf16 keeps
    8 significant bits (unit roundoff 2^-8 = 3.9e-3 per rounding); measured over these 6 steps, the worst
    difference from the fp32 losses was 2.2e-3 relative. BF16_RTOL = 2e-2 leaves about 9x margin."""
    yaml = write(tmp_path, "fsdp2_bf16.yaml", fsdp_yaml(mixed_precision="bf16", **FSDP2))
    run = launch(accelerate_with(yaml), [*corpus["flags"], *TRAIN, *TWO], tmp_path / "out")
    assert_in_force(run.strategy, "fsdp", (HALF, HALF, HALF), {"mixed_precision": "bf16"})
    assert run.strategy["fsdp_param_dtype"] == ["bfloat16"], run.strategy
    assert json.loads((run.output_dir / "run_config.json").read_text())["bf16"] is True
    assert_same_losses(run, reference, rtol=BF16_RTOL)


# name: (YAML or None for the python launcher, extra flags given tmp_path, the field named, the fix given)
REFUSED = {
    "yaml-bf16-flag-fp16": (fsdp_yaml(mixed_precision="bf16", **FSDP2), lambda t: ["--fp16"],
                            "mixed_precision: bf16 but the flags give --fp16", "drop --fp16"),
    "warmup-decay-lr-without-warmup": (
        None,
        lambda t: ["--warmup_steps=0", "--deepspeed=" + write(t, "decay.json", json.dumps(
            {**HF_ZERO2, "scheduler": {"type": "WarmupDecayLR", "params": {**HF_SCHEDULER["params"],
                                                                           "total_num_steps": "auto"}}}))],
        "scheduler.params.warmup_num_steps = 0", "pass --warmup_steps 1 or more"),
    "fp16-on-cpu": (None, lambda t: ["--fp16"], "(--fp16 or the accelerate config's mixed_precision: fp16) needs a "
                    "CUDA GPU", "pass --bf16 instead"),
    "dataset-offline": (None, lambda t: ["--dataset_name=shardgpt-tests/not-cached", "--train_file=",
                                         "--validation_file="],
                        "--dataset_name 'shardgpt-tests/not-cached'", "pass --train_file"),
    "tokenizer-offline": (None, lambda t: ["--tokenizer_name=shardgpt-tests/not-cached"],
                          "--tokenizer_name 'shardgpt-tests/not-cached'", "HF_HUB_OFFLINE=1"),
}  # fmt: skip
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # the hub refused without touching the network


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.multiproc) if REFUSED[n][0] else n for n in REFUSED]
)  # an accelerate YAML's case is a launch of ranks: with the others that launch, one at a time
def test_user_config_is_refused_in_one_line(name, corpus, tmp_path):
    yaml, extra, field, fix = REFUSED[name]
    cmd = accelerate_with(write(tmp_path, f"{name}.yaml", yaml)) if yaml else launcher_command("python")
    flags = [*corpus["flags"], *TRAIN, *(TWO if yaml else ONE)]
    run = launch(cmd, [*flags, *extra(tmp_path)], tmp_path / "out", check=False, env=OFFLINE)
    assert run.returncode != 0
    # One line per rank, before any process group (two ranks write to one pipe: a line may follow another's text).
    # The launcher stops the other rank as soon as one exits, sometimes before that rank has printed its line.
    errors = [line[line.index("error: ") :] for line in run.stderr.splitlines() if "error: " in line]
    assert 1 <= len(errors) <= (2 if yaml else 1), run.stderr[-3000:]
    assert all(field in line and fix in line for line in errors), errors
    assert "Traceback" not in run.stderr.split(errors[0])[0], run.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_default_warmup_never_refuses_a_short_run():
    """--warmup_ratio 0.1 by default, rounded up as HF's get_warmup_steps: `make train`'s 200 steps keep their 20
    warm-up steps, a 5-step smoke run gets 1; an explicit --warmup_steps (0 included) wins over the ratio."""
    from training.config import RunConfig

    def warmup(**kw) -> int:
        cfg = RunConfig(output_dir="/nonexistent/shardgpt-test", **kw)
        cfg.validate(1)
        return cfg.num_warmup_steps

    assert warmup() == 20 and warmup(max_steps=5) == 1 and warmup(max_steps=5, warmup_ratio=0.5) == 3
    assert warmup(warmup_steps=0) == 0 and warmup(warmup_steps=7, warmup_ratio=0.5) == 7
    with pytest.raises(ValueError, match=r"--warmup_ratio 1.5 must be in \[0, 1\]"):
        warmup(warmup_ratio=1.5)


@pytest.mark.parametrize(
    ("scheduler", "field", "fix"),
    [
        ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                               "warmup_max_lr": "auto"}},
         "scheduler.params.warmup_max_lr is not a parameter of WarmupCosineLR", "remove it"),
        ({"type": "OneCycleLR", "params": {}}, "scheduler.type = 'OneCycleLR' is not a DeepSpeed scheduler",
         "choose one of"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "scheduler.params.warmup_num_steps = 0",
         "pass --warmup_steps 1 or more"),
    ],
    ids=["param of another scheduler", "unknown type", "fixed zero warmup"],
)  # fmt: skip
def test_deepspeed_scheduler_values_deepspeed_rejects_are_refused(scheduler, field, fix):
    from training.config import RunConfig
    from training.deepspeed_config import resolve_deepspeed

    cfg = RunConfig(output_dir="/nonexistent/shardgpt-test", max_steps=10)
    with pytest.raises(ValueError) as refused:
        resolve_deepspeed({**HF_ZERO2, "scheduler": scheduler}, cfg, 2, 64, "'user.json'")
    assert field in str(refused.value) and fix in str(refused.value), refused.value


def test_inline_deepspeed_yaml_resolves_like_a_json(monkeypatch):
    """What `accelerate launch` exports for an inline `deepspeed_config` becomes accelerate's own JSON for those
    fields, resolved by the same checks as a file: batch sizes and clipping from the flags, offload as written."""
    from training.config import RunConfig
    from training.launch import resolve_launch

    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "WORLD_SIZE": "2",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
           "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0",
           "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_MIXED_PRECISION": "bf16"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = resolve_launch(RunConfig(output_dir="/nonexistent/shardgpt-test", gradient_accumulation_steps=2))
    cfg, strategy = launch.cfg, launch.strategy
    ds = strategy.deepspeed
    assert strategy.name == "zero3-offload-cpu" and cfg.bf16 and ds["bf16"]["enabled"] is True
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        8,
        2,
        32,
    )
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"


# FSDP configs refused before the process group, checked without launching: (FSDP_* variables as `accelerate
# launch` exports them from the YAML, the field named, the fix)
FSDP_REFUSED = {
    "fsdp1-cpu-offload": ({"FSDP_VERSION": "1", "FSDP_OFFLOAD_PARAMS": "true"},
                          "fsdp_offload_params: true with fsdp_version: 1", "set fsdp_offload_params: false"),
    "fsdp1-flat-parameters": ({"FSDP_VERSION": "1", "FSDP_USE_ORIG_PARAMS": "false"},
                              "fsdp_use_orig_params: false with fsdp_version: 1", "set fsdp_use_orig_params: true"),
    "fsdp1-hybrid": ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"},
                     "fsdp_sharding_strategy: HYBRID_SHARD with fsdp_version: 1", "use fsdp_version: 2 with a "
                     "parallelism_config"),
    "fsdp1-size-wrap-unties-embeddings": (
        {"FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "2000"},
        "fsdp_min_num_params: 2000 would wrap the tied input and output embeddings", "set fsdp_min_num_params above"),
    "fsdp1-resume-on-cpu": ({"FSDP_VERSION": "1", "resume": "auto"},
                            "--resume_from_checkpoint auto with fsdp_version: 1 on CPU ranks",
                            "train with fsdp_version: 2"),
    "fsdp1-full-state-dict-checkpoints-on-cpu": (
        {"FSDP_VERSION": "1", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "save_steps": "100"},
        "--save_steps 100 with fsdp_version: 1 and fsdp_state_dict_type: FULL_STATE_DICT on CPU ranks",
        "set fsdp_state_dict_type: SHARDED_STATE_DICT"),
    "fsdp2-size-wrap-container": (
        {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "90000"},
        "would wrap the container 'model.layers'", "use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FSDP_REFUSED))
def test_fsdp_options_that_cannot_run_are_refused_before_the_process_group(name, monkeypatch):
    import torch

    import model as shardgpt
    from training.config import RunConfig
    from training.core.fsdp import check_fsdp_wrap
    from training.launch import resolve_launch

    env, field, fix = FSDP_REFUSED[name]
    env = dict(env)
    # Flags, not variables; --save_steps 0 lets the other checks speak.
    flags = {"save_steps": int(env.pop("save_steps", 0)), "resume_from_checkpoint": env.pop("resume", None)}
    for key, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(key, value)
    cfg = RunConfig(output_dir="/nonexistent/shardgpt-test", preset="debug", **flags)
    with pytest.raises(ValueError) as refused:
        strategy = resolve_launch(cfg).strategy
        with torch.device("meta"):
            check_fsdp_wrap(strategy, shardgpt.ShardGPTForCausalLM(cfg.model_config()))
    assert field in str(refused.value) and fix in str(refused.value), refused.value


def test_inline_deepspeed_accumulation_that_disagrees_with_the_flag_is_refused(monkeypatch):
    """`gradient_accumulation_steps: 4` inline in the YAML, the flag at its default 1: refused like a JSON's."""
    from training.config import RunConfig
    from training.launch import resolve_launch

    for key, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "WORLD_SIZE": "2",
                       "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as refused:
        resolve_launch(RunConfig(output_dir="/nonexistent/shardgpt-test"))
    message = str(refused.value)
    assert "gradient_accumulation_steps = 4 but --gradient_accumulation_steps gives 1" in message, message
    assert "pass --gradient_accumulation_steps 4" in message, message
