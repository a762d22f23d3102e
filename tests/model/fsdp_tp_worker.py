"""FSDP2 x tensor parallelism of shardgpt with torch's own APIs, on every rank of a torchrun launch (gloo on CPU):
the model's `base_model_tp_plan` translated to torch's styles ("colwise" -> ColwiseParallel, "rowwise" ->
RowwiseParallel) and applied with `parallelize_module` on the mesh's `tp` dimension, then `fully_shard` (FSDP2)
of each decoder layer and of the root on its `dp_shard` dimension; trained with AdamW on fixed random batches, each
data-parallel group on its share of the global batch. Every rank first trains a whole copy alone on the whole
global batch: the one-process run the sharded one must repeat.

    torchrun --nproc_per_node 4 fsdp_tp_worker.py TP STEPS CHECKPOINT_DIR RESULTS_JSON

The world is dp_shard x TP ranks, TP innermost (ranks 0..TP-1 share a batch), as accelerate's mesh orders them.
Rank 0 writes {"reference": [loss per step], "sharded": [loss per step], "splits": {module: check}, "local": ...}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.core.ranks import run_rank

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
GLOBAL_BATCH, SEQ, LR = 8, 32, 3e-3


def torch_plan(net: ShardGPTForCausalLM) -> dict:
    """The config's base_model_tp_plan ("layers.*.self_attn.q_proj": "colwise", ...) as torch's parallel styles,
    keyed by module path from the causal-LM model (the decoder is `model`)."""
    return {f"model.{pattern}": STYLES[style]() for pattern, style in net.config.base_model_tp_plan.items()}


def batches(vocab: int, steps: int) -> list[torch.Tensor]:
    """Two random global batches in turn: the model learns them, so the loss falls and the steps differ."""
    generator = torch.Generator().manual_seed(1)
    two = [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(2)]
    return [two[step % 2] for step in range(steps)]


def adamw(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    """AdamW steps on `data` (this rank's rows of each global batch); the loss is the mean over the tokens of
    the rows given, and FSDP2 averages the gradients over the data-parallel ranks, whose shares are equal."""
    losses = []
    for ids in data:
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        if dist.is_initialized():  # collective: the mean over the data-parallel shares (equal token counts)
            dist.all_reduce(global_loss)
            global_loss /= dist.get_world_size()
        losses.append(global_loss.item())
    return losses


def sharded(whole: ShardGPTForCausalLM, mesh) -> ShardGPTForCausalLM:
    """A copy of `whole` split by the plan over the mesh's `tp` ranks, then (FSDP2) over its `dp_shard` ranks:
    each decoder layer, then the root (embedding, final norm, head)."""
    net = copy.deepcopy(whole)
    parallelize_module(net, mesh["tp"], torch_plan(net))
    if mesh["dp_shard"].size() > 1:
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(net, mesh=mesh["dp_shard"])
    return net


def split_checks(net: ShardGPTForCausalLM, whole: ShardGPTForCausalLM, mesh) -> dict:
    """Each planned module of layer 0 holds exactly its slice of the whole weight: the tp rank's rows (output
    features) for colwise, its columns (input features) for rowwise; of that, FSDP2 keeps the dp rank's chunk of
    rows."""
    tp, tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    dp, dp_rank = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    out = {}
    for pattern, style in net.config.base_model_tp_plan.items():
        name = pattern.replace("*", "0")
        full = whole.model.get_submodule(name).weight.detach()
        dim = 0 if style == "colwise" else 1
        expected = full.chunk(tp, dim=dim)[tp_rank].chunk(dp, dim=0)[dp_rank]
        local = net.model.get_submodule(name).weight.to_local()
        out[name] = {
            "style": style,
            "local_shape": list(local.shape),
            "whole_shape": list(full.shape),
            "equal_to_slice": bool(torch.equal(local, expected)),
        }
    return out


def main(tp: int, steps: int, checkpoint: str, results: str) -> None:
    torch.manual_seed(0)
    whole = ShardGPTForCausalLM(ShardGPTConfig.from_preset("debug", vocab_size=512))
    data = batches(whole.config.vocab_size, steps)
    # The one-process run, before the process group exists: a whole copy on the whole global batch.
    reference_net = copy.deepcopy(whole)
    reference = train(reference_net, adamw(reference_net), data)

    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))  # collective; tp innermost
    net = sharded(whole, mesh)
    splits = split_checks(net, whole, mesh)
    dp_rank, share = mesh["dp_shard"].get_local_rank(), GLOBAL_BATCH // dp
    data = [ids[dp_rank * share : (dp_rank + 1) * share] for ids in data]  # this data-parallel group's rows
    optimizer, half = adamw(net), steps // 2
    losses = train(net, optimizer, data[:half])
    # A checkpoint halfway (collective: every rank writes its shards with torch.distributed.checkpoint), then a
    # fresh sharded copy of the initial weights resumes from it and trains the second half again.
    dcp.save(dict(zip(("model", "optim"), get_state_dict(net, optimizer), strict=True)), checkpoint_id=checkpoint)
    losses += train(net, optimizer, data[half:])
    resumed_net = sharded(whole, mesh)
    resumed_optimizer = adamw(resumed_net)
    state = dict(zip(("model", "optim"), get_state_dict(resumed_net, resumed_optimizer), strict=True))
    dcp.load(state, checkpoint_id=checkpoint)  # collective
    set_state_dict(resumed_net, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train(resumed_net, resumed_optimizer, data[half:])
    # The export: whole weights gathered from both dimensions of the mesh (collective), against the one process's.
    exported = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    expected = reference_net.state_dict()
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in net.parameters())
    if rank == 0:  # rank 0 only: the file write
        Path(results).write_text(json.dumps({
            "reference": reference, "sharded": losses, "resumed": resumed, "splits": splits,
            "local_fraction": local / sum(p.numel() for p in whole.parameters()),
            "export_keys": sorted(exported) == sorted(expected),
            "export_max_abs_diff": max((exported[k] - expected[k]).abs().max().item() for k in expected),
            "placements": {name: [str(p) for p in param.placements] for name, param in net.named_parameters()
                           if name.startswith("model.layers.0.") and isinstance(param, DTensor)},
        }))  # fmt: skip
    dist.barrier()  # collective: nobody tears the group down before rank 0 has written
    dist.destroy_process_group()


if __name__ == "__main__":
    # run_rank ends the rank without interpreter finalization: gloo's threads, kept by FSDP2, have aborted a
    # finished rank there ("terminate called without an active exception", seen with 2 cores shared)
    run_rank(lambda: main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
