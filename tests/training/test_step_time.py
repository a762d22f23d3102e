"""The step-time planner's cost model against its closed forms, and the orderings the published runs show."""

from __future__ import annotations

import math

import pytest

from model import ShardGPTConfig
from training.comms import ModelShape
from training.metrics import flops_per_token
from training.planning import step_time as st
from training.planning.hardware import GPU_KINDS, cluster
from training.planning.published import (
    LLM_FOUNDRY_H100,
    MEGATRON_TABLE_1,
    MEGATRON_TABLE_2,
    compare,
    compare_mfu,
    gpt_config,
    run_layout,
)
from training.planning.step_time import Layout, predict_step

CONFIG = ShardGPTConfig.from_preset("llama-1b")
SEQ = 2048


def test_ring_costs_are_nccl_tests_formulas():
    s, b = 8e9, 400e9
    for n in (2, 8, 64):
        assert st.all_reduce_seconds(s, n, b) == pytest.approx(s / b * 2 * (n - 1) / n)
        assert st.gather_seconds(s, n, b) == pytest.approx(s / b * (n - 1) / n)
    assert st.all_reduce_seconds(s, 1, b) == st.gather_seconds(s, 1, b) == 0


def test_a_group_inside_a_node_runs_at_nvlink_speed_and_one_across_nodes_at_the_nic():
    h100 = cluster("h100", 64)
    assert h100.link_bandwidth(8) == GPU_KINDS["h100"].intra_node_gbps * 1e9
    assert h100.link_bandwidth(16) == GPU_KINDS["h100"].inter_node_gbps * 1e9
    assert cluster("h100", 64, peak_tflops=500, inter_node_gbps=100).inter_node_bw == 100e9


def test_compute_is_flops_over_peak_times_efficiency_and_checkpointing_adds_a_forward():
    gpus = cluster("h100", 1)
    lay = Layout("ddp", 1, micro_batch=4, micro_batches=2)
    row = predict_step(CONFIG, gpus, lay, SEQ)
    tokens = 4 * 2 * SEQ
    assert row["compute_seconds"] == pytest.approx(flops_per_token(CONFIG, SEQ) * tokens / (989e12 * 0.4644))
    # One GPU: nothing to send, so MFU is the efficiency itself.
    assert row["communication_seconds"] == 0 and row["mfu"] == pytest.approx(gpus.efficiency)
    ckpt = predict_step(CONFIG, gpus, Layout("ddp", 1, micro_batch=4, micro_batches=2, checkpointing=True), SEQ)
    assert ckpt["compute_seconds"] == pytest.approx(4 / 3 * row["compute_seconds"])


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_of_the_pipeline_and_shrinks_with_micro_batches():
    gpus, shares, speeds = cluster("h100", 8), [], []
    for m in (4, 8, 16, 32, 64):
        row = predict_step(CONFIG, gpus, Layout("ddp", 2, pp=4, schedule="GPipe", micro_batches=m), SEQ)
        share = row["bubble_seconds"] / (row["compute_seconds"] + row["bubble_seconds"])
        assert share == pytest.approx((4 - 1) / (m + 4 - 1)) == pytest.approx(st.bubble_fraction(4, m))
        shares.append(share)
        speeds.append(row["tokens_per_second_per_gpu"])
    assert shares == sorted(shares, reverse=True) and shares[-1] < shares[0] / 5
    assert speeds == sorted(speeds)  # the same work per token, less idle: each GPU goes faster


def dp_seconds(lay: Layout, gpus) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, seconds, _ in st.data_parallel_seconds(CONFIG, gpus, lay):
        out[kind] = out.get(kind, 0.0) + seconds
    return out


def test_ddp_all_reduces_its_fp32_gradients_once_and_hides_them_behind_the_backward():
    gpus = cluster("h100", 16)  # two nodes: the ring crosses the NIC
    lay = Layout("ddp", 16, micro_batch=1, micro_batches=1)
    [(kind, seconds, window)] = st.data_parallel_seconds(CONFIG, gpus, lay)
    psi = ModelShape.of(CONFIG).parameters
    assert (kind, window) == ("all_reduce", "backward") and seconds == pytest.approx(4 * psi / 50e9 * 2 * 15 / 16)
    row = predict_step(CONFIG, gpus, lay, SEQ)
    backward = 2 / 3 * row["compute_seconds"]
    assert row["communication"]["dp_backward"] == pytest.approx(max(0, seconds - backward))
    # Under a pipeline the reduction waits for the flush: all of it is exposed.
    piped = Layout("ddp", 8, pp=2, micro_batches=4)
    [(_, seconds, window)] = st.data_parallel_seconds(CONFIG, gpus, piped)
    assert window is None and predict_step(CONFIG, gpus, piped, SEQ)["communication"]["dp_after_backward"] == seconds


def test_zero3_gathers_in_both_passes_and_reduces_every_micro_batch():
    gpus = cluster("h100", 16)
    one, four = (dp_seconds(Layout("zero3", 16, micro_batches=m), gpus) for m in (1, 4))
    for kind in ("all_gather", "reduce_scatter"):
        assert four[kind] == pytest.approx(4 * one[kind])
    # The collectives of one pass share its compute: the forward's gathers beside the forward, the backward's
    # gathers and reduce-scatters beside the backward; what exceeds it is exposed.
    windows = {w: 0.0 for w in ("forward", "backward")}
    for _, seconds, window in st.data_parallel_seconds(CONFIG, gpus, Layout("zero3", 16, micro_batches=4)):
        windows[window] += seconds
    row = predict_step(CONFIG, gpus, Layout("zero3", 16, micro_batches=4), SEQ)
    compute = row["compute_seconds"]
    assert row["communication"]["dp_forward"] == pytest.approx(max(0, windows["forward"] - compute / 3))
    assert row["communication"]["dp_backward"] == pytest.approx(max(0, windows["backward"] - 2 * compute / 3))
    # ZeRO-1 reduces once a step whatever the micro batches, and nothing hides it (overlap_comm off).
    zero1 = dp_seconds(Layout("zero1", 16, micro_batches=4), gpus)
    assert zero1 == pytest.approx(dp_seconds(Layout("zero1", 16, micro_batches=1), gpus))
    row = predict_step(CONFIG, gpus, Layout("zero1", 16, micro_batches=4), SEQ)
    assert row["communication"]["dp_after_backward"] == pytest.approx(sum(zero1.values()))


def test_tensor_parallelism_all_reduces_each_layers_activations_four_times_on_the_critical_path():
    gpus = cluster("h100", 8)
    lay = Layout("ddp", 1, tp=8, micro_batch=2, micro_batches=3)
    row = predict_step(CONFIG, gpus, lay, SEQ)
    size = 2 * 2 * SEQ * CONFIG.hidden_size  # bf16, micro batch 2
    per_call = size / 450e9 * 2 * 7 / 8
    assert row["communication"]["tp_all_reduce"] == pytest.approx(4 * CONFIG.num_hidden_layers * 3 * per_call)


def test_ulysses_exchanges_q_k_v_and_the_output_per_layer_both_ways():
    gpus = cluster("h100", 8)
    row = predict_step(CONFIG, gpus, Layout("zero3", 2, sp=4, micro_batch=2, micro_batches=3), SEQ)
    h, kv_width = CONFIG.hidden_size, CONFIG.num_key_value_heads * CONFIG.head_dim
    held = 2 * SEQ // 4  # positions of the micro batch's sequences one rank holds
    per_micro = 2 * CONFIG.num_hidden_layers * held * (2 * h + 2 * kv_width) * 2  # forward and backward, bf16
    assert row["communication"]["sp_all_to_all"] == pytest.approx(3 * per_micro / 450e9 * 3 / 4)


def test_pipeline_stages_send_activations_forward_and_gradients_back():
    gpus = cluster("h100", 16)  # the pipeline spans two nodes: its hops cross the NIC
    row = predict_step(CONFIG, gpus, Layout("ddp", 2, tp=2, pp=4, micro_batch=2, micro_batches=8), SEQ)
    message = 2 * 2 * SEQ * CONFIG.hidden_size / 2  # bf16 activations of a micro batch, split over tp
    assert row["communication"]["pp_send_recv"] == pytest.approx(2 * (8 + 4 - 1) * message / 50e9)


def test_offload_moves_the_partition_over_pcie():
    gpus = cluster("h100", 8)
    row = predict_step(CONFIG, gpus, Layout("zero2-offload-cpu", 8, micro_batches=2), SEQ)
    partition = ModelShape.of(CONFIG).parameters / 8
    up = 2 * partition / 54.9e9  # the updated bf16 partition, after the step: exposed
    assert row["offload_seconds"] >= up and row["offload_seconds"] == pytest.approx(up, rel=1e-6)  # fp32 grads hidden
    zero3 = predict_step(CONFIG, gpus, Layout("zero3-offload-cpu", 8, micro_batches=2), SEQ)
    assert zero3["offload_seconds"] == pytest.approx(up + 2 * 2 * up)  # + a fetch before each forward and backward


def test_the_plan_ranks_layouts_that_fit_fastest_first():
    gpus = cluster("h100", 16)
    result = st.plan(CONFIG, gpus, 256, SEQ)
    rows = result["layouts"]
    assert rows and result["rejected_for_memory"] > 0
    speeds = [r["tokens_per_second"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    for r in rows:
        assert r["memory_gb"] * 1e9 <= gpus.memory_bytes
        parts = r["compute_seconds"] + r["bubble_seconds"] + r["communication_seconds"] + r["offload_seconds"]
        assert r["step_seconds"] == pytest.approx(parts)
        d = r["degrees"]
        assert d["dp"] * d["tp"] * d["pp"] * d["sp"] == 16 and 256 % (d["dp"] * d["micro_batch"]) == 0
        assert r["tokens_per_step"] == 256 * SEQ


def refused_by_train_py(lay: Layout) -> str | None:
    """What training/strategy.py's checks say of a layout's degrees, spelled out from the script's rules."""
    deepspeed = lay.strategy.startswith("zero")
    if lay.pp > 1 and (deepspeed or lay.tp > 1 or lay.sp > 1):
        return "a pipeline runs under one process's optimizer, DDP or FSDP2 only"
    if lay.tp > 1 and (lay.strategy != "zero1" or lay.sp > 1):
        return "tensor parallelism is DeepSpeed AutoTP under ZeRO-1 only"
    if lay.sp > 1 and not deepspeed:
        return "Ulysses runs under DeepSpeed only"
    return None


def test_the_default_enumeration_holds_only_layouts_train_py_runs_and_any_layout_adds_megatrons():
    gpus = cluster("h100", 64)
    here = st.layouts(CONFIG, gpus, 512, SEQ)
    assert here and all(lay.runs_here and refused_by_train_py(lay) is None for lay in here)
    # Each axis the script runs is still there: AutoTP, DDP's and FSDP2's pipelines, Ulysses under ZeRO.
    assert {lay.strategy for lay in here if lay.tp > 1} == {"zero1"}
    assert {lay.strategy for lay in here if lay.pp > 1} == {"ddp", "fsdp"}
    assert {lay.strategy for lay in here if lay.sp > 1} == set(st.DEEPSPEED)
    every = st.layouts(CONFIG, gpus, 512, SEQ, any_layout=True)
    assert set(here) < set(every) and {lay for lay in every if lay.runs_here} == set(here)
    megatron = [lay for lay in every if not lay.runs_here]
    assert all(refused_by_train_py(lay) for lay in megatron)
    kinds = {(lay.strategy, lay.tp > 1, lay.pp > 1) for lay in megatron}
    assert {("ddp", True, False), ("ddp", True, True), ("zero1", False, True), ("zero1", True, True)} <= kinds
    # Pinned to a layout only Megatron-LM runs: refused in one line that names the flag, unless asked for.
    with pytest.raises(ValueError, match=r"tp 2, strategy ddp runs in recipes/train.py .* --any_layout"):
        st.layouts(CONFIG, gpus, 512, SEQ, dict(tp=2, strategy="ddp"))
    assert st.layouts(CONFIG, gpus, 512, SEQ, dict(tp=2, strategy="ddp"), any_layout=True)


def test_bad_degrees_and_batches_are_refused_in_one_line():
    gpus = cluster("h100", 8)
    with pytest.raises(ValueError, match=r"tp 4 x pp 4 = 16 do not divide the 8 GPUs"):
        st.layouts(CONFIG, gpus, 64, SEQ, dict(tp=4, pp=4))
    with pytest.raises(ValueError, match=r"= 4 do not multiply to the 8 GPUs"):
        st.layouts(CONFIG, gpus, 64, SEQ, dict(tp=2, pp=1, sp=1, dp=2))
    with pytest.raises(ValueError, match=r"global batch 12 sequences does not divide"):
        st.layouts(CONFIG, gpus, 12, SEQ, dict(dp=8))
    with pytest.raises(ValueError, match=r"unknown GPU kind 'b200': known kinds are h100, h200, a100-80gb"):
        cluster("b200", 8)


def test_zero3_per_gpu_throughput_falls_with_gpus_at_a_fixed_batch_while_tensor_and_pipeline_holds():
    """Megatron-LM 2021, Table 2: 175B, global batch 1536, 384 -> 1536 GPUs."""
    rows = compare(MEGATRON_TABLE_2)
    zero3 = [r["predicted_tflops"] for r in rows if r["layout"].startswith("zero3")]
    model_parallel = [r["predicted_tflops"] for r in rows if "tp8" in r["layout"]]
    assert zero3 == sorted(zero3, reverse=True) and zero3[-1] < zero3[0] / 2
    assert model_parallel[-1] > 0.85 * model_parallel[0]
    assert model_parallel[-1] > 2 * zero3[-1]


def test_the_published_runs_are_megatrons_layouts_predicted_as_before():
    """The comparison predicts each run's own layout, whatever the enumeration holds: Table 1's DDP x tp and tp x pp
    runs the script does not run, their numbers as docs/step_time.md prints them."""
    rows = {r["parameters"] + r["layout"]: r for r in compare(MEGATRON_TABLE_1 + MEGATRON_TABLE_2)}
    assert not any(run_layout(run).runs_here for run in MEGATRON_TABLE_1 if run.tp > 1)
    # --any_layout enumerates such a run's layout (39.1B: DDP, tp 8 x pp 2 on 512 A100s); the default does not.
    run = MEGATRON_TABLE_1[4]
    a100s, pinned = cluster("a100-80gb", run.gpus), dict(tp=run.tp, pp=run.pp)
    assert run_layout(run) in st.layouts(gpt_config(run), a100s, run.batch, SEQ, pinned, any_layout=True)
    with pytest.raises(ValueError, match="--any_layout"):
        st.layouts(gpt_config(run), a100s, run.batch, SEQ, pinned)
    for key, tflops in (("1.7Bddp dp32 micro 16 x1 ckpt", 197), ("76.1Bddp dp32 tp8 pp4 1F1B micro 1 x56 ckpt", 162),
                        ("175Bzero3 dp768 micro 2 x1 ckpt", 105)):  # fmt: skip
        assert round(rows[key]["predicted_tflops"]) == tflops


def test_megatron_table_1_is_predicted_within_half_its_published_throughput():
    rows = compare(MEGATRON_TABLE_1)
    assert all(abs(r["error"]) < 0.5 for r in rows)
    # The pipelined rows (39B and up) sit closest: their step is dominated by what the model counts.
    assert max(abs(r["error"]) for r in rows if "pp" in r["layout"]) < 0.25


def test_llm_foundry_fsdp_runs_on_h100s_are_predicted_within_half_their_mfu():
    """Published runs the efficiency constant was not taken from: other sizes, GPU counts, checkpointing."""
    rows = compare_mfu(LLM_FOUNDRY_H100)
    assert all(abs(r["error"]) < 0.5 for r in rows)
    # Activation checkpointing recomputes a forward the MFU does not count: 3/4 of the efficiency, at most.
    efficiency = GPU_KINDS["h100"].efficiency
    for r in rows:
        if r["communication_seconds"] == 0:  # nothing exposed: compute alone
            share = 3 / 4 if "ckpt" in r["layout"] else 1
            assert r["predicted_mfu"] == pytest.approx(share * efficiency)


def test_llama_3_config_files_have_the_published_sizes():
    from training.paths import ROOT

    for name, billions in (("llama-3-8b", 8.03), ("llama-3-70b", 70.55)):
        config = st.llama_config(str(ROOT / "model" / "configs" / f"{name}.json"))
        assert ModelShape.of(config).parameters / 1e9 == pytest.approx(billions, abs=0.01)
    assert math.isclose(GPU_KINDS["a100-40gb"].peak_flops, 312e12)
