"""recipes/compare.py: one command runs several strategies on 2 CPU ranks and writes one report; a failing
strategy is reported with its error while the others complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import compare
from training.compare.launches import last_error
from training.compare.logs import load_seconds, median_after_first

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
GOOD = ("ddp", "zero2", "fsdp")


def table_rows(report: str) -> dict[str, dict[str, str]]:
    """The report's markdown table as {strategy: {column: cell}}."""
    lines = [s for s in report.splitlines() if s.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split(" | ")]
        rows[cells[0]] = dict(zip(head, cells, strict=False))
    return rows


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.mark.slow
@pytest.mark.multiproc
def test_compare_reports_every_strategy_and_the_failures(corpus, tmp_path):
    # A launch that really starts and fails (the training script refuses a DeepSpeed JSON with a typo), and a
    # config name that does not exist.
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["zero_optimisation"] = ds.pop("zero_optimization")
    (tmp_path / "typo.json").write_text(json.dumps(ds))
    yaml = (ROOT / "accelerate_configs" / "zero2.yaml").read_text()
    (tmp_path / "typo_zero2.yaml").write_text(yaml.replace("ds_configs/zero2.json", str(tmp_path / "typo.json")))
    out = tmp_path / "report"
    strategies = ",".join([*GOOD, "nope", str(tmp_path / "typo_zero2.yaml")])
    p = run_compare(strategies, out, corpus)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "3/5 strategies ran" in p.stdout

    rows = table_rows((out / "report.md").read_text())
    assert list(rows) == [*GOOD, "nope", "typo_zero2"]
    for name in GOOD:
        row = rows[name]
        assert row["in force (params/rank)"].startswith(name), row
        assert number(row["tokens/s"]) > 0 and number(row["step time (s)"]) > 0
        assert row["MFU"] == "n/a"  # CPU: no peak FLOP/s
        per_rank = [number(v) for v in row["peak RSS per rank (GB)"].split(" / ")]
        assert len(per_rank) == 2 and all(0.05 < v < 20 for v in per_rank)
        assert number(row["checkpoint (MB)"]) > 0
        assert 0 <= number(row["save (s)"]) < 60 and 0 <= number(row["load (s)"]) < 60
        assert 2 < number(row["final loss"]) < 10
        assert number(row["max abs loss diff vs ddp"]) < 1e-4  # the same model, data and global batch
        # On a ring of 2 ranks each sends half the paper's volume.
        assert number(row["sent/rank/step (MB)"]) == pytest.approx(number(row["comm. volume/step (MB)"]) / 2, abs=1e-3)
    # DeepSpeed all-reduces ZeRO-2's gradient buckets and then all-gathers the partitions: 3 Psi a step to DDP's 2
    # (training/loop/comms.py's closed forms, asserted to the byte in tests/recipes/test_strategies.py).
    volume = {name: number(rows[name]["comm. volume/step (MB)"]) for name in GOOD}
    assert volume["zero2"] / volume["ddp"] == pytest.approx(1.5, rel=2e-3), volume
    assert (
        "FAILED" in rows["nope"]["in force (params/rank)"]
        and "no such config" in rows["nope"]["in force (params/rank)"]
    )
    failed = rows["typo_zero2"]["in force (params/rank)"]
    assert "FAILED" in failed and "unknown key 'zero_optimisation'" in failed

    results = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    assert [runs[n]["ok"] for n in (*GOOD, "nope", "typo_zero2")] == [True, True, True, False, False]
    assert sorted(runs["ddp"]["losses"], key=int) == [str(s) for s in range(1, STEPS + 1)]
    assert runs["fsdp"]["local_parameter_fraction"] == pytest.approx(0.5, abs=0.02)
    assert "accelerate launch --config_file accelerate_configs/zero2.yaml" in runs["zero2"]["command"]
    for png in ("memory.png", "throughput.png", "loss.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
        assert f"]({png})" in (out / "report.md").read_text()


def run_compare(strategies: str, out: Path, corpus: dict) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "recipes/compare.py", "--preset", "debug", "--strategies", strategies, "--steps", str(STEPS),
        "--nproc", "2", "--no_trainer", "--output_dir", str(out), *corpus["flags"],
    ]  # fmt: skip
    # Fresh ranks, not the rank server's: compare reads each rank's peak memory from the launcher's children.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def test_tensor_parallel_rows_keep_the_global_batch():
    """autotp is in "all"; its 2 tensor-parallel ranks share one micro batch, so it gets twice the others' (the
    same global batch). fsdp_tp, whose YAML launches 4 ranks (dp_shard 2 x tp 2), is left out of "all"."""
    assert "autotp" in compare.single_node_configs() and "fsdp_tp" not in compare.single_node_configs()
    args, _ = compare.parse_args(["--strategies", "ddp,autotp,single"])
    specs = {s.name: s for s in compare.make_specs(args.strategies, 2, trainer=False)}
    micro = {n: next(f for f in compare.train_flags(args, s, []) if "per_device" in f) for n, s in specs.items()}
    assert (specs["autotp"].tp, specs["autotp"].nproc) == (2, 2)
    assert micro == {n: "--per_device_train_batch_size=8" if n != "ddp" else "--per_device_train_batch_size=4"
                     for n in specs}  # fmt: skip
    # On 4 ranks fsdp_tp runs by name (dp_shard 2 x tp 2): each pair shares a micro batch of twice the others'.
    args, _ = compare.parse_args(["--strategies", "ddp,fsdp_tp", "--nproc", "4"])
    specs = {s.name: s for s in compare.make_specs(args.strategies, 4, trainer=False)}
    assert (specs["fsdp_tp"].tp, specs["fsdp_tp"].nproc, specs["fsdp_tp"].error) == (2, 4, None)
    assert next(f for f in compare.train_flags(args, specs["fsdp_tp"], []) if "per_device" in f).endswith("=8")


def test_pipeline_rows_keep_the_global_batch():
    """`ddp+pp2`: ddp.yaml with 2 pipeline stages, whose ranks run twice the micro batches (the same global batch);
    a degree that does not divide the ranks is reported, not launched."""
    args, _ = compare.parse_args(["--strategies", "ddp,ddp+pp2,fsdp+pp3", "--gradient_accumulation_steps", "2"])
    specs = {s.name: s for s in compare.make_specs(args.strategies, 2, trainer=False)}
    flags = compare.train_flags(args, specs["ddp+pp2"], [])
    assert specs["ddp+pp2"].config.name == "ddp.yaml" and specs["ddp+pp2"].error is None
    wanted = {"--pipeline_parallel_degree=2", "--gradient_accumulation_steps=4", "--per_device_train_batch_size=4"}
    assert wanted <= set(flags), flags
    assert "a pipeline is spelled <config>+pp<P>" in specs["fsdp+pp3"].error


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.matrix
def test_compare_reports_autotp_and_a_pipeline_beside_ddp(corpus, tmp_path):
    """The autotp row: DeepSpeed AutoTP in force, the same losses as DDP (same model, data, global batch), its
    checkpoint saved and loaded, and the planner's prediction for it; the ddp+pp2 row likewise, with 2 pipeline
    stages in force (one DDP launch serves both as the reference)."""
    out = tmp_path / "report"
    p = run_compare("ddp,autotp,ddp+pp2", out, corpus)
    assert p.returncode == 0 and "3/3 strategies ran" in p.stdout, p.stderr[-4000:]
    rows = table_rows((out / "report.md").read_text())
    for name, in_force in (("autotp", "zero1-autotp"), ("ddp+pp2", "single-pp2")):
        row = rows[name]
        assert row["in force (params/rank)"].startswith(in_force), row
        assert number(row["max abs loss diff vs ddp"]) < 1e-4
        assert number(row["checkpoint (MB)"]) > 0 and 0 <= number(row["load (s)"]) < 60
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["autotp"]["local_parameter_fraction"] == pytest.approx(0.5, abs=0.02)
    assert runs["autotp"]["prediction"]["model_states"] < runs["ddp"]["prediction"]["model_states"]
    stages = runs["ddp+pp2"]["prediction"]["stages"]  # planned stage by stage: 1F1B keeps 2, then 1 in flight
    assert [s["inputs"]["micro_batches_in_flight"] for s in stages] == [2, 1]


def test_error_line_and_log_parsing():
    launcher_tail = (
        "error: DeepSpeed config 'x.json': unknown key 'zero_optimisation'\n"
        "Traceback (most recent call last):\n"
        "subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit status 2.\n"
    )
    assert last_error(launcher_tail, 1) == "error: DeepSpeed config 'x.json': unknown key 'zero_optimisation'"
    assert last_error("[rank0]: RuntimeError: boom\n[rank0]:   \n", 1) == "RuntimeError: boom"
    assert last_error("", 3) == "exit code 3"
    log = (
        "2026-01-02 03:04:05,100 INFO strategy in force: {...}\n"
        "2026-01-02 03:04:05,350 INFO [RANK 0] Loading states from x\n"
        "2026-01-02 03:04:06,025 INFO resumed from runs/x/checkpoint-5 at step 5\n"
    )
    assert load_seconds(log) == pytest.approx(0.925)
    assert load_seconds("no stamps") is None
    records = [{"tokens_per_sec": v} for v in (10.0, 100.0, 300.0, 200.0)]
    assert median_after_first(records, "tokens_per_sec") == 200.0  # the first (warm-up) step is left out
    assert median_after_first([{"mfu": None}], "mfu") is None
