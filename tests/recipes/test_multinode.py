"""Two nodes simulated on one machine: two `accelerate launch` commands with machine ranks 0 and 1, one
process each, meeting on loopback, train exactly as one node with 2 ranks does."""

from __future__ import annotations

import os
import subprocess

import pytest
from launching import BIN, ROOT, TIMEOUT, Run, free_port, launch, launcher_command

TRAIN = [
    "--preset=debug", "--max_steps=10", "--warmup_steps=2", "--learning_rate=3e-3", "--logging_steps=1",
    "--eval_steps=0", "--save_steps=5", "--sample_max_new_tokens=0", "--per_device_train_batch_size=4",
]  # fmt: skip


def launch_two_nodes(config: str, args: list[str], out) -> Run:
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    nodes = []
    for rank in (0, 1):
        cmd = [
            str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "--deepspeed_multinode_launcher", "standard",
            str(ROOT / "recipes" / "train.py"), *args, "--output_dir", str(out),
        ]  # fmt: skip
        if "zero" not in config:
            cmd.remove("--deepspeed_multinode_launcher")
            cmd.remove("standard")
        nodes.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    try:
        for p in nodes:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in nodes:
            p.kill()
    for rank, (code, _, stderr) in enumerate(results):
        if code != 0:
            pytest.fail(f"node {rank} failed ({code}):\n{stderr[-6000:]}")
    return Run(out, results[0][1], results[0][2], 0)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_two_nodes_train_like_one(config, corpus, tmp_path):
    one = launch(launcher_command("accelerate", config), [*corpus["flags"], *TRAIN], tmp_path / "one_node")
    two = launch_two_nodes(config, [*corpus["flags"], *TRAIN], tmp_path / "two_nodes")
    assert two.strategy["world_size"] == 2 and two.strategy["strategy"] == one.strategy["strategy"]
    assert two.losses == pytest.approx(one.losses, rel=1e-6)
    assert (tmp_path / "two_nodes" / "checkpoint-10" / "checkpoint_complete").exists()
