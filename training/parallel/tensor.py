"""Tensor parallelism with torch's DTensor APIs, from the model's own plan, under FSDP2.

The model's config carries transformers' `base_model_tp_plan` (each decoder layer's q, k, v, gate and up
projections split by output rows, "colwise"; o and down by input columns, "rowwise"), as Llama's does. Here it is
applied with torch's `parallelize_module` on the `tp` dimension of a `DeviceMesh` built from the launch's mesh
(training/parallel/mesh.py), then each decoder layer and the root are sharded with FSDP2's `fully_shard` on its
data-parallel dimensions: torchtitan's order (tensor parallelism, then activation checkpointing and compilation,
which the model already carries, then `fully_shard`). The embedding, the norms and the head stay whole on every
tensor-parallel rank and are sharded by FSDP2 alone; the rowwise projections' all-reduce gives every tensor-parallel
rank the whole residual stream, so each computes the same norms, loss and gradients of those whole parameters.

Why not accelerate's own path: accelerate 1.15's `Accelerator._prepare_tp` skips a model without DTensor
parameters, and for FSDP2 imports `ReplicateParallel` from transformers, which transformers 5 removed
(accelerate/accelerator.py:1618), ending every rank inside `prepare`. So the YAML's `parallelism_config` block is
read here (its degrees are the launch's mesh), accelerate is built without it (training/parallel/accelerator.py),
and `accelerator.prepare` receives the model already sharded, which its FSDP2 preparation takes as it is
(`fsdp2_prepare_model` returns an `FSDPModule` unchanged) and binds the optimizer to.
"""

from __future__ import annotations

import torch
from torch import nn

STYLES = ("colwise", "rowwise")  # the plan's styles this module applies (the decoder's); the head stays whole


def torch_plan(config) -> dict:
    """The model's `base_model_tp_plan` as torch's parallel styles, keyed by module path from the causal-LM model
    (whose decoder is `model`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = sorted({s for s in config.base_model_tp_plan.values() if s not in styles})
    if unknown:
        raise ValueError(f"the model's base_model_tp_plan uses {unknown}: only {STYLES} are applied here")
    return {f"model.{pattern}": styles[style]() for pattern, style in config.base_model_tp_plan.items()}


def sequence_parallel_plan(config, embedding: bool = True, head: bool = True) -> dict:
    """`torch_plan` with Megatron's sequence parallelism (Korthikanti et al. 2022) between the tensor-parallel regions,
    as torchtitan lays it out: the residual stream and the decoder layers' norms on sequence shards of the tp ranks
    (the norms' weights replicated DTensors), each attention and MLP gathering its input over the sequence (an
    all-gather) and its row-split projection scattering its output back (a reduce-scatter, in place of the all-reduce).
    The first layer takes its shard of the embedding's whole output (a slice, no communication); the final norm, the
    head and the chunked loss take the whole sequence again (an all-gather): they stay whole, as without it. Under a
    pipeline (`split_stage`) a stage without the `embedding` takes the shard its neighbour sent, and one without the
    `head` sends its shard on."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = torch_plan(config)
    for key, style in list(plan.items()):
        if isinstance(style, RowwiseParallel):  # o_proj, down_proj: reduce-scatter onto the sequence shards
            plan[key] = RowwiseParallel(output_layouts=Shard(1))
    sequence, whole = (Shard(1),), (Replicate(),)
    if embedding:
        plan["model.layers.0"] = PrepareModuleInput(
            input_layouts=whole, desired_input_layouts=sequence, use_local_output=True
        )
    plan["model.layers.*.input_layernorm"] = SequenceParallel()
    plan["model.layers.*.post_attention_layernorm"] = SequenceParallel()
    # The attention's positional inputs: hidden states, rotary cos and sin, mask, cache; only the first is sharded.
    # Their input stays a DTensor, so that q, k and v (gate and up) add their input gradients before one
    # reduce-scatter, where a local input would make each all-reduce its own.
    plan["model.layers.*.self_attn"] = PrepareModuleInput(
        input_layouts=(*sequence, None, None, None), desired_input_layouts=(*whole, None, None, None)
    )
    plan["model.layers.*.mlp"] = PrepareModuleInput(input_layouts=sequence, desired_input_layouts=whole)
    if head:
        plan["model.norm"] = PrepareModuleInput(
            input_layouts=sequence, desired_input_layouts=whole, use_local_output=True
        )
    return plan


def check_tensor_parallel(config, tp: int, flag: str = "parallelism_config_tp_size") -> None:
    """Refuse a tensor-parallel degree that does not split every layer evenly: each rank holds heads / tp query
    heads, kv heads / tp key-value heads and intermediate / tp MLP columns. Before any process group."""
    if tp == 1:
        return
    for what, size in (("num_attention_heads", config.num_attention_heads),
                       ("num_key_value_heads", config.num_key_value_heads),
                       ("intermediate_size", config.intermediate_size)):  # fmt: skip
        if size % tp:
            fits = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ValueError(
                f"{flag} = {tp} does not divide the model's {what} ({size}): each tensor-parallel rank holds an equal "
                f"share of it; set {flag} to one of {fits}"
            )


def data_parallel_dims(mesh) -> tuple[str, ...]:
    """The device mesh's dimensions FSDP2 shards over: dp_shard, with dp_replicate first under hybrid sharding."""
    return ("dp_replicate", "dp_shard") if mesh.dp_replicate > 1 else ("dp_shard",)


def device_mesh(mesh, device_type: str):
    """torch's `DeviceMesh` of the launch's pipeline (when there is one), data-parallel and tensor-parallel axes,
    named and ordered as in the launch's mesh (pp outermost, tp innermost: consecutive ranks split each layer).
    Collective: every rank creates every group."""
    from torch.distributed.device_mesh import init_device_mesh

    names = (*(("pp",) if mesh.pp > 1 else ()), *data_parallel_dims(mesh), "tp")
    return init_device_mesh(device_type, tuple(getattr(mesh, n) for n in names), mesh_dim_names=names)


def split_stage(stage: nn.Module, tp_mesh) -> None:
    """A pipeline stage's decoder layers (its `layers`, as the model's) split by the model's plan over `tp_mesh`,
    with Megatron's sequence parallelism between the regions (`sequence_parallel_plan`): the stages send each other
    their tensor-parallel rank's sequence shard, a tp-th of the activations (Narayanan et al. 2021, section 4.1's
    scatter/gather, which sequence parallelism gives for free). Collective over the tensor-parallel ranks."""
    from torch.distributed.tensor.parallel import parallelize_module

    first, last = stage.embed_tokens is not None, stage.norm is not None
    plan = sequence_parallel_plan(stage.config, embedding=first, head=last)
    parallelize_module(stage, tp_mesh, {key.removeprefix("model."): style for key, style in plan.items()})
    stage.sequence_shards = tp_mesh.size()


def shard_tensor_parallel(net: nn.Module, strategy, device: torch.device, mp_policy=None) -> nn.Module:
    """`net`, whole on every rank, split by its plan over the mesh's tp ranks, then FSDP2-sharded over its
    data-parallel ranks. `mp_policy`: FSDP2's mixed precision (none: fp32). Collective: the device mesh, and the
    plan's weights distributed."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = strategy.mesh
    if mesh.pp > 1 or mesh.cp > 1 or mesh.sp > 1:  # a pipeline splits its stages itself (`split_stage`)
        raise ValueError(
            f"tensor parallelism of the whole model with pipeline, ring-context or Ulysses ranks ({mesh.shape})"
        )
    devices = device_mesh(mesh, device.type)  # collective
    net = net.to(device)
    # collective: each rank keeps its slices; the residual stream between them on sequence shards
    parallelize_module(net, devices["tp"], sequence_parallel_plan(net.config))
    dp = devices[data_parallel_dims(mesh)]
    kwargs = dict(mesh=dp, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  reshard_after_forward=strategy.fsdp_sharding == "FULL_SHARD")  # fmt: skip
    # FSDP2's units as accelerate's preparation lays them out (accelerate/utils/fsdp_utils.py, `fsdp2_prepare_model`),
    # so that the layout trains and casts as the project's FSDP2 does: each decoder layer; the embedding alone unless
    # tied; the final norm and head (with a tied embedding) as one unit kept gathered from the forward to the backward;
    # then the root, under torch's own resharding default.
    for layer in net.model.layers:
        fully_shard(layer, **kwargs)
    embed, head = net.get_input_embeddings(), net.get_output_embeddings()
    tied = embed.weight is head.weight
    if not tied:
        fully_shard(embed, **kwargs)
    fully_shard(
        [net.model.norm, embed, head] if tied else [net.model.norm, head], **kwargs | {"reshard_after_forward": False}
    )
    fully_shard(net, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    return net


def split_modules(model: nn.Module, tp: int) -> dict[str, int]:
    """The modules whose weight is split over `tp` ranks, counted by the plan's style (colwise: by output rows,
    rowwise: by input columns), read off the weights' placements on their device meshes."""
    from torch.distributed.tensor import DTensor

    counts: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(weight, DTensor):
            continue
        names = weight.device_mesh.mesh_dim_names or ()
        if "tp" not in names or weight.device_mesh.size(names.index("tp")) != tp:
            continue
        placement = weight.placements[names.index("tp")]
        if placement.is_shard():
            style = "colwise" if placement.dim == 0 else "rowwise"
            counts[style] = counts.get(style, 0) + 1
    return counts
