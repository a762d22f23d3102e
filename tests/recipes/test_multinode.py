"""Two nodes simulated on one machine: two `accelerate launch` commands with machine ranks 0 and 1 meeting on
loopback train exactly as one node with 2 ranks does. The multi-node YAMLs of accelerate_configs/ are launched
as written, with only what every user edits on the command line: the address of node 0, the port, the total
number of processes and, for hybrid sharding, the GPUs per node."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from communication import assert_closed_form
from hub import assert_loads_as_the_hub_does
from launching import (
    BIN,
    ROOT,
    TIMEOUT,
    Run,
    build_deepspeed_ops,
    deepspeed_ops,
    free_port,
    launch_env,
    log_launch,
    rank_server,
)
from parity import STEPS, cell_args, cell_run


def launch_two_nodes(config: str, args: list[str], out, per_node: int = 1, extra: tuple[str, ...] = ()) -> Run:
    """`accelerate launch --machine_rank R` of accelerate_configs/<config>.yaml for R = 0, 1 on loopback."""
    port = str(free_port())
    env = {**launch_env(), **rank_server().get("env", {})}  # the ranks from the rank server, through PYTHON_EXEC
    yaml = str(ROOT / "accelerate_configs" / f"{config}.yaml")
    build_deepspeed_ops(deepspeed_ops([yaml], args))
    started = time.perf_counter()
    nodes = []
    for rank in (0, 1):
        cmd = [
            str(BIN / "accelerate"), "launch", "--config_file", yaml,
            "--num_machines", "2", "--num_processes", str(2 * per_node), "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, *extra,
            str(ROOT / "recipes" / "train.py"), *args, "--output_dir", str(out),
        ]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    results = []
    try:
        for p in nodes:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    run = Run(out, results[0][1], results[0][2], max(code for code, _, _ in results))
    log_launch([str(BIN / "accelerate"), yaml, "train.py"], args, run, time.perf_counter() - started)
    for rank, (code, _, stderr) in enumerate(results):
        if code != 0:
            pytest.fail(f"node {rank} failed ({code}):\n{stderr[-6000:]}")
    return run


def per_rank(flag: str, per_node: int) -> str:
    """The micro batch of a flag list divided over `per_node` ranks of a node (the global batch kept)."""
    name, _, value = flag.partition("=")
    return f"{name}={int(value) // per_node}" if name == "--per_device_train_batch_size" else flag


# (one-node config, two-node config as in accelerate_configs/, ranks per node, extra launch flags)
NODES = [
    ("fsdp", "fsdp", 1, ()),
    ("zero3", "multinode_zero3", 1, ()),
    # DDP, and the single-node ZeRO-3 YAML with the standard launcher named on the command line: `make test-matrix`.
    pytest.param("ddp", "ddp", 1, (), marks=pytest.mark.matrix),
    pytest.param("zero3", "zero3", 1, ("--deepspeed_multinode_launcher", "standard"), marks=pytest.mark.matrix),
    # Hybrid shard: shards within a node (2 ranks), replicas across the 2 nodes: 4 ranks, micro batch 2.
    ("fsdp", "fsdp_hybrid_multinode", 2, ("--parallelism_config_dp_shard_size", "2")),
]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("single", "config", "per_node", "extra"), NODES, ids=lambda v: str(v))
def test_two_nodes_train_like_one(single, config, per_node, extra, corpus, tmp_path, tmp_path_factory):
    # One node: tests/recipes/parity.py's cell of the config (checkpoints every 5 steps); two nodes: its flags, the
    # micro batch split over the ranks of a node.
    one = cell_run("accelerate", single, corpus, tmp_path_factory)
    args = [per_rank(a, per_node) for a in cell_args("accelerate", single, corpus, tmp_path)]
    two = launch_two_nodes(config, args, tmp_path / "two_nodes", per_node, extra)
    hybrid = "fsdp-hybrid" if "hybrid" in config else one.strategy["strategy"]
    assert two.strategy["world_size"] == 2 * per_node and two.strategy["strategy"] == hybrid
    # Each rank holds what one node's ranks hold: hybrid sharding shards over a node's 2 ranks, not all 4.
    assert two.strategy["local_parameter_fraction"] == one.strategy["local_parameter_fraction"]
    assert sorted(two.losses) == sorted(one.losses) == list(range(1, STEPS + 1))
    # Same ranks: the same sums in the same order. Four ranks sum the gradients in another order (see
    # test_strategies' tolerance).
    assert two.losses == pytest.approx(one.losses, rel=1e-6 if per_node == 1 else 1e-5)
    norms = [{r["step"]: r["grad_norm"] for r in run.records if "loss" in r} for run in (two, one)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)  # summed in float64 on every strategy
    assert_loads_as_the_hub_does(two.output_dir, one.output_dir, atol=1e-4)  # the two-node export, as users load it
    assert (tmp_path / "two_nodes" / "checkpoint-10" / "checkpoint_complete").exists()
    # What each rank sent in the third step, to the byte: hybrid sharding gathers and reduce-scatters within a node
    # and all-reduces each rank's shard of the gradients across the nodes.
    assert_closed_form(two)
