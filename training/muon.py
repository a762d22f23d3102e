"""Muon for the decoder's matrices, AdamW for the rest, as one optimizer whatever holds the parameters.

Muon (Jordan et al. 2024; torch.optim.Muon) keeps one momentum buffer per matrix and replaces the update by the
nearest semi-orthogonal matrix, found by a few Newton-Schulz iterations on the whole matrix. The orthogonalization is
not element-wise, so where a strategy holds a matrix in pieces the pieces are gathered first:

- one process, DDP and a pipeline's stages hold whole matrices: torch's Muon step, operation for operation;
- FSDP2 (and FSDP2 pipeline stages) hold DTensor shards: the momentum is kept on the shard (it is element-wise), the
  update gathered whole on every rank (collective: an all-gather per matrix), orthogonalized there, and each rank
  keeps its own rows of it;
- DeepSpeed ZeRO-1/2/3 hand the optimizer one flat fp32 partition per group (the project's optimizer reaches them
  as DeepSpeed's documented client optimizer, `zero_allow_untested_optimizer`): the partitions of the update are
  gathered (collective), each matrix cut out of them by the stage's layout (`ZeroLayout`), orthogonalized whole,
  and this rank's elements written back.

Every path runs torch's own Newton-Schulz iteration (`torch.optim._muon`'s, in bfloat16 as torch runs it; or the
same operations in float32, --muon_ns_dtype) and its learning-rate adjustment; the AdamW half is torch's `adamw`
functional with AdamW's state names, so a checkpoint's AdamW moments read as `torch.optim.AdamW`'s do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from training.compat import muon_adjust_lr as _adjust_lr
from training.compat import muon_newton_schulz as _zeropower_via_newtonschulz

MUON_STATE = ("momentum_buffer",)
"""Muon's state per matrix, in the strategy-neutral checkpoint form (training/checkpoints/portable.py)."""


def is_muon_matrix(name: str, shape) -> bool:
    """A decoder layer's 2-D weight (attention and MLP projections). The embedding and the head stay with AdamW, as
    every Muon recipe keeps them (their rows are tokens, not a linear map to orthogonalize), and so does every 1-D
    parameter (the norms)."""
    return len(shape) == 2 and ".layers." in f".{name}" and "embed_tokens" not in name and "lm_head" not in name


def muon_param_groups(model: torch.nn.Module, cfg) -> list[dict]:
    """Three groups: Muon's matrices, AdamW's decayed matrices (the embedding if --decay_embeddings), AdamW's
    undecayed rest. Each group names itself (`name`) and carries its matrices' whole shapes (`shapes`), which ZeRO's
    flat partitions do not keep."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))  # inside ZeRO-3's zero.Init a parameter is an empty partition
        is_embedding = "embed_tokens" in name or name.startswith("lm_head")
        if is_muon_matrix(name, shape):
            muon.append((name, p, shape))
        elif len(shape) >= 2 and cfg.decay_embeddings and is_embedding:
            decay.append((name, p, shape))
        else:
            no_decay.append((name, p, shape))
    muon_lr = cfg.muon_learning_rate or cfg.learning_rate
    groups = [
        {"name": "muon", "use_muon": True, "lr": muon_lr, "weight_decay": cfg.muon_weight_decay},
        {"name": "adamw_decay", "use_muon": False, "lr": cfg.learning_rate, "weight_decay": cfg.weight_decay},
        {"name": "adamw_no_decay", "use_muon": False, "lr": cfg.learning_rate, "weight_decay": 0.0},
    ]
    for group, members in zip(groups, (muon, decay, no_decay), strict=True):
        group["params"] = [p for _, p, _ in members]
        group["shapes"] = [shape for *_, shape in members]
        group["names"] = [name for name, *_ in members]
    return [g for g in groups if g["params"]]


def applied(optimizer: Muon) -> dict:
    """strategy.json's record, read after the first step: each group (name, optimizer, parameters and their whole
    elements, peak learning rate, weight decay) and the matrices that step orthogonalized whole, which must be every
    Muon matrix this rank holds (a skipped update, Muon silently off, reads 0)."""
    groups = [
        {"name": g["name"], "optimizer": "muon" if g["use_muon"] else "adamw", "parameters": len(g["shapes"]),
         "elements": sum(math.prod(s) for s in g["shapes"]), "lr": g.get("initial_lr", g["lr"]),
         "weight_decay": g["weight_decay"]}
        for g in optimizer.param_groups
    ]  # fmt: skip
    first = optimizer.param_groups[0]
    return {
        "name": "muon",
        "groups": groups,
        "ns_dtype": first["ns_dtype"],
        "ns_steps": first["ns_steps"],
        "adjust_lr": first["adjust_lr_fn"],
        "layout": f"zero{optimizer.zero.stage}" if optimizer.zero else "tensors",
        "muon_matrices": sum(g["parameters"] for g in groups if g["optimizer"] == "muon"),
        "orthogonalized_first_step": optimizer.orthogonalized,  # read right after this process's first step
    }


@dataclass(frozen=True)
class ZeroLayout:
    """Where each of a group's matrices lies in DeepSpeed's flat fp32 partitions of `world` ranks.

    ZeRO-1/2 (`stage` 1 or 2) flatten a group's parameters in order into one buffer padded at its end and give rank
    r the r-th of `world` equal slices; ZeRO-3 partitions each parameter on its own (ceil(numel / world) elements a
    rank, the last padded) and concatenates this rank's partitions in the group's order."""

    stage: int
    world: int

    def segments(self, shapes, local_numel: int, rank: int) -> list[tuple[int, int, int]]:
        """For each matrix: (start in rank's partition, start in the flattened matrix, elements) of rank's part."""
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            if self.stage == 3:
                size = -(-n // self.world)
                begin, end = min(n, rank * size), min(n, (rank + 1) * size)
                out.append((offset, begin, end - begin))
                offset += size
            else:
                begin, end = max(offset, rank * local_numel), min(offset + n, (rank + 1) * local_numel)
                out.append((begin - rank * local_numel, begin - offset, max(0, end - begin)))
                offset += n
        return out

    def unpartition(self, shapes, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each matrix whole, from every rank's flat partition (`parts`, in rank order)."""
        every = [self.segments(shapes, parts[0].numel(), r) for r in range(self.world)]
        return [
            torch.cat([parts[r][start : start + n] for r in range(self.world) for start, _, n in (every[r][j],)]).view(
                shape
            )
            for j, shape in enumerate(shapes)
        ]

    def check(self, shapes, local_numel: int) -> None:
        """Refuse a partition this layout does not describe (another DeepSpeed's, or ZeRO-3 sub-groups)."""
        total = sum(math.prod(s) for s in shapes)
        expected = sum(-(-math.prod(s) // self.world) for s in shapes) if self.stage == 3 else None
        fits = local_numel == expected if expected is not None else local_numel * self.world >= total
        if not fits:
            raise RuntimeError(
                f"Muon under ZeRO-{self.stage}: this rank's partition holds {local_numel} elements where the layout "
                f"of {len(shapes)} matrices ({total} elements) over {self.world} ranks gives "
                f"{expected or f'at least {-(-total // self.world)}'}: keep zero_optimization.sub_group_size above "
                "the model's parameter count (DeepSpeed's default, 1e9, is)"
            )


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `use_muon`, AdamW on the others, on whole tensors, DTensor shards or ZeRO's flat
    partitions (`zero`: their layout, given where DeepSpeed partitions the optimizer)."""

    def __init__(self, groups: list[dict], *, momentum: float, nesterov: bool, ns_steps: int, adjust_lr: str,
                 betas: tuple[float, float], eps: float, ns_dtype: str = "bfloat16",
                 zero: ZeroLayout | None = None):  # fmt: skip
        defaults = {"lr": 1e-3, "weight_decay": 0.0, "momentum": momentum, "nesterov": nesterov,
                    "ns_steps": ns_steps, "ns_dtype": ns_dtype, "adjust_lr_fn": adjust_lr, "betas": betas,
                    "eps": eps}  # fmt: skip
        super().__init__(groups, defaults)
        self.zero = zero
        # whole matrices orthogonalized and applied by the last step that ran Muon (strategy.json); torch's
        # state-dict API's zero-learning-rate step, made to create the states, counts as such a step too
        self.orthogonalized, self._count = 0, 0
        for group in self.param_groups:
            flat = [p for p in group["params"] if p.ndim != 2]
            if group["use_muon"] and flat and zero is None:
                raise ValueError(
                    f"Muon's group {group['name']!r} holds a parameter of shape {tuple(flat[0].shape)}: Muon "
                    "orthogonalizes 2-D matrices only; 1-D parameters belong to AdamW's groups"
                )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._count = 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            (self._muon if group["use_muon"] else self._adamw)(group, params)
        if self._count:  # ZeRO-3 steps its sub-groups one call each: AdamW's calls leave the count alone
            self.orthogonalized = self._count
        return loss

    def _adamw(self, group: dict, params: list) -> None:
        """torch.optim.AdamW's step (its functional form, its state names)."""
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)  # fmt: skip

    def _muon(self, group: dict, params: list) -> None:
        """torch's `_single_tensor_muon`, with the update made whole before its orthogonalization."""
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)  # element-wise: on a shard or partition as on the whole matrix
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            if p.ndim == 1 and self.zero is not None:  # a ZeRO partition of the group's matrices
                self._muon_partition(group, p, update, lr, wd)
                continue
            p.mul_(1 - lr * wd)
            p.add_(self._orthogonalized(update, group), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
            self._count += 1

    @staticmethod
    def _orthogonalized(update: torch.Tensor, group: dict) -> torch.Tensor:
        """Newton-Schulz on the whole matrix; a DTensor gathered first (collective), its own part of the result kept
        (no communication: every rank holds the whole)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        steps, dtype = group["ns_steps"], group["ns_dtype"]
        if not isinstance(update, DTensor):
            return newton_schulz(update, steps, dtype)
        whole = newton_schulz(update.full_tensor(), steps, dtype)  # collective: the shards gathered
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)

    def _muon_partition(self, group: dict, p: torch.Tensor, update: torch.Tensor, lr: float, wd: float) -> None:
        """ZeRO: every rank's partition of the update gathered (collective), each matrix cut out and orthogonalized,
        this rank's elements of it applied."""
        import torch.distributed as dist

        layout, shapes, rank = self.zero, group["shapes"], dist.get_rank()
        layout.check(shapes, p.numel())
        parts = [torch.empty_like(update) for _ in range(layout.world)]
        dist.all_gather(parts, update.contiguous())  # collective: the group's update, every rank's partition
        p.mul_(1 - lr * wd)
        mine = layout.segments(shapes, p.numel(), rank)
        for j, (shape, whole) in enumerate(zip(shapes, layout.unpartition(shapes, parts), strict=True)):
            orthogonal = newton_schulz(whole, group["ns_steps"], group["ns_dtype"])
            self._count += 1
            start, begin, n = mine[j]
            if n:
                p[start : start + n].add_(orthogonal.reshape(-1)[begin : begin + n],
                                          alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))  # fmt: skip


# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients, its epsilon)
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def newton_schulz(update: torch.Tensor, steps: int, dtype: str) -> torch.Tensor:
    """The orthogonalized `update`: torch.optim.Muon's iteration itself in bfloat16 (how torch runs it); in float32
    the same operations in the same order, which leave the update's own rounding alone (what the strategies' parity
    is held to: a bfloat16 rounding turns the last bit of fp32's reduction order into a 1e-4 difference)."""
    if dtype == "bfloat16":
        return _zeropower_via_newtonschulz(update, COEFFICIENTS, steps, EPS)
    a, b, c = COEFFICIENTS
    x = update.float()
    if update.size(0) > update.size(1):
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if update.size(0) > update.size(1) else x


def make_muon(cfg, model: torch.nn.Module, zero: ZeroLayout | None) -> Muon:
    """The run's Muon from its flags (training/config.py's muon_* fields)."""
    return Muon(muon_param_groups(model, cfg), momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps, adjust_lr=cfg.muon_adjust_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_epsilon, ns_dtype=cfg.muon_ns_dtype, zero=zero)  # fmt: skip
