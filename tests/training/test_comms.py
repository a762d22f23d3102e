"""training/loop/comms.py: the counter sees every kind of collective torch.distributed offers, DDP's from C++ and
DTensor's functional ones, and counts them in the stated convention; the model shape the closed forms read is the
model's. The training script's records of whole strategies are asserted in tests/recipes/test_strategies.py and
tests/recipes/test_communication.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from launching import ROOT, launch, launcher_command

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.plan.communication import ModelShape, expected_payloads
from training.strategy import Strategy

K = 1000  # tests/training/comms_worker.py's share, in fp32 elements
S = 4 * K


def kind(kind: str, calls: int, payload: int, volume: int, wire: int) -> dict:
    return {kind: {"calls": calls, "payload_bytes": payload, "volume_bytes": volume, "wire_bytes": wire}}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("n", [2, 4])
def test_counter_counts_every_collective(n, tmp_path):
    cmd = launcher_command("torchrun", nproc=n)
    cmd[-1] = str(ROOT / "tests" / "training" / "comms_worker.py")
    launch(cmd, [], tmp_path, timeout=180)
    ring = (n - 1) / n  # the share of a collective's volume each rank sends on a ring
    params = 4 * (K * 3 + 3)  # DDP's Linear(K, 3): weight and bias, one bucket
    want = {
        # An all-reduce's volume is twice its buffer (a reduce-scatter and an all-gather of it).
        "all_reduce": kind("all_reduce", 1, S, 2 * S, 2 * S * ring),
        # all-gather, reduce-scatter, all-to-all: the whole n x K tensor; each rank sends (n - 1) shares of K.
        "all_gather": kind("all_gather", 1, n * S, n * S, n * S * ring),
        "reduce_scatter": kind("reduce_scatter", 1, n * S, n * S, n * S * ring),
        "all_to_all": kind("all_to_all", 1, n * S, n * S, n * S * ring),
        # K sent and K received; the volume and the wire count what is sent.
        "point_to_point": kind("point_to_point", 2, 2 * S, S, S),
        "broadcast": kind("broadcast", 1, S, S, S * ring),
        "reduce": kind("reduce", 1, S, S, S * ring),
        "barrier": kind("barrier", 1, 0, 0, 0),
        "ddp": kind("all_reduce", 1, params, 2 * params, int(2 * params * ring)),  # called from the C++ reducer
        "dtensor_gather": kind("all_gather", 1, n * S, n * S, n * S * ring),  # DTensor.full_tensor
        "dtensor_norm": kind("all_reduce", 1, 4, 8, int(8 * ring)),  # a Partial norm made whole
    }
    for rank in range(n):
        seen = json.loads((tmp_path / f"comms_rank{rank}.json").read_text())
        for name, kinds in want.items():
            assert seen[name]["kinds"] == kinds, (rank, name, seen[name])
            assert seen[name]["volume_bytes"] == sum(k["volume_bytes"] for k in kinds.values())
        if rank < 2:  # an all-reduce over a group of 2: its ring has 2 ranks, whatever the world
            assert seen["pair"]["kinds"] == kind("all_reduce", 1, S, 2 * S, S), seen["pair"]
        else:
            assert "pair" not in seen


def test_model_shape_is_the_models():
    """Psi and the parts the closed forms single out, against the parameters of a built model."""
    config = ShardGPTConfig.from_preset("debug", vocab_size=384)
    with torch.device("meta"):
        net = ShardGPTForCausalLM(config)
    named = dict(net.named_parameters())  # a tied head appears once
    layers = sum(p.numel() for name, p in named.items() if ".layers." in name)
    norms = sum(p.numel() for name, p in named.items() if "norm" in name)
    shape = ModelShape.of(config, persistence_threshold=config.hidden_size)
    assert shape.parameters == sum(p.numel() for p in named.values())
    assert shape.outside_layers == shape.parameters - layers
    assert shape.tied_embedding == named["model.embed_tokens.weight"].numel()
    assert shape.persistent == shape.norms == norms  # the norms are the parameters of at most hidden elements
    untied = ModelShape.of(replace(config, tie_word_embeddings=False))
    assert (untied.parameters - shape.parameters, untied.tied_embedding) == (shape.tied_embedding, 0)


def test_closed_forms_name_what_they_do_not_model():
    shape = ModelShape(1000, 100, 50, 10)
    zero3 = Strategy.from_name("zero3", 2)
    limits = {"stage3_max_live_parameters": 500, "stage3_max_reuse_distance": 500}
    assert expected_payloads(replace(zero3, deepspeed={"zero_optimization": limits}), shape) is None
    assert expected_payloads(Strategy.from_name("zero1-autotp", 4), shape) is None
    assert expected_payloads(Strategy.from_name("ddp-pp2", 4), shape) is None
