"""The bytes a rank holds for its backward under tensor parallelism, with and without Megatron's sequence
parallelism, measured decoder layer by decoder layer against the planner (`layer_activation_bytes`) and against
Korthikanti et al. 2022's accounting (their equations for a GPT layer, section 4).

Each case runs `tp` processes (gloo) that build the model, split it by its plan as the training script does
(training/axes/tensor/plan.py: `torch_plan`, or `sequence_parallel_plan` under sequence parallelism) over a one-axis
`DeviceMesh`, and take one training forward of the same micro batch (every tensor-parallel rank reads the whole
batch), counting the tensors autograd saves (training/measure/saved.py, a DTensor by its local shard): each decoder
layer's bytes are the held bytes its forward added. tp = 1 is one process, the model whole. Collectives: the plan's
weights distributed, each layer's all-reduces (all-gathers and reduce-scatters under sequence parallelism).
"""

from __future__ import annotations

import torch

from model import ShardGPTConfig, ShardGPTForCausalLM
from training.measure.saved import HeldBytes, PerOpPolicy
from training.measure.spawned import config_for, join, run_ranks
from training.plan.memory.activations import (
    activation_bytes,
    layer_activation_bytes,
    saved_loss_bytes,
    selective_layer_bytes,
)


def _rank(rank: int, tp: int, port: int, queue, sequence_parallel: bool, preset: str, micro: int, block: int,
          dtype: str, selective: bool) -> None:  # fmt: skip
    join(rank, tp, port)
    config = config_for(preset, block)
    torch.manual_seed(0)  # the same weights and batch on every rank
    net = ShardGPTForCausalLM(config).to(getattr(torch, dtype)).train()
    policy = PerOpPolicy() if selective else None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from training.axes.tensor.plan import (
            save_sequence_shards,
            sequence_parallel_plan,
            tie_split_embedding,
            torch_plan,
        )

        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))  # collective
        plan = sequence_parallel_plan(config) if sequence_parallel else torch_plan(config)
        parallelize_module(net, mesh, plan)  # collective: each rank keeps its slices
        if sequence_parallel and not selective:
            save_sequence_shards(net.model.layers)  # as the training script
        tie_split_embedding(net)
    if policy is not None:  # torchtitan's per-op selective recomputation over each decoder layer
        net.model.layers = policy.wrap(net.model.layers)
    tokens = torch.randint(0, config.vocab_size, (micro, block + 1))
    counter = HeldBytes(net.parameters())

    def held() -> int:
        return counter.now + (policy.kept if policy is not None else 0)

    layers: list[int] = []
    for layer in net.model.layers:  # what each layer's forward adds to the held bytes
        layer.register_forward_pre_hook(lambda *_: layers.append(-held()))
        layer.register_forward_hook(lambda *_: layers.__setitem__(-1, layers[-1] + held()))
    with counter.saving():
        loss = net(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss  # collectives inside: the layers'
    queue.put((rank, (layers, counter.peak)))
    loss.backward()  # collectives inside: the transposes
    if tp > 1:
        torch.distributed.destroy_process_group()


def korthikanti_bytes(config: ShardGPTConfig, e: int, tp: int, sequence_parallel: bool) -> float:
    """Korthikanti et al. 2022's activation bytes per token of one GPT layer (equations 1-3, s = b = 1), with their
    GPT's shape (an MLP of 4h, LayerNorm, dropout) at this model's hidden size and their 16-bit activations scaled to
    e bytes: sbh (10 + 24 / t + 5as / ht) under tensor parallelism, sbh (34 + 5as / h) / t with sequence
    parallelism. Their attention term (the T x T scores and softmax) is per sequence of `seq_len` tokens: left out here,
    as the flash and memory-efficient kernels keep none."""
    h, scale = config.hidden_size, e / 2
    if sequence_parallel:
        return scale * h * 34 / tp
    return scale * h * (10 + 24 / tp)


def measure(tp: int, sequence_parallel: bool, preset: str, micro: int, block: int, dtype: str = "float32",
            selective: bool = False) -> dict:  # fmt: skip
    """One case: what each decoder layer's forward saved on each of the `tp` ranks (the most over the ranks), beside
    the planner's figure and Korthikanti et al.'s, per token; `selective`: each layer under torchtitan's per-op
    selective recomputation (`saved.PerOpPolicy`), what it keeps, beside `selective_layer_bytes`."""
    from training.axes.tensor.checks import check_tensor_parallel

    config, e = config_for(preset, block), torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    check_tensor_parallel(config, tp, flag="tp")  # a layer the degree does not split: refused
    got = run_ranks(_rank, tp, sequence_parallel, preset, micro, block, dtype, selective,
                    what=f"tp={tp} sequence_parallel={sequence_parallel} selective={selective}")  # fmt: skip
    tokens = micro * block
    layer = max(layers[-1] for layers, _ in got.values())  # the last: the first also holds rotary's cos and sin
    sequence = sequence_parallel and tp > 1
    planned_peak = activation_bytes(config, micro, block, e, False, tp, sequence_parallel=sequence)
    # the chunked loss: over vocabulary shards under sequence parallelism (the training script's plan), else whole
    planned_peak += saved_loss_bytes(config, micro, block, e, tp if sequence else 1)
    return {
        "tp": tp, "sequence_parallel": sequence_parallel, "preset": preset, "micro_batch": micro, "block_size": block,
        "dtype": dtype, "layer_bytes": layer, "layer_bytes_per_rank": [got[r][0] for r in range(tp)],
        "peak_bytes": max(peak for _, peak in got.values()), "planned_peak_bytes": planned_peak,
        "per_token": layer / tokens, "planned_per_token": layer_activation_bytes(config, e, tp, sequence),
        "gathered_per_token": layer_activation_bytes(config, e, tp, sequence, gathered=True),
        "korthikanti_per_token": korthikanti_bytes(config, e, tp, sequence),
        "selective_per_token": selective_layer_bytes(config, e, tp, sequence),
    }  # fmt: skip
