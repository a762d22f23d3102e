"""recipes/plan_memory.py --step_time: one-line errors, --json, the plot, the published comparison."""

from __future__ import annotations

import json

import pytest

from model import ShardGPTConfig
from recipes import plan_memory
from training.plan.hardware import cluster
from training.plan.layouts import plan

BASE = ["--step_time", "--preset", "llama-1b", "--num_gpus", "16", "--global_batch", "64", "--seq_len", "1024"]


def run(capsys, *argv):
    plan_memory.main(list(argv))
    return capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "b200"], "unknown GPU kind 'b200': known kinds are h100, h200, a100-80gb, a100-40gb"),
        (["--tensor_parallel_degree", "8", "--pipeline_parallel_degree", "4"],
         "(= 32 GPUs) does not divide the 16 GPUs"),
        (["--data_parallel_degree", "16", "--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "1",
          "--sequence_parallel_degree", "1"], "(= 32 GPUs) does not divide the 16 GPUs"),
        (["--data_parallel_degree", "16", "--global_batch", "24"], "global batch 24 sequences does not divide"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        run(capsys, *BASE, *argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message in err[0]


def test_json_gives_the_printed_ranking(capsys, tmp_path):
    out = json.loads(run(capsys, *BASE, "--json", "--plot", str(tmp_path / "plan.png")).out)
    assert (tmp_path / "plan.png").stat().st_size > 0
    again = plan(ShardGPTConfig.from_preset("llama-1b"), cluster("h100", 16), 64, 1024)
    assert [r["layout"] for r in out["layouts"]] == [r["layout"] for r in again["layouts"]]
    assert out["inputs"]["cluster"]["num_gpus"] == 16
    table = run(capsys, *BASE, "--top", "3").out
    assert out["layouts"][0]["layout"] in table and "predictions, not measurements" in table


def test_attention_written_out_and_slower_memory_slow_every_layout(capsys):
    """--attn_implementation eager adds the scores' reads and writes, --hbm_gbps scales the memory-bound kernels:
    the same layouts, each slower; the inputs record what was asked."""
    pins = [*BASE, "--strategy", "fsdp", "--micro_batch", "1", "--json"]
    sdpa = json.loads(run(capsys, *pins).out)
    eager = json.loads(run(capsys, *pins, "--attn_implementation", "eager").out)
    slow = json.loads(run(capsys, *pins, "--hbm_gbps", "1000").out)
    assert eager["inputs"]["attn_implementation"] == "eager" and slow["inputs"]["cluster"]["hbm_bw"] == 1e12
    fast = {r["layout"]: r["compute_seconds"] for r in sdpa["layouts"]}
    for other in (eager, slow):
        assert {r["layout"] for r in other["layouts"]} == fast.keys()
        assert all(r["compute_seconds"] > fast[r["layout"]] for r in other["layouts"])


def test_pinned_degrees_limit_the_layouts(capsys):
    out = json.loads(run(capsys, *BASE, "--tensor_parallel_degree", "2", "--strategy", "zero1", "--json").out)
    assert out["layouts"] and all(r["degrees"]["tp"] == 2 and r["degrees"]["strategy"] == "zero1"
                                  for r in out["layouts"])  # fmt: skip


def test_any_layout_adds_megatrons_layouts_and_marks_what_train_py_runs(capsys):
    pinned = [*BASE, "--tensor_parallel_degree", "2", "--micro_batch", "1"]
    here = json.loads(run(capsys, *pinned, "--json").out)
    # AutoTP under ZeRO, FSDP2 x TP, and DDP x TP inside pipeline stages
    assert {r["degrees"]["strategy"] for r in here["layouts"]} >= {"zero1", "fsdp"}
    assert all(r["runs_here"] for r in here["layouts"]) and not here["inputs"]["any_layout"]
    assert all(r["degrees"]["pp"] > 1 for r in here["layouts"] if r["degrees"]["strategy"] == "ddp")
    every = json.loads(run(capsys, *pinned, "--any_layout", "--json").out)
    elsewhere = [r["degrees"] for r in every["layouts"] if not r["runs_here"]]
    megatron = [d for d in elsewhere if d["stack"] == "megatron-core"]
    assert megatron and {d["strategy"] for d in megatron} == {"ddp", "zero1"}
    # Megatron's sequence parallelism under each tensor-parallel layout Megatron-Core runs; the rest of the layouts
    # the script does not run recompute selectively, or are FSDP2 x TP without sequence parallelism (the script's
    # has it, in pipeline stages too).
    assert all(d["sequence_parallel"] for d in megatron)
    fsdp = [d for d in elsewhere if d["strategy"] == "fsdp" and not d["selective"]]
    assert fsdp and not any(d["sequence_parallel"] for d in fsdp)
    fsdp_here = [r["degrees"] for r in here["layouts"] if r["degrees"]["strategy"] == "fsdp"]
    assert fsdp_here and all(d["sequence_parallel"] for d in fsdp_here)
    table = run(capsys, *pinned, "--any_layout", "--top", "50").out
    assert "runs here" in table and "| no" in table and "| yes" in table
    assert "runs here" not in run(capsys, *pinned, "--top", "3").out


def test_memory_mode_keeps_its_defaults(capsys):
    out = json.loads(run(capsys, "--preset", "debug", "--num_gpus", "2", "--strategy", "zero2", "--json").out)
    assert out["inputs"]["micro_batch"] == 1 and out["inputs"]["strategy"] == "zero2"


def test_published_comparison_prints_every_row(capsys, tmp_path):
    rows = json.loads(run(capsys, "--check_published", "--json", "--plot", str(tmp_path / "published.png")).out)
    assert (tmp_path / "published.png").stat().st_size > 0  # predicted against published, drawn
    assert len(rows["megatron"]) == 17 and all(r["predicted_tflops"] > 0 for r in rows["megatron"])
    assert len(rows["llm_foundry"]) == 17 and all(0 < r["predicted_mfu"] < 1 for r in rows["llm_foundry"])
    assert len(rows["calibration"]) == 9
    # The runs tuned past what they state: Megatron-Core's README table, torchtitan's (2024; 2025's async TP and
    # Trainy's H200s), Llama 3 405B's.
    assert len(rows["tuned"]) == 33 and all(0 < r["predicted_mfu"] < 1 for r in rows["tuned"])
    table = run(capsys, "--check_published").out
    assert "1008B" in table and "BLOOM-176B" in table and "(calibration)" in table
    assert "outside the calibration, 67 runs: |error| mean" in table
    assert "Megatron-Core H100 (README) | 462B" in table and "torchtitan H100" in table and "Llama 3 405B" in table
    assert "torchtitan async TP (2025)" in table and "Trainy H200" in table
    # Megatron-LM's layouts, which recipes/train.py does not run, are still predicted: 76.1B's tp 8 x pp 4.
    row = next(r for r in rows["megatron"] if r["parameters"] == "76.1B")
    assert row["layout"] == "ddp dp32 tp8 pp4 1F1B micro 1 x56 ckpt megatron-lm-2021"
    assert round(row["predicted_tflops"]) == 137


def test_gemm_efficiency_times_each_ranks_slice_of_a_layer(capsys, tmp_path):
    """recipes/measure/gemm_efficiency.py (the measured source a size-dependent matrix efficiency needs): every linear
    layer's three GEMMs at a rank's slice, column-split outputs and row-split inputs over tp, a key-value head kept
    whole where there are fewer than ranks; measured, with the layer's FLOPs over their time."""
    from recipes.measure import gemm_efficiency

    rows = gemm_efficiency.main(["--preset", "tiny", "--tokens", "64", "--tp", "1", "4", "--repeats", "1",
                                 "--json", str(tmp_path / "gemm.json")])  # fmt: skip
    config = ShardGPTConfig.from_preset("tiny")
    d, kv = config.head_dim, config.num_key_value_heads
    shapes = {(r["tp"], r["gemm"]): (r["m"], r["k"], r["n"]) for r in rows if r["gemm"] != "layer"}
    assert shapes[1, "q forward"] == (64, config.hidden_size, config.num_attention_heads * d)
    assert shapes[4, "q forward"] == (64, config.hidden_size, config.num_attention_heads * d // 4)
    assert shapes[4, "k input grad"] == (64, max(kv // 4, 1) * d, config.hidden_size)
    assert shapes[4, "down weight grad"] == (config.intermediate_size // 4, 64, config.hidden_size)
    assert len(shapes) == 2 * 7 * 3 and all(r["flops_per_s"] > 0 for r in rows)
    assert {(r["tokens"], r["tp"]) for r in rows if r["gemm"] == "layer"} == {(64, 1), (64, 4)}
    assert json.loads((tmp_path / "gemm.json").read_text()) == rows
    assert "| 64 | 4 |" in capsys.readouterr().out
