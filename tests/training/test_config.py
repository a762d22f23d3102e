"""The run config: batch arithmetic, DeepSpeed "auto" resolution and every bad flag, without launching."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

from training.adamw import param_groups
from training.config import RunConfig
from training.deepspeed_config import check_deepspeed_keys, resolve_deepspeed
from training.environment import Environment
from training.launch import resolve_launch
from training.loop.optim import lr_lambda
from training.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]
DS_CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))


def cfg(**kw) -> RunConfig:
    return RunConfig(**{"output_dir": "/nonexistent/shardgpt-test", **kw})


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_json_resolves_without_leftover_auto(path, tmp_path):
    ds = json.loads(path.read_text())
    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=3, bf16=True, nvme_path=str(tmp_path))
    out = resolve_deepspeed(ds, c, world_size=2, hidden_size=64, source=path.name)
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["gradient_accumulation_steps"] == 3
    assert out["train_batch_size"] == 4 * 3 * 2
    assert out["gradient_clipping"] == c.max_grad_norm
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert '"auto"' not in json.dumps({k: v for k, v in out.items() if k != "_comment"})
    assert ds["train_batch_size"] == "auto"  # the input is left as it was
    if "optimizer" in out:
        assert out["optimizer"]["params"]["lr"] == c.learning_rate
        assert out["optimizer"]["params"]["betas"] == [c.adam_beta1, c.adam_beta2]


def test_global_batch_arithmetic():
    assert cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2).global_batch(3) == 24


# (the JSON's change, what the error names, the fix it gives)
BAD_JSON = [
    ({"train_batch_size": 24}, "train_batch_size = 24 but micro 4 x accumulation 2 x world 2 = 16",
     'set train_batch_size to "auto"'),
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu = 8 but --per_device_train_batch_size "
     "gives 4", "or pass --per_device_train_batch_size 8"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps = 4 but --gradient_accumulation_steps gives 2",
     'set gradient_accumulation_steps to "auto" in the JSON, or pass --gradient_accumulation_steps 4'),
    ({"gradient_clipping": 0.5}, "gradient_clipping = 0.5 but --max_grad_norm gives 1.0",
     "or pass --max_grad_norm 0.5"),
    ({"bf16": {"enabled": True}}, "bf16.enabled = True but --bf16 is off", 'set bf16.enabled to "auto" in the JSON, '
     "or pass --bf16"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "optimizer.params.lr = 0.1 but --learning_rate gives "
     "0.001", "or pass --learning_rate 0.1"),
    ({"zero_optimisation": {"stage": 2}}, "unknown key 'zero_optimisation'", "did you mean 'zero_optimization'?"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "unknown key zero_optimization.overlap_com",
     "did you mean 'overlap_comm'?"),
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage = 7", "fix the value"),
    ({"wall_clock": True}, "unknown key 'wall_clock'", "did you mean 'wall_clock_breakdown'?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/no/such/nvme"}}},
     "offload_param.nvme_path = '/no/such/nvme' does not exist", "or pass --nvme_path DIR"),
    # AutoTP: the ranks of a tensor-parallel group share one batch, so the global batch counts data-parallel ranks.
    ({"train_batch_size": 16, "tensor_parallel": {"autotp_size": 2}}, "train_batch_size = 16 but micro 4 x "
     "accumulation 2 x data-parallel ranks 1 (world 2 / autotp_size 2) = 8", 'set train_batch_size to "auto"'),
    ({"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size = 3 does not divide the 2 launched ranks",
     "set it to one of [1, 2]"),
    ({"steps_per_print": "auto"}, 'no flag resolves steps_per_print = "auto"', "set them to values in the JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("ds", "field", "fix"), BAD_JSON, ids=[m[:30] for _, m, _ in BAD_JSON])
def test_bad_deepspeed_json_names_the_field_and_fix(ds, field, fix):
    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        resolve_deepspeed(ds, c, world_size=2, hidden_size=64, source="'x.json'")
    assert field in str(err.value) and fix in str(err.value), str(err.value)


# (the flags, what the error names, the fix it gives)
BAD_FLAGS = [
    (dict(bf16=True, fp16=True), "--bf16 and --fp16 are both set", "choose one precision"),
    (dict(per_device_train_batch_size=0), "--per_device_train_batch_size 0", "must be at least 1"),
    (dict(gradient_accumulation_steps=0), "--gradient_accumulation_steps 0", "must be at least 1"),
    (dict(preset="gpt9"), "--preset 'gpt9' is unknown", "valid presets: debug, tiny"),
    (dict(config_overrides="hiden_size=32"), "--config_overrides 'hiden_size=32'", "such as vocab_size, hidden_size"),
    (dict(warmup_steps=50, max_steps=10), "--warmup_steps 50 exceeds --max_steps 10",
     "pass --warmup_steps 10 or fewer"),
    (dict(lr_scheduler_type="step"), "--lr_scheduler_type 'step'", "choose one of cosine, linear, constant"),
    (dict(learning_rate=0.0), "--learning_rate 0.0", "must be positive"),
    (dict(report_to="tensorbord"), "--report_to 'tensorbord': unknown ['tensorbord']", "choose from ('none'"),
    (dict(deepspeed="ds_configs/zero9.json"), "--deepspeed 'ds_configs/zero9.json': no such file",
     "pick one of ds_configs/*.json"),
    (dict(nvme_path="/no/such/dir"), "--nvme_path '/no/such/dir' does not exist", "mkdir -p /no/such/dir"),
    (dict(save_total_limit=0), "--save_total_limit 0", "must be at least 1 (or unset to keep all)"),
    (dict(min_lr_ratio=2.0), "--min_lr_ratio 2.0", "must be in [0, 1]"),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "field", "fix"), BAD_FLAGS, ids=[m[:30] for _, m, _ in BAD_FLAGS])
def test_bad_flags_fail_before_anything_starts(kw, field, fix):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        cfg(**kw).validate(data_parallel_size=2)
    assert field in str(err.value) and fix in str(err.value), str(err.value)


def test_config_overrides_replace_fields_of_the_preset():
    config = cfg(preset="debug", config_overrides="intermediate_size=8192, tie_word_embeddings=false").model_config()
    assert (config.intermediate_size, config.tie_word_embeddings, config.hidden_size) == (8192, False, 64)


def test_existing_checkpoints_are_not_trained_over(tmp_path):
    (tmp_path / "checkpoint-10").mkdir()
    with pytest.raises(FileExistsError, match="already holds checkpoints: pass --resume_from_checkpoint auto"):
        cfg(output_dir=str(tmp_path)).validate(data_parallel_size=1)
    cfg(output_dir=str(tmp_path), resume_from_checkpoint="auto").validate(data_parallel_size=1)
    assert (tmp_path / "checkpoint-10").is_dir()


def test_too_little_data_for_one_global_batch():
    with pytest.raises(ValueError, match=r"global batch of 16 \(= micro 4 x accumulation 2 x data-parallel ranks 2\)"):
        cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2).check_data_size(10, data_parallel_size=2)


def test_check_keys_accepts_comments():
    check_deepspeed_keys({"_comment": "why", "zero_optimization": {"stage": 1}}, "x")


def test_schedule_warms_up_then_decays_to_the_floor():
    c = cfg(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    f = lr_lambda(c)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))
    lin = lr_lambda(cfg(warmup_steps=0, max_steps=100, min_lr_ratio=0.0, lr_scheduler_type="linear"))
    assert lin(50) == pytest.approx(0.5) and not math.isnan(lin(0))


def test_weight_decay_only_on_matrices():
    import model

    net = model.ShardGPTForCausalLM(model.ShardGPTConfig.from_preset("debug"))
    decay, no_decay = param_groups(net, 0.1, decay_embeddings=False)
    names = {id(p): n for n, p in net.named_parameters()}
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"model.norm.weight", "model.embed_tokens.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(net.parameters()))
    decay_all, _ = param_groups(net, 0.1, decay_embeddings=True)
    assert any("embed" in names[id(p)] for p in decay_all["params"])


def test_autotp_batch_counts_data_parallel_ranks(monkeypatch):
    """ds_configs/autotp.json on 4 ranks: tensor-parallel pairs (0, 1) and (2, 3) each read one share of the
    global batch of micro 4 x accumulation 2 x 2 data-parallel ranks; DeepSpeed's own check counts all 4 ranks."""

    monkeypatch.setenv("WORLD_SIZE", "4")
    autotp = str(ROOT / "ds_configs" / "autotp.json")
    c = cfg(per_device_train_batch_size=4, gradient_accumulation_steps=2, deepspeed=autotp)
    strategy = resolve_launch(c).strategy
    assert (strategy.name, strategy.tp_size, strategy.data_parallel_size) == ("zero1-autotp", 2, 2)
    assert [strategy.data_parallel_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert strategy.deepspeed["train_batch_size"] == 4 * 2 * 4


@pytest.mark.parametrize(("world", "flags", "accumulation"), [
    (2, ["--global_batch_size", "16", "--per_device_train_batch_size", "8"], 2),  # 1 data-parallel rank: 16 = 8 x 2
    (4, ["--global_batch_size", "16", "--per_device_train_batch_size", "4"], 2),  # 2 data-parallel ranks
])  # fmt: skip
def test_autotp_global_batch_counts_data_parallel_ranks(monkeypatch, world, flags, accumulation):
    """--global_batch_size under AutoTP: the accumulation is the global batch over micro x data-parallel ranks
    (world / autotp_size), so the loader, DeepSpeed and the resume check train the global batch asked for (a global
    batch of 16 with micro 8 on 2 ranks once trained 8 sequences a step: the accumulation counted the world)."""

    monkeypatch.setenv("WORLD_SIZE", str(world))
    autotp = str(ROOT / "ds_configs" / "autotp.json")
    (parsed,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(
        args=[*flags, "--deepspeed", autotp, "--output_dir", "/nonexistent/shardgpt-test"]
    )
    launch = resolve_launch(parsed)
    resolved, strategy = launch.cfg, launch.strategy
    assert resolved.gradient_accumulation_steps == accumulation
    assert resolved.global_batch(strategy.data_parallel_size) == 16 == parsed.global_batch_size
    ds = strategy.deepspeed  # DeepSpeed's own check counts every rank (see resolve_batch)
    assert ds["gradient_accumulation_steps"] == accumulation and ds["train_batch_size"] == 16 * strategy.tp_size


SP_YAML = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
           "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}  # fmt: skip
ZERO3_YAML = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ROOT / "ds_configs" / "zero3.json"),
}


@pytest.mark.parametrize(("variables", "flags", "refusal"), [
    ({**SP_YAML, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, [],
     "sequence parallelism (sp_size 2) needs DeepSpeed"),
    (SP_YAML, [], "sequence parallelism (sp_size 2) needs DeepSpeed"),  # DDP (no distributed_type: DEEPSPEED)
    ({**SP_YAML, **ZERO3_YAML, "PARALLELISM_CONFIG_SP_SIZE": "3", "WORLD_SIZE": "3",
      "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}, [], "sp_size 3 does not divide the model's 4 attention heads"),
    ({**SP_YAML, **ZERO3_YAML}, ["--block_size=63"], "--block_size 63 is not divisible by sp_size 2"),
    ({**SP_YAML, **ZERO3_YAML, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}, [],
     "gives dp_replicate_size 1 x dp_shard_size 2 x sp_size 2 = 4 ranks, but 2 were launched: set "
     "parallelism_config_dp_shard_size: 1"),
    ({**SP_YAML, **ZERO3_YAML, "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "eager"}, [],
     "parallelism_config_sp_attn_implementation: eager"),
    ({**SP_YAML, **ZERO3_YAML, "PARALLELISM_CONFIG_CP_SIZE": "2"}, [], "sets both sp_size: 2 and cp_size: 2"),
    ({**SP_YAML, "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_CP_SIZE": "2"}, [],
     "cp_size: 2 (torch's ring context parallelism), which needs CUDA's flash or memory-efficient attention"),
    ({**SP_YAML, "ACCELERATE_USE_DEEPSPEED": "true",
      "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ROOT / "ds_configs" / "autotp.json")}, [],
     "sequence parallelism (sp_size 2) with DeepSpeed AutoTP"),
    ({**SP_YAML, **ZERO3_YAML}, ["--pipeline_parallel_degree=2"], "--pipeline_parallel_degree"),
])  # fmt: skip
def test_sequence_parallel_bad_launches_are_refused(monkeypatch, variables, flags, refusal):
    """What Ulysses cannot train as asked is refused before the process group in one line naming the setting and
    the fix. The variables are those `accelerate launch` exports from a YAML's parallelism_config block."""

    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as err:
        (parsed,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(
            args=[*flags, "--output_dir", "/nonexistent/shardgpt-test"]
        )
        resolve_launch(parsed)
    assert refusal in str(err.value) and "\n" not in str(err.value), str(err.value)


CP_FSDP2 = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
            "WORLD_SIZE": "4"}  # fmt: skip


@pytest.mark.parametrize(("variables", "flags", "refusal"), [
    ({}, [], None),
    ({"FSDP_VERSION": "1"}, [], "parallelism_config_cp_size: 2 needs FSDP2"),
    ({}, ["--block_size=66"], "--block_size 66 is not divisible by 2 x cp_size = 4"),
    ({"WORLD_SIZE": "8"}, ["--pipeline_parallel_degree=2", "--per_device_train_batch_size=2"],
     "parallelism_config_cp_size: 2 with --pipeline_parallel_degree 2"),
])  # fmt: skip
def test_ring_context_parallelism_is_passed_through_on_gpus(monkeypatch, variables, flags, refusal):
    """On CUDA GPUs an FSDP2 YAML's cp_size is handed to accelerate (unproven here: no machine with several GPUs):
    the strategy counts world / cp data-parallel ranks, FSDP2 shards over dp_shard x cp, and the step divides by
    the same count FSDP2 averages over. What it cannot run is refused in one line. CUDA is faked: no process group
    or kernel is touched."""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for key, value in {**CP_FSDP2, **variables}.items():
        monkeypatch.setenv(key, value)
    (parsed,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(
        args=["--global_batch_size=8", "--per_device_train_batch_size=4", *flags,
              "--output_dir", "/nonexistent/shardgpt-test"]
    )  # fmt: skip
    if refusal:
        with pytest.raises(ValueError, match=re.escape(refusal)):
            resolve_launch(parsed)
        return
    strategy = resolve_launch(parsed).strategy
    assert (strategy.name, strategy.data_parallel_size, strategy.shard_size) == ("fsdp-cp2", 2, 4)
    assert [strategy.data_parallel_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert Strategy.from_name("fsdp-cp2", 4) == strategy
    assert strategy.gradient_divisor == 4


def test_sequence_parallel_refuses_key_value_heads_it_cannot_split():
    """DeepSpeed's rule: the key-value heads are split over sp ranks or replicated to them."""
    from model import ShardGPTConfig
    from training.axes.ulysses import check_sequence_parallel

    config = ShardGPTConfig.from_preset("debug", num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match="model's 3 key-value heads are neither a multiple nor a divisor of sp_size 2"):
        check_sequence_parallel(
            RunConfig(output_dir="/nonexistent/shardgpt-test"), config, 2, 2, "zero3", Environment()
        )


def test_sequence_parallel_degrees_from_yaml_and_json(monkeypatch, tmp_path):
    """The degree comes from the YAML's parallelism_config or the JSON's sequence_parallel_size; a mismatch between
    the two is refused; the global batch counts data-parallel ranks, world / sp, as DeepSpeed's batch check does."""

    ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    (tmp_path / "sp4.json").write_text(json.dumps({**ds, "sequence_parallel_size": 4}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    (parsed,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(
        args=["--deepspeed", str(tmp_path / "sp4.json"), "--global_batch_size=8", "--per_device_train_batch_size=4",
              "--output_dir", "/nonexistent/shardgpt-test"]
    )  # fmt: skip
    launch = resolve_launch(parsed)
    resolved, strategy = launch.cfg, launch.strategy
    assert (strategy.name, strategy.sp_size, strategy.data_parallel_size) == ("zero3-sp4", 4, 1)
    assert resolved.gradient_accumulation_steps == 2 and strategy.deepspeed["train_batch_size"] == 8
    assert [strategy.sequence_parallel_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert Strategy.from_name("zero3-sp4", 4) == strategy
    for key, value in {**SP_YAML, **ZERO3_YAML}.items():  # a YAML saying sp 2 beside the JSON's 4
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="parallelism_config_sp_size is 2 but the DeepSpeed config .* 4"):
        resolve_launch(parsed)


def test_the_default_learning_rate_follows_the_models_size(tmp_path):
    """Larger presets default to smaller steps (GPT-3's table by size): llama-3b, which diverged at the former
    default 1e-3, gets GPT-3 2.7B's 1.6e-4; a flag wins; a checkpoint's default comes from its own size."""
    from model import PRESETS, ShardGPTConfig, ShardGPTForCausalLM
    from training.adamw import LEARNING_RATES, recipe_learning_rate

    def size(preset: str) -> int:
        with torch.device("meta"):
            return ShardGPTForCausalLM(ShardGPTConfig.from_preset(preset)).num_parameters()

    rates = [RunConfig(preset=p, output_dir=str(tmp_path)).learning_rate for p in sorted(PRESETS, key=size)]
    assert rates == sorted(rates, reverse=True) and set(rates) <= {lr for _, lr in LEARNING_RATES}
    assert RunConfig(preset="llama-3b", output_dir=str(tmp_path)).learning_rate == 1.6e-4
    assert RunConfig(preset="llama-3b", learning_rate=3e-4, output_dir=str(tmp_path)).learning_rate == 3e-4
    ShardGPTConfig.from_preset("llama-1b").save_pretrained(tmp_path / "ckpt")  # config.json only
    cfg = RunConfig(model_name_or_path=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "out"))
    assert cfg.learning_rate is None  # known once the checkpoint's config is read
    assert cfg.resolve(1).learning_rate == recipe_learning_rate(ShardGPTConfig.from_preset("llama-1b")) == 2e-4


def test_cpu_ranks_cap_the_gpu_sized_buckets(caplog):
    """The shipped JSONs size DeepSpeed's buckets for GPUs; on CPU ranks each bucket is capped (CPU_BUCKETS), in
    one place, and the run says so; a GPU launch keeps the JSON's sizes."""
    from training.deepspeed_config import CPU_BUCKETS, load_json

    for name in ("zero2", "zero3"):
        raw = load_json(ROOT / "ds_configs" / f"{name}.json")
        gpu = resolve_deepspeed(raw, RunConfig(output_dir="unused"), 2, 64, name)["zero_optimization"]
        with caplog.at_level("INFO", logger="shardgpt"):
            cpu = resolve_deepspeed(raw, RunConfig(output_dir="unused"), 2, 64, name, cpu_ranks=True)
        for key, cap in CPU_BUCKETS.items():
            if key in raw["zero_optimization"]:
                assert gpu[key] == raw["zero_optimization"][key] > cap  # as shipped
                assert cpu["zero_optimization"][key] == cap
        assert "CPU ranks: DeepSpeed reduce_bucket_size 5e+08 -> 1e+07" in caplog.text


def test_the_trainer_refuses_sequence_parallelism(monkeypatch):
    """The HF Trainer's Ulysses loss is sp times too large under ZeRO-1/2: refused in one line naming train.py."""
    from recipes import trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in {**SP_YAML, **ZERO3_YAML}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"sequence parallelism \(sp_size 2\) needs recipes/train.py: the HF Trainer"):
        trainer.main(["--output_dir", "/nonexistent/shardgpt-test"])


def test_a_ddp_and_an_fsdp2_yaml_with_dp_replicate_x_tp_are_one_strategy(monkeypatch):
    """A DDP YAML's parallelism_config (dp_replicate 2 x tp 2) and an FSDP2 YAML's with the same block are one layout:
    FSDP2 on a replicate-only mesh around the slices (training/core/ddp.replicated_tensor_parallel). The DDP
    YAML is launched against one process in tests/recipes/test_composed.py; this holds the FSDP2 YAML to the same
    strategy, as `accelerate launch` exports each."""

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for key, value in {"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 2, "cp_size": 1, "sp_size": 1}.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{key.upper()}", str(value))
    for name in ("FSDP_OFFLOAD_PARAMS", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    ddp = resolve_launch(cfg(per_device_train_batch_size=4)).strategy
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    fsdp = resolve_launch(cfg(per_device_train_batch_size=4)).strategy
    assert ddp == fsdp and ddp.name == "fsdp-hybrid-tp2", (ddp, fsdp)
    assert (ddp.replicas, ddp.shard_size, ddp.tp_size, ddp.data_parallel_size) == (2, 1, 2, 2)


def test_the_zero_defaults_the_planners_read_are_deepspeeds():
    """The planners read DeepSpeed's `zero_optimization` defaults from one table (training/deepspeed_config.py's
    ZERO_DEFAULTS) without importing DeepSpeed: it is DeepSpeed's own model of the section, key by key, and
    `overlap_comm` defaults on under ZeRO-3 only, as DeepSpeed resolves it."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from training.deepspeed_config import ZERO_DEFAULTS, zero_defaults

    model = DeepSpeedZeroConfig()
    by_key = {(f.alias or name): getattr(model, name) for name, f in DeepSpeedZeroConfig.model_fields.items()}
    assert {key: by_key[key] for key in ZERO_DEFAULTS} == ZERO_DEFAULTS
    for stage in (1, 2, 3):
        assert zero_defaults({"stage": stage})["overlap_comm"] == DeepSpeedZeroConfig(stage=stage).overlap_comm


def test_the_planner_finds_each_zero_strategys_json_in_the_shipped_configs():
    """The JSON the planner plans each ZeRO strategy with is the one its shipped accelerate config launches."""
    from training.plan.memory.layout import STRATEGIES, shipped_json

    zero = [name for name in STRATEGIES if name.startswith("zero")]
    assert {name: shipped_json()[name].name for name in zero} == {
        "zero1": "zero1.json", "zero2": "zero2.json", "zero2-offload-cpu": "zero2_offload.json", "zero3": "zero3.json",
        "zero3-offload-cpu": "zero3_offload_cpu.json", "zero3-offload-nvme": "zero3_offload_nvme.json",
        "zero1-autotp": "autotp.json",
    }  # fmt: skip
