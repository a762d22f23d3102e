"""The model's tensor-parallel plan, proven on CPU ranks (gloo).

The exported model declares Llama's plan: plain transformers splits it over 2 CPU ranks with
`from_pretrained(..., tp_plan="auto")` (column splits for q, k, v, gate, up; row splits for o, down; attention
on the local heads) and computes the logits of the whole model. Measured: at most 2.4e-7 apart (fp32).

FSDP2 x TP with torch's own APIs (`fsdp_tp_worker.py`): the plan applied by `parallelize_module`, FSDP2's
`fully_shard` over the data-parallel ranks, 20 AdamW steps. accelerate 1.15 cannot prepare such a model with
transformers 5.23 (docs/strategies.md, "Tensor parallelism"), so this is the proof that the model's plan trains
under FSDP2 x TP. Measured (fp32, debug preset): losses at most 2.1e-7 relative from one process's over the 20 steps
on 2 ranks (tp 2) and 4 ranks (dp_shard 2 x tp 2); the gathered weights after 20 steps at most 2.2e-5 from the one
process's (magnitudes up to about 1); a resume from the step-10 checkpoint repeats steps 11-20 exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import ShardGPTConfig, ShardGPTForCausalLM

WORKER = Path(__file__).with_name("tp_worker.py")
FSDP_TP_WORKER = Path(__file__).with_name("fsdp_tp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def torchrun(worker: Path, nproc: int, args: list[str], cwd: Path, env: dict | None = None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--master_port={port}", str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # A session of its own, so that a hang kills the ranks too, not only torchrun.
    p = subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.slow
@pytest.mark.multiproc
def test_export_loads_tensor_parallel_with_tp_plan_auto(tmp_path):
    torch.manual_seed(0)
    # 4 query heads over 2 key-value heads: each rank attends with 2 query heads and 1 key-value head.
    ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug")).save_pretrained(tmp_path / "shardgpt")
    out = tmp_path / "tp.json"
    torchrun(WORKER, 2, [str(tmp_path / "shardgpt"), str(out)], tmp_path)
    seen = json.loads(out.read_text())
    # debug preset: hidden 64, 4 heads x 16, 2 key-value heads, intermediate 176; weights are (out, in).
    assert seen["shards"] == {
        "self_attn.q_proj": [[32, 64], ["S(0)"]],
        "self_attn.k_proj": [[16, 64], ["S(0)"]],
        "self_attn.o_proj": [[64, 32], ["S(1)"]],
        "mlp.up_proj": [[88, 64], ["S(0)"]],
        "mlp.down_proj": [[64, 88], ["S(1)"]],
    }
    assert seen["logits_max_abs_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4], ids=["tp2", "dp_shard2_x_tp2"])
def test_fsdp2_x_tensor_parallel_trains_like_one_process(nproc, tmp_path):
    """2 ranks: the plan alone (tp 2, nothing left for FSDP to shard); 4 ranks (2 cores oversubscribed): FSDP2 over
    2 data-parallel ranks of tensor-parallel pairs, which read one half of each global batch of 8."""
    out = tmp_path / "fsdp_tp.json"
    torchrun(FSDP_TP_WORKER, nproc, ["2", "20", str(tmp_path / "checkpoint"), str(out)], tmp_path,
             {"PYTHONPATH": str(ROOT)})  # fmt: skip
    seen = json.loads(out.read_text())
    reference, losses = seen["reference"], seen["sharded"]
    assert len(losses) == len(reference) == 20
    assert reference[-1] < reference[0] - 1  # it learns: the steps differ
    for step, (got, want) in enumerate(zip(losses, reference, strict=True), start=1):
        assert got == pytest.approx(want, rel=1e-6 if step == 1 else 1e-5), f"step {step}"
    assert seen["resumed"] == losses[10:]  # the step-10 checkpoint resumes exactly
    assert seen["export_keys"] and seen["export_max_abs_diff"] < 1e-4
    # debug preset (hidden 64, 4 heads x 16, 2 key-value heads, intermediate 176), weights (out, in): each rank's
    # local weight is its tp slice (rows for colwise, columns for rowwise), and FSDP2's chunk of that slice's rows.
    dp = nproc // 2
    want = {"self_attn.q_proj": [32 // dp, 64], "self_attn.k_proj": [16 // dp, 64], "self_attn.v_proj": [16 // dp, 64],
            "self_attn.o_proj": [64 // dp, 32], "mlp.gate_proj": [88 // dp, 64], "mlp.up_proj": [88 // dp, 64],
            "mlp.down_proj": [64 // dp, 88]}  # fmt: skip
    assert {name.removeprefix("layers.0."): c["local_shape"] for name, c in seen["splits"].items()} == want
    assert all(c["equal_to_slice"] for c in seen["splits"].values()), seen["splits"]
    placements = seen["placements"]  # layer 0's DTensors: (tp,) or (dp_shard, tp)
    colwise, rowwise = (placements[f"model.layers.0.self_attn.{m}.weight"] for m in ("q_proj", "o_proj"))
    assert (colwise, rowwise) == ((["S(0)"], ["S(1)"]) if dp == 1 else (["_S(0, 2)", "S(0)"], ["S(0)", "S(1)"]))
