"""training/muon.py in one process: torch's Muon and AdamW operation for operation, the groups, ZeRO's partition
layouts, and why a matrix must be orthogonalized whole (the launches under every strategy: tests/recipes/
test_muon.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.config import RunConfig
from training.muon import Muon, ZeroLayout, make_muon, muon_param_groups, newton_schulz


def debug_model() -> ShardGPTForCausalLM:
    torch.manual_seed(0)
    return ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug"))


def train(net, optimizers, steps: int = 3) -> None:
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        net(input_ids=tokens, labels=tokens).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_muon_is_torchs_muon_and_adamw_bit_for_bit():
    """One process: the project's optimizer is torch.optim.Muon on the decoder's matrices and torch.optim.AdamW on
    the rest, with the same settings, to the last bit over 3 steps."""
    cfg = RunConfig(optim="muon", learning_rate=1e-3, muon_learning_rate=0.02, muon_adjust_lr="match_rms_adamw")
    net = debug_model()
    ref = copy.deepcopy(net)
    ours = make_muon(cfg, net, None)
    muon, adamw = muon_param_groups(ref, cfg)  # the debug preset decays no embedding: no decayed AdamW group
    torch_muon = torch.optim.Muon(muon["params"], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw")  # fmt: skip
    torch_adamw = torch.optim.AdamW(adamw["params"], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    train(net, [ours])
    train(ref, [torch_muon, torch_adamw])
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert ours.orthogonalized == 14  # the last step: every matrix
    before = [p.clone() for p in net.parameters()]
    train(net, [ours], steps=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # nothing skipped


def test_the_groups_give_muon_the_decoders_matrices_only():
    net = debug_model()
    groups = {g["name"]: g for g in muon_param_groups(net, RunConfig(optim="muon", decay_embeddings=True))}
    assert set(groups) == {"muon", "adamw_decay", "adamw_no_decay"}
    assert all(len(s) == 2 for s in groups["muon"]["shapes"]) and len(groups["muon"]["shapes"]) == 14
    assert all(".layers." in n for n in groups["muon"]["names"])
    assert groups["adamw_decay"]["names"] == ["model.embed_tokens.weight"]  # the embedding (the head is tied to it)
    assert all(p.ndim == 1 for p in groups["adamw_no_decay"]["params"])  # the norms
    covered = [n for g in groups.values() for n in g["names"]]
    assert sorted(covered) == sorted(n for n, _ in net.named_parameters())


def test_a_1d_parameter_given_to_muon_is_refused():
    norm = torch.nn.Parameter(torch.ones(8))
    groups = [{"name": "muon", "use_muon": True, "params": [norm], "shapes": [(8,)], "names": ["norm"]}]
    with pytest.raises(ValueError, match=r"Muon orthogonalizes 2-D matrices only"):
        Muon(groups, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr="original", betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_layouts_place_every_matrix(stage, world):
    """ZeRO-1/2's and ZeRO-3's flat partitions, made here as DeepSpeed makes them, give every matrix back whole."""
    shapes = [(5, 3), (4, 4), (7, 2)]
    matrices = [torch.randn(s) for s in shapes]
    if stage == 3:  # each parameter partitioned on its own, padded to a multiple of the ranks
        pieces = [torch.nn.functional.pad(m.flatten(), (0, -m.numel() % world)).chunk(world) for m in matrices]
        parts = [torch.cat([p[r] for p in pieces]) for r in range(world)]
    else:  # the group flattened, padded at its end, cut in equal slices
        flat = torch.cat([m.flatten() for m in matrices])
        parts = list(torch.nn.functional.pad(flat, (0, -flat.numel() % (4 * world))).chunk(world))
    layout = ZeroLayout(stage, world)
    for whole, m in zip(layout.unpartition(shapes, parts), matrices, strict=True):
        assert torch.equal(whole, m)
    layout.check(shapes, parts[0].numel())
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"sub_group_size"):
            layout.check(shapes, parts[0].numel() - 1)
    # each rank's segments cover its partition's share of every matrix exactly once
    covered = sum(n for r in range(world) for _, _, n in layout.segments(shapes, parts[0].numel(), r))
    assert covered == sum(math.prod(s) for s in shapes)


def test_orthogonalizing_a_shard_is_not_the_update():
    """What parity at 1e-5 would catch: the rows of a matrix orthogonalized in two halves (each FSDP2 shard alone)
    differ from the whole matrix's orthogonalization by far more than that."""
    update = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    whole = newton_schulz(update, 5, "float32")
    halves = torch.cat([newton_schulz(half, 5, "float32") for half in update.chunk(2)])
    assert (halves - whole).norm() / whole.norm() > 0.1
    assert torch.allclose(newton_schulz(update, 5, "bfloat16").float(), whole, atol=0.05)  # torch's, in bf16


def test_muons_flags_are_checked():
    with pytest.raises(ValueError, match=r"--optim 'lion' is unknown"):
        RunConfig(optim="lion").validate(1)
    with pytest.raises(ValueError, match=r"--muon_momentum without --optim muon"):
        RunConfig(muon_momentum=0.9).validate(1)
    with pytest.raises(ValueError, match=r"--muon_momentum 1.0 must be in \[0, 1\)"):
        RunConfig(optim="muon", muon_momentum=1.0).validate(1)


def test_strategies_muon_cannot_run_under_are_refused_in_one_line():
    from training.core.family import family_named
    from training.launch import muon_refusal
    from training.strategy import Strategy

    fsdp1 = Strategy.of("fsdp", 2, fsdp_version=1)
    assert "FSDP1 hands the optimizer flat parameters" in muon_refusal(family_named("fsdp", 1), fsdp1)
    tp = Strategy.of("fsdp", 4, tp=2, fsdp_version=2)
    assert "--optim muon with tensor parallelism of degree 2" in muon_refusal(family_named("fsdp"), tp)
    offload = Strategy.of("fsdp", 2, fsdp_version=2, offload_param="cpu", offload_optimizer="cpu")
    assert "an offloaded optimizer" in muon_refusal(family_named("fsdp"), offload)
    for family, strategy in (("ddp", Strategy.of("ddp", 2)), ("fsdp", Strategy.of("fsdp", 2, fsdp_version=2))):
        assert muon_refusal(family_named(family), strategy) is None
