"""Pipeline parallelism: the decoder's layers split into stages over ranks, run by torch.distributed.pipelining.

The launch is a (pp, dp) mesh, pp outermost as in torchtitan: the ranks r, r + dp, r + 2 dp, ... form one pipeline
and train on the same data-parallel share of the global batch, one micro batch after another; the ranks of one
stage form a data-parallel group (DDP, or FSDP2 sharding each stage). The micro batches of a step are the loader's
--gradient_accumulation_steps, as in DeepSpeed's pipeline engine.

Stage s of S = pp x stages-per-rank holds layers [s L / S, (s + 1) L / S); the first also the embedding, the last the
final norm and the head, which computes the loss (the summed cross-entropy of its micro batch, through the model's
chunked loss). Every rank first builds the whole model from the seed, as one process would (so the weights are one
process's), then keeps its stages (`keep_stages`): the parameters keep their HF names, so optimizer groups, the
export and the checkpoints read them as they read the whole model's.

Tied embeddings (every preset but llama-7b): the first stage keeps `model.embed_tokens.weight`, the last stage
`lm_head.weight`, one tensor in two places. After each backward the two gradients are summed over the two ranks
(collective), so both copies take the same AdamW step and stay equal, as the one tied tensor of one process would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from training import compat
from training.axes.pipeline.busy_clock import BusyClock
from training.axes.pipeline.groups import new_groups
from training.axes.pipeline.schedules import ZERO_BUBBLE, check_schedule_on_gloo, stage_ranks
from training.axes.pipeline.stage import Stage, keep_stages
from training.axes.tensor.plan import data_parallel_dims, device_mesh, split_modules, split_stage, tie_split_embedding
from training.core.build import local
from training.core.gradnorm import clip_, grad_norm
from training.core.inspection import check_world
from training.strategy import Strategy


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stages and the schedule that runs them, the groups it talks over, and
    what a step (training/loop/step.py's `pipelined_step`) and the evaluation run on them."""

    model: nn.Module  # this rank's stages' modules, under the whole model's names
    stages: list[Stage]
    schedule: object
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    tie_group: dist.ProcessGroup | None  # the first and last stage's ranks, for the tied embedding's gradient
    sharded: bool  # FSDP2: each stage's parameters are shards over the data-parallel ranks
    pp_rank: int
    pp_size: int
    data_parallel_size: int
    owners: list[int] = field(default_factory=list)  # the pipeline rank of each stage
    parameters: int = 0  # the whole model's, counted before the stages were kept
    clock: BusyClock | None = None  # this rank's stages' compute time
    loss_scale: float = 1.0
    tensor_parallel_size: int = 1  # ranks each of this rank's stages' layers is split over

    # ---------------------------------------------------------------- one optimizer step

    def forward_backward(self, micro_batches: list[dict], autocast) -> tuple[float, list[float] | None]:
        """Every micro batch through the schedule (forward and backward, interleaved as it says), then the gradients
        made what one process's would be: averaged over the data-parallel ranks (FSDP2 reduces its own) and the
        tied embedding's two summed. Each micro batch's loss is its summed cross-entropy over the targets of the
        whole global batch (all ranks and micro batches), times the data-parallel size that DDP's and FSDP2's
        averaging divides by: the update (training/loop/step.py's `pipelined_step`) is one process's on the same global
        batch. Returns the global batch's loss, on every rank, and each pipeline rank's busy share of the schedule
        (None under the zero-bubble schedules)."""
        device = self.device
        inputs = torch.cat([m["input_ids"] for m in micro_batches]).to(device)  # (M * micro, T)
        labels = torch.cat([m["shift_labels"] for m in micro_batches]).to(device)
        targets = micro_batches[0]["num_items_in_batch"]  # the global batch's counted targets, on every rank
        self.loss_scale = self.data_parallel_size / float(targets)
        losses: list[torch.Tensor] = []
        first = self.pp_rank == self.owners[0]
        start = self.clock.mark() if self.clock else None
        with autocast():
            # collective: point-to-point sends of activations and their gradients between neighbouring stages;
            # under FSDP2 the gradient reduce-scatter over the data-parallel ranks in the last backward
            self.schedule.step(*((inputs,) if first else ()), target=labels, losses=losses, shift_labels=labels)
        end = self.clock.mark() if self.clock else None
        loss = sum(loss.detach().float() for loss in losses) / self.data_parallel_size if losses else None
        global_loss = self.broadcast_loss(loss)  # collective: the last stage's loss to every rank (a device sync)
        busy = self.busy_fractions(start, end) if self.clock else None  # collective: the stages' compute shares
        self.settle_split_gradients()  # collective: over the tensor-parallel ranks, without FSDP2
        self.average_replicated_gradients()  # collective: over the data-parallel ranks, without FSDP2
        self.sum_tied_gradients()  # collective: first and last stage
        return global_loss, busy

    def busy_fractions(self, start, end) -> list[float]:
        """Each pipeline rank's share of the schedule's time spent in its stages' forward and backward (the mean of
        its data-parallel copies); the rest is the bubble and the waits on its neighbours."""
        mine = torch.tensor([self.clock.busy_fraction(start, end)], device=self.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)  # collective: every rank
        n = len(every) // self.pp_size  # global rank r is pipeline rank r // n (n: data x tensor-parallel ranks)
        return [round(sum(t.item() for t in every[p * n : (p + 1) * n]) / n, 4) for p in range(self.pp_size)]

    def settle_split_gradients(self) -> None:
        """Each split parameter's gradient laid out as the parameter is (FSDP2 does it for its own). Under sequence
        parallelism the decoder norms' weights are replicated over the tensor-parallel ranks and each rank's gradient
        covers its shard of the sequence (a partial DTensor): they are summed once a step, after the schedule, into
        what one process's whole sequence gives. The embedding's rows come back whole from torch's embedding
        backward (a replicated DTensor): each rank keeps its rows."""
        for param in self.model.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                # collective where partial: an all-reduce over the tensor-parallel ranks; a slice where replicated
                param.grad = grad.redistribute(param.device_mesh, param.placements)

    def average_replicated_gradients(self) -> None:
        """Without FSDP2, the data-parallel ranks of a stage hold whole copies of it: their gradients are averaged
        in one all-reduce of all of them, once the schedule's last backward is done (what DDP does, without its
        overlap with the backward: torch 2.13's DDP reducer fails, or with static_graph averages wrongly, when a
        schedule runs several micro batches' backwards under it)."""
        if self.sharded or self.dp_group is None:
            return
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]  # a slice's: this rank's
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)  # collective: the stage's data-parallel ranks
        flat /= self.data_parallel_size
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(averaged.view_as(grad))

    def loss_fn(self, output: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro batch: its summed cross-entropy (the last stage's output) scaled as
        `step` says. The schedule does not scale the gradients itself (scale_grads=False)."""
        return output.sum() * self.loss_scale

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def broadcast_loss(self, loss: torch.Tensor | None) -> float:
        """The step's loss, which only the last stage's ranks computed: summed over the data-parallel ranks of the
        last stage, then sent to every rank of the pipeline."""
        value = loss if loss is not None else torch.zeros((), device=self.device)
        value = value.reshape(()).clone()
        if self.dp_group is not None and loss is not None:
            dist.all_reduce(value, group=self.dp_group)  # collective: the last stage's data-parallel ranks
        last = dist.get_global_rank(self.pp_group, self.owners[-1])
        dist.broadcast(value, src=last, group=self.pp_group)  # collective: the pipeline's ranks
        return value.item()

    def tied_parameter(self) -> nn.Parameter | None:
        """This rank's copy of the tied embedding, where the first and last stage live on different ranks."""
        if self.tie_group is None:
            return None
        head = self.model.lm_head
        return head.weight if head is not None else self.model.model.embed_tokens.weight

    def sum_tied_gradients(self) -> None:
        """The tied embedding's two gradients (embedding on the first stage, head on the last) summed on both."""
        tied = self.tied_parameter()
        if tied is None:
            return
        grad = tied.grad
        if grad is None:
            grad = tied.grad = torch.zeros_like(tied)
        dist.all_reduce(local(grad), group=self.tie_group)  # collective: first and last stage; FSDP2: the same rows

    def clip_gradients(self, max_norm: float) -> float:
        """The global gradient norm before clipping, as one process would compute it (the tied embedding counted
        once, by the first stage), summed in float64 (training/core/gradnorm.py), and the gradients clipped to
        `max_norm` (0: measured, not clipped)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        copy = self.model.lm_head.weight if self.tie_group is not None and self.model.lm_head is not None else None
        counted = [p for p in params if p is not copy]
        # collective: over FSDP2's shards (their DTensor mesh), then over the pipeline's stages
        total = grad_norm(counted, self.device, across=self.pp_group)
        clip_(params, max_norm, total)
        return total.item()

    def in_force(self) -> dict:
        """The layout as built, for strategy.json: stages, their layers and ranks, the schedule."""
        num_stages = len(self.owners)
        layers = self.model.config.num_hidden_layers
        held = sum(local(p).numel() for p in self.model.parameters())
        return {
            "parameters": self.parameters,
            "local_parameters": held,  # this rank's elements: its stages' slices and shards
            "local_parameter_fraction": round(held / self.parameters, 4),
            "pipeline": {
                "degree": self.pp_size,
                "schedule": type(self.schedule).__name__.removeprefix("Schedule"),
                "stages": num_stages,
                "stages_per_rank": num_stages // self.pp_size,
                "layers_per_stage": layers // num_stages,
                "stage_ranks": self.owners,
                "this_rank": self.pp_rank,
                "this_rank_stages": self.local_stages,
                "this_rank_layers": [i for stage in self.stages for i in self.layer_indices(stage)],
                "data_parallel_size": self.data_parallel_size,
                "data_parallel": "fsdp2" if self.sharded else "all-reduce" if self.dp_group is not None else "none",
                "tied_embedding_synced": self.tie_group is not None,
                "tensor_parallel_size": self.tensor_parallel_size,
                "sequence_parallel": self.tensor_parallel_size > 1,  # Megatron's, between the regions (`split_stage`)
                # this rank's split matrices by the plan's style, read off their placements
                "split_modules": split_modules(self.model, self.tensor_parallel_size)
                if self.tensor_parallel_size > 1
                else {},
            },
        }

    def layer_indices(self, stage: Stage) -> list[int]:
        ids = {id(layer): i for i, layer in enumerate(self.model.model.layers)}
        return [ids[id(layer)] for layer in stage.layers]

    # ---------------------------------------------------------------- evaluation

    @torch.no_grad()
    def eval_sums(self, micro: dict, autocast) -> torch.Tensor:
        """One evaluation micro batch forward only, stage by stage: each rank runs its stages on what the stage
        before sent (collective: point-to-point over the pipeline). The last stage's ranks return (summed
        cross-entropy, counted targets) of their data-parallel share; the others zeros (training/loop/evaluate.py adds
        the sums over every rank)."""
        device = self.device
        ids, labels = micro["input_ids"].to(device), micro["shift_labels"].to(device)
        num_stages = len(self.owners)
        h = ids
        with autocast():
            for s in range(num_stages):
                owner = self.owners[s]
                if owner != self.pp_rank:
                    h = None
                    continue
                if s > 0 and self.owners[s - 1] != self.pp_rank:
                    # fp32 on the wire whatever the stages compute in: the receiver needs no dtype to size its buffer;
                    # under tensor parallelism its rank's shard of the sequence
                    shard = ids.shape[1] // self.stage(s).sequence_shards
                    h = torch.empty(ids.shape[0], shard, self.model.config.hidden_size, device=device)
                    dist.recv(h, src=dist.get_global_rank(self.pp_group, self.owners[s - 1]), group=self.pp_group)
                h = self.stage(s)(h, labels)
                if s < num_stages - 1 and self.owners[s + 1] != self.pp_rank:
                    dist.send(h.float().contiguous(), dst=dist.get_global_rank(self.pp_group, self.owners[s + 1]),
                              group=self.pp_group)  # fmt: skip
        if self.owners[-1] != self.pp_rank:
            return torch.zeros(2, device=device)
        return torch.stack([h.reshape(()).float(), (labels != -100).sum().float()])

    @property
    def local_stages(self) -> list[int]:
        """The indices of this rank's stages, in order (`stages` holds their modules)."""
        return [s for s, owner in enumerate(self.owners) if owner == self.pp_rank]

    def stage(self, index: int) -> Stage:
        return self.stages[self.local_stages.index(index)]

    # ---------------------------------------------------------------- the whole model's weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on every rank (collective: every pipeline rank's stages are gathered, FSDP2's
        shards first). Tied weights appear once, under the embedding's name."""
        mine = {}
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # collective under FSDP2
            mine[name] = full.detach().cpu()
        if self.tie_group is not None and self.model.lm_head is not None:
            mine.pop("lm_head.weight", None)  # the first stage's rank holds it as model.embed_tokens.weight
        parts: list[dict | None] = [None] * self.pp_size
        dist.all_gather_object(parts, mine, group=self.pp_group)  # collective: the pipeline's ranks
        whole = {}
        for part in parts:
            whole.update(part)
        return whole


def build_pipeline(model: nn.Module, strategy: Strategy, rank: int, micro_batches: int, device: torch.device,
                   shard) -> Pipeline:  # fmt: skip
    """`rank`'s stages of `model` (trimmed in place) for the launch's `strategy`: its mesh (pp x data parallel), its
    schedule and stages per rank; wrapped for data parallelism (`shard`: FSDP2's `fully_shard` over the
    data-parallel ranks, or None: DDP's all-reduce where there are several), and the schedule over them, which runs
    `micro_batches` a step. Collective: creates the pipeline, data-parallel and tied-embedding process groups (every
    rank creates every group)."""
    mesh, schedule_name, per_rank = strategy.mesh, strategy.pp_schedule, strategy.pp_stages_per_rank
    check_schedule_on_gloo(schedule_name, dist.get_backend() == "gloo", compat.pipeline_sends_to_own_rank())
    if mesh.world != mesh.pp * mesh.dp * mesh.tp:
        raise ValueError(f"a pipeline runs on pp x data-parallel x tensor-parallel ranks; the mesh is {mesh.shape}")
    pp, dp, pp_rank = mesh.pp, mesh.dp, mesh.coordinates(rank)["pp"]
    owners = stage_ranks(schedule_name, pp, per_rank)
    num_stages = len(owners)
    mine = [s for s, owner in enumerate(owners) if owner == pp_rank]
    # collective: every rank creates every group, in the same order
    pp_group = new_groups(rank, mesh.groups("pp"))
    dp_group = new_groups(rank, mesh.groups("dp_replicate", "dp_shard"))
    tied = model.config.tie_word_embeddings and owners[0] != owners[-1]
    # the first and last stage's ranks of each pipeline, for the tied embedding's gradient
    tie_group = (
        new_groups(rank, [[ranks[owners[0]], ranks[owners[-1]]] for ranks in mesh.groups("pp")]) if tied else None
    )
    parameters = sum(p.numel() for p in model.parameters())  # the whole model's, tied weights once
    # The busy clock's marks in the autograd graph break the zero-bubble schedules' split backward: not timed there.
    clock = None if schedule_name in ZERO_BUBBLE else BusyClock(device)
    stages = keep_stages(model, mine, num_stages, clock)
    dp_mesh = dp_group
    if mesh.tp > 1:  # each stage's layers split over its tensor-parallel ranks, then sharded around the slices
        devices = device_mesh(mesh, device.type)  # collective: one DeviceMesh, so that FSDP2 composes with the slices
        dp_mesh = devices[data_parallel_dims(mesh)]
        for stage in stages:
            split_stage(stage.to(device), devices["tp"])  # collective: the tensor-parallel ranks
        tie_split_embedding(model)  # a rank holding the first and the last stage: one tensor again
    if shard is not None:
        for stage in stages:
            shard(stage, dp_mesh)
    pipeline = Pipeline(
        model=model, stages=stages, schedule=None, pp_group=pp_group, dp_group=dp_group if dp > 1 else None,
        tie_group=tie_group, sharded=shard is not None, pp_rank=pp_rank, pp_size=pp, data_parallel_size=dp,
        owners=owners, parameters=parameters, clock=clock, tensor_parallel_size=mesh.tp,
    )  # fmt: skip
    pipeline_stages = [
        PipelineStage(module, index, num_stages, device, group=pipeline.pp_group)
        for module, index in zip(stages, mine, strict=True)
    ]
    cls = get_schedule_class(schedule_name)
    single = issubclass(cls, PipelineScheduleSingle)
    pipeline.schedule = cls(
        pipeline_stages[0] if single else pipeline_stages, n_microbatches=micro_batches, loss_fn=pipeline.loss_fn,
        scale_grads=False,
    )  # fmt: skip
    return pipeline


def fsdp2_stages(policy, reshard: bool, device_type: str):
    """A `shard` for `build_pipeline`: FSDP2's `fully_shard` of each decoder layer, then of the stage (its embedding,
    norm and head), over the stage's data-parallel ranks, with the mixed precision `policy`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def shard(stage: Stage, group: dist.ProcessGroup | DeviceMesh) -> None:
        mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(stage, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)

    return shard


def verify_pipeline(accelerator: Accelerator, layout: dict, strategy: Strategy) -> dict:
    """Refuse to train unless the pipeline as built (`Pipeline.in_force`) is the strategy's: its degree, schedule and
    stages per rank, and the data parallelism across the pipelines (FSDP2 under an FSDP config, else an all-reduce
    of whole copies where there are several). Returns what was seen, as `verify_strategy` does."""
    world = check_world(accelerator, strategy)
    pipe = layout["pipeline"]
    dp = strategy.data_parallel_size
    expected = {
        "degree": strategy.pp_size,
        "schedule": strategy.pp_schedule,
        "stages_per_rank": strategy.pp_stages_per_rank,
        "data_parallel_size": dp,
        "data_parallel": "fsdp2" if strategy.family == "fsdp" else "all-reduce" if dp > 1 else "none",
        "tensor_parallel_size": strategy.tp_size,
    }
    built = {key: pipe[key] for key in expected}
    if built != expected:
        wrong = ", ".join(f"{k} {built[k]} (asked: {v})" for k, v in expected.items() if built[k] != v)
        raise RuntimeError(f"asked for {strategy.name} on {world} ranks, but the pipeline runs {wrong}; seen: {layout}")
    if strategy.tp_size > 1 and not pipe["split_modules"]:
        raise RuntimeError(f"asked for {strategy.name}, but no matrix of this rank's stages is split; seen: {layout}")
    return {
        "strategy": strategy.name,
        "distributed_type": "PIPELINE",
        "world_size": world,
        "mixed_precision": accelerator.mixed_precision,
    } | layout
