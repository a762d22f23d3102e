"""Tensor parallelism with torch's DTensor APIs, from the model's own plan, under FSDP2.

The model's config carries transformers' `base_model_tp_plan` (each decoder layer's q, k, v, gate and up
projections split by output rows, "colwise"; o and down by input columns, "rowwise"), as Llama's does. Here it is
applied with torch's `parallelize_module` on the `tp` dimension of a `DeviceMesh` built from the launch's mesh
(training/mesh.py), then each decoder layer and the root are sharded with FSDP2's `fully_shard` on its
data-parallel dimensions: torchtitan's order (tensor parallelism, then activation checkpointing and compilation,
which the model already carries, then `fully_shard`). Between the regions the residual stream and the norms live on
sequence shards (Megatron's sequence parallelism, `sequence_parallel_plan`), and the column-split projections keep their
input's sequence shard for the backward, which gathers it again (Megatron's layout, `save_sequence_shards`); the norms'
weights stay whole on every tensor-parallel rank. The embedding and the head are split by vocabulary rows (transformers'
`embedding_rowwise` and `colwise_gather_output` for Llama's plan), and the chunked loss runs over those rows
(`VocabParallelHead`, Megatron-LM's vocab-parallel cross-entropy, a chunk of tokens at a time): each rank holds a tp-th
of the head's weight, of its FLOPs and of the chunk's logits.

Why not accelerate's own path: accelerate 1.15's `Accelerator._prepare_tp` skips a model without DTensor
parameters, and for FSDP2 imports `ReplicateParallel` from transformers, which transformers 5 removed
(accelerate/accelerator.py:1618), ending every rank inside `prepare`. So the YAML's `parallelism_config` block is
read here (its degrees are the launch's mesh), accelerate is built without it (training/core/accelerator.py),
and `accelerator.prepare` receives the model already sharded, which its FSDP2 preparation takes as it is
(`fsdp2_prepare_model` returns an `FSDPModule` unchanged) and binds the optimizer to.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from training.axes.tensor.vocab import VocabParallelHead

STYLES = ("colwise", "rowwise")  # the decoder plan's styles; the embedding and head: `sequence_parallel_plan`


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
    The embedding, split by vocabulary rows, reduce-scatters its partial lookups onto the sequence shards; the final
    norm's output is gathered over the sequence (an all-gather) for the head, split by the same rows, whose chunked
    loss runs over them (`VocabParallelHead`). Under a pipeline (`split_stage`) a stage without the `embedding` takes
    the shard its neighbour sent, and one without the `head` sends its shard on."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = torch_plan(config)
    for key, style in list(plan.items()):
        if isinstance(style, RowwiseParallel):  # o_proj, down_proj: reduce-scatter onto the sequence shards
            plan[key] = RowwiseParallel(output_layouts=Shard(1))
    sequence, whole = (Shard(1),), (Replicate(),)
    if embedding:
        # The embedding split by vocabulary rows: each rank looks up the tokens in its rows, and the partial sums
        # are reduce-scattered onto the sequence shards. Its output stays a DTensor, so that the model reads the
        # whole sequence's length off it (positions, mask); the first layer takes the local shard.
        plan["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
        plan["model.layers.0"] = PrepareModuleInput(
            input_layouts=sequence, desired_input_layouts=sequence, use_local_output=True
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
        plan["lm_head"] = VocabParallelHead()
    return plan


def arrive_before_compiled(layer: nn.Module) -> None:
    """Where the first decoder layer's forward is compiled (`--torch_compile`) and the plan hands it the embedding's
    reduce-scattered output (`sequence_parallel_plan`), hand it that output arrived: a local tensor whose collective
    torch has not waited for yet (an `AsyncCollectiveTensor`) entered the compiled graph as a tensor subclass, and its
    gradient reached the reduce-scatter's backward as a plain tensor, ending the backward (torch 2.13). The wait goes
    through a copy autograd records (a non-view op waits; `wait()` itself would cut the graph)."""
    from training.compat import is_compiled_function, is_in_flight

    def arrived(module, args):
        if args and is_in_flight(args[0]):
            return (args[0].clone(), *args[1:])
        return None

    if is_compiled_function(layer.__dict__.get("forward")):
        layer.register_forward_pre_hook(arrived)  # after the plan's: its output


def save_sequence_shards(layers) -> None:
    """Megatron's layout of sequence parallelism's saved activations (Korthikanti et al. 2022, section 4.2.2), on each
    decoder layer of `layers` once the plan split them: the column-split projections of each region (q, k, v; gate,
    up) keep this rank's sequence shard of their input for the backward, not the input the region's all-gather made
    whole, and the backward gathers the shard again (one all-gather a region, shared by its projections), so that
    every tensor a layer saves is split over the tensor-parallel ranks. torch's styles save the gathered input, 2 e h
    bytes a token more a layer on every rank (measured: docs/memory.md). Not where the layer is recomputed
    (activation checkpointing saves only its input; the recomputation gathers anyway) nor inside torch.compile's
    graph (a compiled layer keeps torch's layout: AOTAutograd traces the DTensor graph whole)."""
    from training.compat import is_compiled_function

    for layer in layers:
        if is_compiled_function(layer.__dict__.get("forward")):  # `--torch_compile` (training/core/build.py)
            continue
        for region, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            state = _RegionShard(layer)
            region.register_forward_pre_hook(state.take, prepend=True)  # before the plan's gather: the shard
            region.register_forward_hook(state.drop, always_call=True)
            for name in names:
                projection = getattr(region, name)
                projection.region_shard = state
                projection.forward = types.MethodType(_column_from_shard_forward, projection)


class _RegionShard:
    """A region's hooks around its forward: each training forward's sequence shard (its input before the plan's
    all-gather), shared by the region's column-split projections as one `_SavedShard`; none where the layer is
    recomputed, traced by torch.compile or run without gradients."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.current: _SavedShard | None = None

    def take(self, module, args) -> None:
        from torch.distributed.tensor import DTensor

        recomputed = self.layer.training and getattr(self.layer, "gradient_checkpointing", False)
        usable = isinstance(args[0], DTensor) and torch.is_grad_enabled() and not recomputed
        self.current = None
        if usable and not torch.compiler.is_compiling():
            with torch.no_grad():
                self.current = _SavedShard(args[0].to_local().detach())

    def drop(self, module, args, output) -> None:
        if self.current is not None:
            self.current.shard = None  # the projections saved it: what the backward reads, through autograd's hooks
        self.current = None


class _SavedShard:
    """One forward of a region: its sequence shard, gathered again in the backward by the first projection that
    needs it (a micro batch's own: a pipeline runs several forwards before their backwards), dropped once the last
    has used it."""

    def __init__(self, shard):
        self.shard = shard  # this rank's sequence shard, a local tensor, until the region's forward ends
        self.whole, self.users = None, 0  # the backward's gathered copy, and the projections yet to use it

    def gathered(self, shard: torch.Tensor, mesh) -> torch.Tensor:
        """The region's whole input again (collective over the tensor-parallel ranks: the all-gather over the
        sequence, once per backward of the region)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.whole is None:
            with torch.no_grad():
                sharded = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False)
                self.whole = sharded.redistribute(placements=[Replicate()]).to_local()
        whole = self.whole
        self.users -= 1
        if self.users == 0:
            self.whole = None
        return whole


def _column_from_shard_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A column-split projection's forward under `save_sequence_shards` (bound to the projection): its input `x` is
    the region's gathered input (a DTensor replicated over the tensor-parallel mesh), its weight a DTensor of its
    output rows; it returns its output rows (a DTensor split on the last dimension), as `ColwiseParallel` expects."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Shard

    state = self.region_shard.current
    if state is None or self.bias is not None:  # evaluation, recomputation, compilation: torch's own path
        return F.linear(x, self.weight, self.bias)
    mesh = self.weight.device_mesh
    # the input's gradient is partial over the ranks (each holds some output rows): the projections' add up, and the
    # plan's gather reduce-scatters their sum once
    whole = x.to_local(grad_placements=[Partial()])
    out = _ColumnFromShard.apply(whole, state.shard, self.weight.to_local(), state, mesh)
    return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)


class _ColumnFromShard(torch.autograd.Function):
    """y = x W^T, saving the sequence shard of x (and W) instead of x; the backward gathers x again (shared by the
    region's projections, `_SavedShard.gathered`). Under autocast the backward's matmuls run as the forward's did."""

    @staticmethod
    def forward(ctx, whole, shard, weight, state, mesh):
        import torch.nn.functional as F

        device = whole.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.state, ctx.mesh = state, mesh
        ctx.save_for_backward(shard, weight)
        state.users += 1
        return F.linear(whole, weight)

    @staticmethod
    def backward(ctx, grad_out):
        shard, weight = ctx.saved_tensors
        whole = ctx.state.gathered(shard, ctx.mesh)  # collective: the region's all-gather, again
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            grad_whole = grad_out @ weight
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).T @ whole.reshape(-1, whole.shape[-1])
        return grad_whole, None, grad_weight, None, None


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
    save_sequence_shards(stage.layers)
    if first:
        arrive_before_compiled(stage.layers[0])
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
    save_sequence_shards(net.model.layers)
    arrive_before_compiled(net.model.layers[0])
    tie_split_embedding(net)
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
    rowwise: by input columns; the embedding by vocabulary rows, embedding_rowwise, and the head by them too,
    colwise_gather_output, transformers' names), read off the weights' placements on their device meshes."""
    from torch.distributed.tensor import DTensor

    counts: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear | nn.Embedding) or not isinstance(weight, DTensor):
            continue
        names = weight.device_mesh.mesh_dim_names or ()
        if "tp" not in names or weight.device_mesh.size(names.index("tp")) != tp:
            continue
        placement = weight.placements[names.index("tp")]
        if placement.is_shard():
            style = "colwise" if placement.dim == 0 else "rowwise"
            if isinstance(module, nn.Embedding) or getattr(module, "vocab_parallel", False):
                style = "embedding_rowwise" if isinstance(module, nn.Embedding) else "colwise_gather_output"
            counts[style] = counts.get(style, 0) + 1
    return counts


def tie_split_embedding(net: nn.Module) -> None:
    """Where the causal-LM model `net`'s head shares the embedding, the one tensor again after both were split by
    vocabulary rows (each style distributes its own copy of the weight; both hold the same rows on a rank)."""
    embed, head = net.model.embed_tokens, net.lm_head  # None where a pipeline rank dropped them
    if embed is not None and head is not None and net.config.tie_word_embeddings:
        head.weight = embed.weight
