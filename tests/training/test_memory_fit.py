"""training/plan/memory/fit.py: a launch the planner predicts not to fit is refused with the numbers and the cheapest
fix. Capacities are given explicitly, so the cases do not depend on what this machine has free."""

from __future__ import annotations

from dataclasses import replace

import pytest

from model import ShardGPTConfig
from training.config import RunConfig
from training.launch import Launch
from training.plan.memory.fit import (
    PROCESS_BYTES,
    Capacity,
    MemoryFitError,
    Planned,
    candidate_sizes,
    check_launch_fits,
    check_memory_fit,
    largest_that_fits,
    needs,
    planned_config,
    planner_strategy,
    shortfalls,
)
from training.plan.memory.layout import layout
from training.plan.memory.planner import predict
from training.strategy import Strategy

GiB = 2**30
LLAMA_1B = ShardGPTConfig.from_preset("llama-1b")
named = Strategy.from_name


def on_gpu(launch: Planned) -> dict[str, int]:
    return dict(needs(LLAMA_1B, launch, on_gpu=True))


def test_host_ram_need_is_ranks_per_host_times_what_a_rank_keeps_in_host_memory():
    launch = Planned(named("zero3", 2), 2, "fp32", 1, 128, False)
    pred = predict(LLAMA_1B, named("zero3", 2), "fp32", 1, 128, cpu_ranks=True)
    # CPU ranks: the process and the whole prediction (with unfused AdamW's temporaries: the training script
    # fuses AdamW only on GPUs) live in host memory, for both ranks of the host.
    per_rank = PROCESS_BYTES + pred["total"] + pred["host_ram"]
    assert dict(needs(LLAMA_1B, launch, on_gpu=False)) == {"host RAM": 2 * per_rank}
    offload = replace(launch, strategy=named("zero3-offload-nvme", 8), ranks_per_host=8)
    pred = predict(LLAMA_1B, named("zero3-offload-nvme", 8), "fp32", 1, 128)
    assert on_gpu(offload) == {
        "GPU memory": pred["total"],
        "host RAM": 8 * (PROCESS_BYTES + max(pred["host_ram"], pred["host_ram_at_start"])),
        "NVMe disk": 8 * pred["nvme"],
    }


def test_a_launch_that_fits_passes_and_one_that_does_not_names_the_numbers():
    launch = Planned(named("zero3", 2), 2, "fp32", 1, 128, False)
    need = dict(needs(LLAMA_1B, launch, on_gpu=False))["host RAM"]
    check_memory_fit(LLAMA_1B, launch, Capacity(None, need))  # exactly enough
    with pytest.raises(MemoryFitError) as e:
        check_memory_fit(LLAMA_1B, launch, Capacity(None, need - 1))
    msg = str(e.value)
    assert f"host RAM needs {need / GiB:.1f} GiB for 2 ranks on this host, {(need - 1) / GiB:.1f} GiB free" in msg
    assert "--skip_memory_check" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "launch, fix",
    [
        (Planned(named("zero3", 8), 8, "bf16", 8, 2048, False), "--gradient_checkpointing"),
        (Planned(named("zero3", 8), 8, "bf16", 8, 2048, True), "--per_device_train_batch_size 4 and x2"),
        (Planned(named("ddp", 8), 8, "bf16", 1, 2048, True), "zero3.yaml"),
    ],
)
def test_the_cheapest_fix_is_the_first_change_that_fits(launch, fix):
    """GPU memory set between the launch's need and the need after the fix: that fix is the one offered, and
    the fix offered fits."""
    before = on_gpu(launch)["GPU memory"]
    changed = {
        "--gradient_checkpointing": replace(launch, checkpointing=True),
        "--per_device_train_batch_size 4 and x2": replace(launch, micro_batch=4),
        "zero3.yaml": replace(launch, strategy=named("zero3", 8)),
    }[fix]
    after = on_gpu(changed)["GPU memory"]
    assert after < before
    have = Capacity(gpu_free=after, host_free=2**50)
    assert not shortfalls(LLAMA_1B, changed, have)
    with pytest.raises(MemoryFitError, match="cheapest fix: [^;]*" + fix.replace("(", r"\(")):
        check_memory_fit(LLAMA_1B, launch, have)


def test_planner_models_the_training_scripts_strategies():
    def planned(name: str, world: int) -> tuple[str, int] | None:
        strategy = planner_strategy(named(name, world))
        return strategy and (strategy.name, strategy.world_size)

    assert planned("single", 1) == ("ddp", 1)
    assert planned("zero2-offload-cpu", 4) == ("zero2-offload-cpu", 4)
    assert planned("fsdp1-shard-grad-op", 2) == ("fsdp-shard-grad-op", 2)
    assert planned("fsdp1-no-shard", 2) == ("ddp", 2)
    assert planned("fsdp-hybrid", 8) == ("fsdp", 4)  # one of 2 replicas: FSDP over its 4 ranks
    assert planned("zero0", 2) is None  # not modelled: not checked
    assert planned("fsdp-tp2", 4) == ("fsdp-tp2", 4)  # FSDP2 x TP: dp_shard 2 x tp 2
    assert planned("fsdp-hybrid-tp2", 8) is None


def test_skip_memory_check_starts_anyway():
    huge = ShardGPTConfig.from_preset("llama-7b", num_hidden_layers=200)
    strategy = Strategy.of("ddp", 2)
    with pytest.raises(MemoryFitError):
        check_launch_fits(Launch(RunConfig(preset="llama-7b"), strategy), huge)
    check_launch_fits(Launch(RunConfig(preset="llama-7b", skip_memory_check=True), strategy), huge)


def test_the_fit_check_plans_the_vocabulary_the_run_will_have():
    """A fresh model with the default BPE has at most --tokenizer_vocab_size tokens, padded to 128; a tokenizer
    or checkpoint of its own is only known with the data, so the config's vocabulary stands."""
    assert planned_config(RunConfig(tokenizer_vocab_size=8000), LLAMA_1B).vocab_size == 8064
    assert LLAMA_1B.vocab_size == 50304  # not changed in place
    assert planned_config(RunConfig(tokenizer_name="gpt2"), LLAMA_1B) is LLAMA_1B
    assert planned_config(RunConfig(model_name_or_path="some/llama"), LLAMA_1B) is LLAMA_1B


def test_largest_that_fits_is_the_last_size_whose_needs_fit():
    """Sizes grow (presets, and shallower copies of the next preset between them); the answer fits and the next
    size up does not."""
    sizes = candidate_sizes({"vocab_size": 8192})
    psis = [layout(config).psi for _, config in sizes]
    assert psis == sorted(psis) and len(set(psis)) == len(psis)
    assert ("llama-1b num_hidden_layers=5", 5) in [(n, c.num_hidden_layers) for n, c in sizes]
    launch = Planned(named("zero3", 2), 2, "bf16", 1, 128, True)
    have = Capacity(None, 12 * GiB)
    name, config = largest_that_fits(launch, have, {"vocab_size": 8192})
    following = sizes[[n for n, _ in sizes].index(name) + 1][1]
    assert not shortfalls(config, launch, have) and shortfalls(following, launch, have)
    assert largest_that_fits(launch, Capacity(None, 1), {"vocab_size": 8192}) is None


def test_a_pipeline_is_checked_by_its_largest_stage():
    """pp 2 on 2 CPU ranks, 1F1B over 2 micro batches: each rank needs the process and its stage's prediction; the
    fit check counts the larger stage on both ranks of the host. Schedules the planner does not model are not
    checked, and a fix that halves the micro batch keeps the global batch (twice the micro batches)."""
    strategy = Strategy.of("single", 2, pp=2, pp_schedule="1F1B")
    assert planner_strategy(strategy) == strategy
    assert planner_strategy(replace(strategy, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2)) is None
    launch = Planned(strategy, 2, "fp32", 2, 128, True, micro_batches=2)
    stages = predict(LLAMA_1B, strategy, "fp32", 2, 128, True, micro_batches=2, cpu_ranks=True)["stages"]
    largest = max(max(s["total"], s["host_ram_at_start"]) for s in stages)
    need = dict(needs(LLAMA_1B, launch, on_gpu=False))["host RAM"]
    assert need == 2 * (PROCESS_BYTES + largest)
    halved = dict(needs(LLAMA_1B, replace(launch, micro_batch=1, micro_batches=4), on_gpu=False))["host RAM"]
    assert halved < need  # 1F1B keeps 2 micro batches in flight on the first stage, whatever their count
    with pytest.raises(MemoryFitError, match="pass --per_device_train_batch_size 1 and x2") as e:
        check_memory_fit(LLAMA_1B, launch, Capacity(None, halved))
    assert "zero3" not in str(e.value)  # ZeRO does not run under a pipeline
