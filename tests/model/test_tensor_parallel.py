"""The exported model declares Llama's tensor-parallel plan: plain transformers splits it over 2 CPU ranks with
`from_pretrained(..., tp_plan="auto")` (column splits for q, k, v, gate, up; row splits for o, down; attention
on the local heads) and computes the logits of the whole model. Measured: at most 2.4e-7 apart (fp32)."""

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
BIN = Path(sys.executable).parent


@pytest.mark.slow
@pytest.mark.multiproc
def test_export_loads_tensor_parallel_with_tp_plan_auto(tmp_path):
    torch.manual_seed(0)
    # 4 query heads over 2 key-value heads: each rank attends with 2 query heads and 1 key-value head.
    ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug")).save_pretrained(tmp_path / "shardgpt")
    out = tmp_path / "tp.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={port}", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "shardgpt"), str(out)]
    # A session of its own, so that a hang kills the ranks too, not only torchrun.
    p = subprocess.Popen([*cmd, *args], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
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
