"""Tensor parallelism from an accelerate YAML's parallelism_config (training/axes/tensor/plan.py): the launch checks
that refuse what it cannot run, each in one line naming the setting and the fix, before any process group; the
strategy's name read back; the plan as torch's styles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from model import ShardGPTConfig
from training.axes.tensor.checks import check_parallelism_config_tp, check_tensor_parallel, check_tensor_parallel_flag
from training.axes.tensor.plan import sequence_parallel_plan, torch_plan
from training.axes.tensor.vocab import VocabParallelHead
from training.config import RunConfig
from training.environment import Environment
from training.strategy import Strategy

CFG = {"output_dir": "/nonexistent/shardgpt-test", "preset": "debug"}


@pytest.fixture
def block(monkeypatch):
    """Set the variables `accelerate launch` exports for a YAML's parallelism_config block."""

    def set_block(**sizes):
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        for key, value in sizes.items():
            monkeypatch.setenv(f"PARALLELISM_CONFIG_{key.upper()}", str(value))

    monkeypatch.delenv("FSDP_OFFLOAD_PARAMS", raising=False)
    return set_block


def test_fsdp2_with_tp_passes(block):
    block(dp_shard_size=2, tp_size=2)
    check_parallelism_config_tp(
        2, env=Environment.read(), deepspeed=False, fsdp_version=2, cfg=RunConfig(**CFG)
    )  # no refusal


@pytest.mark.parametrize(
    ("deepspeed", "fsdp_version", "expected"),
    [
        (True, 0, r"with DeepSpeed: DeepSpeed splits layers itself \(AutoTP\); set tensor_parallel.autotp_size: 2"),
        (False, 1, r"with fsdp_version: 1 .*set fsdp_version: 2"),
    ],
)
def test_tp_outside_fsdp2_is_refused(block, deepspeed, fsdp_version, expected):
    block(tp_size=2)
    with pytest.raises(ValueError, match=r"parallelism_config_tp_size: 2 " + expected):
        check_parallelism_config_tp(
            2, env=Environment.read(), deepspeed=deepspeed, fsdp_version=fsdp_version, cfg=RunConfig(**CFG)
        )


def test_a_ddp_config_replicates_the_split_model_and_refuses_shards(block):
    """DDP x TP: a DDP YAML's dp_replicate x tp runs (as FSDP2 on a replicate-only mesh); its dp_shard cannot."""
    from training.core.ddp import replicated_tensor_parallel

    block(dp_replicate_size=2, tp_size=2)
    check_parallelism_config_tp(
        2, env=Environment.read(), deepspeed=False, fsdp_version=0, cfg=RunConfig(**CFG)
    )  # no refusal
    strategy = replicated_tensor_parallel(4, 2)
    assert strategy.name == "fsdp-hybrid-tp2" and strategy.mesh.shape["dp_shard"] == 1, strategy.mesh.shape
    assert (strategy.replicas, strategy.shard_size, strategy.data_parallel_size) == (2, 1, 2)
    block(dp_shard_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"dp_shard_size: 2 in a DDP config: DDP keeps whole copies"):
        check_parallelism_config_tp(2, env=Environment.read(), deepspeed=False, fsdp_version=0, cfg=RunConfig(**CFG))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"cp_size": 2}, "parallelism_config_cp_size"),
        ({}, "fsdp_offload_params: true"),
    ],
)
def test_tp_with_what_it_does_not_compose_with_is_refused(block, monkeypatch, extra, named):
    block(tp_size=2, **extra)
    if not extra:
        monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match=f"parallelism_config_tp_size: 2 with {named}: "):
        check_parallelism_config_tp(2, env=Environment.read(), deepspeed=False, fsdp_version=2, cfg=RunConfig(**CFG))


@pytest.mark.parametrize(
    ("tp", "what"), [(4, "num_key_value_heads \\(2\\)"), (3, "num_attention_heads \\(4\\)")]
)  # fmt: skip
def test_a_degree_that_does_not_split_every_layer_is_refused(tp, what):
    config = ShardGPTConfig.from_preset("debug")  # 4 heads, 2 key-value heads, intermediate 176
    with pytest.raises(ValueError, match=f"parallelism_config_tp_size = {tp} does not divide the model's {what}"):
        check_tensor_parallel(config, tp)
    check_tensor_parallel(config, 2)  # divides all four


def test_a_degree_that_does_not_split_the_vocabulary_is_refused():
    """The embedding and the head are split by vocabulary rows: GPT-2's 50257 tokens split over no pair."""
    config = ShardGPTConfig.from_preset("debug", vocab_size=50257)
    with pytest.raises(
        ValueError, match=r"--tensor_parallel_degree = 2 does not divide the model's vocab_size \(50257\)"
    ):
        check_tensor_parallel(config, 2, flag="--tensor_parallel_degree")


def test_the_strategy_spells_and_reads_back_tensor_parallelism():
    strategy = Strategy.of("fsdp", 8, tp=2, replicas=2, fsdp_version=2)
    assert strategy.name == "fsdp-hybrid-tp2"
    assert Strategy.from_name(strategy.name, 8) == strategy
    assert (strategy.mesh.dp_replicate, strategy.mesh.dp_shard, strategy.mesh.tp) == (2, 2, 2)
    assert strategy.data_parallel_size == 4
    with pytest.raises(ValueError, match="strategy 'zero1-tp2' is unknown"):
        Strategy.from_name("zero1-tp2", 4)  # DeepSpeed's tensor parallelism is spelled -autotp
    with pytest.raises(ValueError, match="FSDP2's"):
        Strategy.of("fsdp", 4, tp=2, fsdp_version=1)


def test_a_block_that_the_tensor_parallel_ranks_cannot_shard_is_refused(block):
    """Tensor parallelism shards each sequence over the tp ranks (sequence parallelism), in pipeline stages too."""
    block(dp_shard_size=2, tp_size=2)
    with pytest.raises(
        ValueError, match=r"parallelism_config_tp_size: 2 does not divide --block_size 63: .*multiple of 2"
    ):
        check_parallelism_config_tp(
            2, env=Environment.read(), deepspeed=False, fsdp_version=2, cfg=RunConfig(**{**CFG, "block_size": 63})
        )
    piped = RunConfig(**{**CFG, "block_size": 63, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2})
    with pytest.raises(ValueError, match=r"--tensor_parallel_degree 2 does not divide --block_size 63"):
        check_tensor_parallel_flag(piped, deepspeed=False, fsdp=False, yaml_tp=1)


def test_sequence_parallelism_shards_the_residual_stream_between_the_tensor_parallel_regions():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = sequence_parallel_plan(ShardGPTConfig.from_preset("debug"))
    assert set(torch_plan(ShardGPTConfig.from_preset("debug"))) < set(plan)
    for key in ("model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"):  # reduce-scatter onto the shards
        assert isinstance(plan[key], RowwiseParallel) and plan[key].output_layouts == (Shard(1),)
    for key in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm"):
        assert isinstance(plan[key], SequenceParallel)
    for key in ("model.layers.*.self_attn", "model.layers.*.mlp", "model.norm"):  # gathered over the sequence
        assert isinstance(plan[key], PrepareModuleInput) and plan[key].desired_input_layouts[0] == Replicate()
    assert plan["model.layers.0"].desired_input_layouts == (Shard(1),)  # the first layer's shard of the embedding
    # The embedding split by vocabulary rows, its partial sums reduce-scattered onto the sequence shards; the head
    # split by the same rows, its loss computed over them.
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert plan["model.embed_tokens"].output_layouts == (Shard(1),)
    assert isinstance(plan["lm_head"], VocabParallelHead)
    # A pipeline's middle stage takes the shard its neighbour sent and sends its own on: no slice, no gather.
    middle = sequence_parallel_plan(ShardGPTConfig.from_preset("debug"), embedding=False, head=False)
    assert set(plan) - set(middle) == {"model.embed_tokens", "model.layers.0", "model.norm", "lm_head"}


def test_the_plan_is_the_models_own():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = ShardGPTConfig.from_preset("debug")
    plan = torch_plan(config)
    assert set(plan) == {f"model.{k}" for k in config.base_model_tp_plan}
    kinds = {k: type(v) for k, v in plan.items()}
    assert kinds["model.layers.*.self_attn.o_proj"] is RowwiseParallel
    assert kinds["model.layers.*.mlp.up_proj"] is ColwiseParallel


@pytest.mark.parametrize(
    ("deepspeed", "fsdp", "pipeline", "expected"),
    [
        (True, False, 2, r"with a DeepSpeed config: DeepSpeed splits layers itself \(AutoTP\)"),
        (False, True, 2, r"with an FSDP accelerate config: .*set parallelism_config_tp_size: 2"),
        (False, False, 1, r"without a pipeline: the flag splits pipeline stages; add --pipeline_parallel_degree 2"),
    ],
)
def test_the_tensor_parallel_flag_is_refused_where_another_setting_owns_it(deepspeed, fsdp, pipeline, expected):
    cfg = RunConfig(**CFG, tensor_parallel_degree=2, pipeline_parallel_degree=pipeline)
    with pytest.raises(ValueError, match=r"--tensor_parallel_degree 2 " + expected):
        check_tensor_parallel_flag(cfg, deepspeed=deepspeed, fsdp=fsdp, yaml_tp=1)


def test_the_tensor_parallel_flag_with_a_pipeline_passes_and_checks_the_heads():
    check_tensor_parallel_flag(RunConfig(**CFG, tensor_parallel_degree=2, pipeline_parallel_degree=2), False, False, 1)
    cfg = RunConfig(**CFG, tensor_parallel_degree=4, pipeline_parallel_degree=2)
    with pytest.raises(
        ValueError, match=r"--tensor_parallel_degree = 4 does not divide the model's num_key_value_heads"
    ):
        check_tensor_parallel_flag(cfg, False, False, 1)
    with pytest.raises(ValueError, match=r"--tensor_parallel_degree 0 must be at least 1"):
        RunConfig(**CFG, tensor_parallel_degree=0)


def launched(monkeypatch, world: int, **variables: str) -> None:
    """What `accelerate launch` exports for an FSDP2 YAML with a parallelism_config block, on `world` ranks."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **variables}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")


@pytest.mark.parametrize(
    ("world", "block", "flags", "name", "dp"),
    [
        (4, {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"}, {}, "fsdp-tp2", 2),
        (4, {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"}, {}, "fsdp-hybrid-tp2", 2),
        (8, {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"},
         {"pipeline_parallel_degree": 2, "gradient_accumulation_steps": 2}, "fsdp-tp2-pp2", 2),
    ],
)  # fmt: skip
def test_the_launch_reads_its_degrees_from_the_yaml_and_the_pipeline_flag(monkeypatch, world, block, flags, name, dp):
    from training.launch import resolve_launch

    launched(monkeypatch, world, **block)
    cfg = RunConfig(**CFG, **flags)
    launch = resolve_launch(cfg)
    strategy = launch.strategy
    assert launch.data_parallel_size == dp
    assert (strategy.name, strategy.data_parallel_size, strategy.world_size) == (name, dp, world)


def test_the_tensor_parallel_flag_under_torchrun_makes_a_tensor_x_pipeline_mesh(monkeypatch):
    from training.launch import resolve_launch

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = RunConfig(**CFG, tensor_parallel_degree=2, pipeline_parallel_degree=2, gradient_accumulation_steps=2)
    launch = resolve_launch(cfg)
    strategy = launch.strategy
    assert launch.data_parallel_size == 2
    assert strategy.name == "ddp-tp2-pp2" and strategy.mesh.shape == {
        "pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "sp": 1, "tp": 2,
    }  # fmt: skip


def test_the_hf_trainer_refuses_tensor_parallelism_outside_deepspeed(monkeypatch):
    from recipes import trainer

    launched(monkeypatch, 4, PARALLELISM_CONFIG_DP_SHARD_SIZE="2", PARALLELISM_CONFIG_TP_SIZE="2")
    with pytest.raises(ValueError, match="tensor parallelism of degree 2 under FSDP needs recipes/train.py"):
        trainer.main(["--preset", "debug", "--output_dir", "/nonexistent/shardgpt-test"])


def test_degrees_that_do_not_multiply_to_the_launched_ranks_are_refused(block):
    """As `accelerate launch` exports the block (every size, 1 where the YAML has none): dp_shard 2 x tp 2 on 8 ranks
    without a pipeline leaves 4 ranks unplaced; with --pipeline_parallel_degree 2 they are the pipeline's."""
    block(dp_replicate_size=1, dp_shard_size=2, tp_size=2)
    from training.launch import check_block_covers_the_world

    env = replace(Environment.read(), world=8)
    with pytest.raises(ValueError, match=r"gives dp_replicate_size 1 x dp_shard_size 2 x tp_size 2 = 4 ranks, but 8 "
                                         r"were launched: set parallelism_config_dp_shard_size: 4"):  # fmt: skip
        check_block_covers_the_world(env, pp=1)
    check_block_covers_the_world(env, pp=2)  # 2 x 2 x 2
