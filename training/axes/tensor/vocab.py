"""The head and its loss under tensor parallelism: the head split by vocabulary rows over the tensor-parallel ranks
(`VocabParallelHead`, applied by the plan in training/axes/tensor/plan.py), and the cross-entropy over those rows
(Megatron-LM's vocab-parallel loss), a chunk of tokens at a time as the model's own chunked loss: each rank holds a
tp-th of the head's weight, of its FLOPs and of the chunk's logits."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


class VocabParallelHead(ParallelStyle):
    """The model's head (`ShardGPTLMHead`) split by vocabulary rows over the tensor-parallel ranks (a tied head holds
    the embedding's rows, `RowwiseParallel` on the embedding, once re-tied: `tie_split_embedding`). Given targets it
    returns the summed cross-entropy computed over the vocabulary shards (`vocab_parallel_cross_entropy`), as
    Megatron-LM's vocab-parallel loss does, a chunk of tokens at a time as the model's own chunked loss: each rank
    holds (chunk, V / tp) logits and runs a tp-th of the head's FLOPs. Without targets (evaluation, generation) it
    returns the whole logits, gathered over the vocabulary (an all-gather), as torch's `ColwiseParallel` would."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh, [Shard(0)]))
        module.register_parameter("weight", weight)
        module.forward = types.MethodType(_vocab_parallel_forward, module)
        module.vocab_parallel = True  # `split_modules` names its style
        return module


def _vocab_parallel_forward(self, hidden_states: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """`VocabParallelHead`'s forward, bound to the head. Its weight is a DTensor sharded over the tensor-parallel
    mesh (FSDP2, where it shards it further, has gathered its own shards by now); `hidden_states` is whole on every
    tensor-parallel rank (the final norm's input is gathered over the sequence)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    weight = self.weight
    mesh, rows = weight.device_mesh, weight.to_local()  # (V / tp, C): this rank's vocabulary rows
    if targets is None:
        logits = F.linear(hidden_states, rows)  # (..., V / tp)
        return DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)]).full_tensor()  # collective: all-gather
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    first = mesh.get_local_rank() * rows.shape[0]
    return vocab_parallel_cross_entropy(hidden, rows, targets.reshape(-1), self.chunk_size, mesh.get_group(), first)


def vocab_parallel_cross_entropy(hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                                 group, first: int) -> torch.Tensor:  # fmt: skip
    """The summed cross-entropy of `hidden` (N, C, whole on every rank of `group`) against `targets` (N,) through a
    head whose vocabulary rows [first, first + len(rows)) this rank holds (`rows`, differentiable), fp32, without
    the (N, V) logits (`model/modeling_shardgpt.chunked_cross_entropy`, over vocabulary shards). Under autocast the
    matmuls take its dtype. The same value on every rank of `group`; no double backward."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _VocabParallelCrossEntropy.apply(hidden, rows, targets, chunk_size, dtype, group, first)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per chunk of tokens: the local logits' row maxima all-reduced (max), then their exponentials' row sums and
    the targets' logits (held by one rank each) all-reduced together (sum): the chunk's loss, the same on every rank,
    and at once its gradient on the local logits (softmax - one-hot), turned into the chunk's hidden states'
    gradient (partial: the local rows' share) and added to the rows' fp32 gradient. The hidden states' gradient is
    all-reduced once, after the last chunk. Targets equal to -100 are ignored."""

    @staticmethod
    def forward(ctx, hidden, rows, targets, chunk_size, compute_dtype, group, first):
        import torch.distributed as dist

        w = rows.to(compute_dtype)  # (V / tp, C)
        vocab = w.shape[0]
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
            for start in range(0, hidden.shape[0], chunk_size):
                h, t = hidden[start : start + chunk_size].to(compute_dtype), targets[start : start + chunk_size]
                counted = (t != -100).unsqueeze(1)  # (n, 1)
                local = t - first
                mine = ((local >= 0) & (local < vocab)).unsqueeze(1) & counted  # the target is in this rank's rows
                local = local.clamp(0, vocab - 1).unsqueeze(1)
                logits = (h @ w.T).float()  # (n, V / tp): the only vocabulary-wide tensors
                peak = logits.max(dim=1).values
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # collective: the rows' maxima
                logits -= peak.unsqueeze(1)
                picked = (logits.gather(1, local) * mine).squeeze(1)
                exp = logits.exp_()  # in place, as the model's chunked loss: one (n, V / tp) fp32 tensor
                sums = torch.stack([exp.sum(dim=1), picked])
                dist.all_reduce(sums, group=group)  # collective: the softmax's denominators, the targets' logits
                total += ((sums[0].log() - sums[1]) * counted.squeeze(1)).sum()
                grad = exp.div_(sums[0].unsqueeze(1)).scatter_add_(1, local, -mine.float()).to(compute_dtype)
                grad_hidden[start : start + chunk_size] = (grad @ w).float() * counted  # (n, C), this rank's share
                grad_rows += (grad.T @ (h * counted)).float()  # (V / tp, C)
        dist.all_reduce(grad_hidden, group=group)  # collective: the hidden states' gradient, summed over the rows
        ctx.save_for_backward(grad_hidden.to(hidden.dtype), grad_rows)
        ctx.rows_dtype = rows.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_rows = ctx.saved_tensors
        scaled = (grad_rows * grad_total).to(ctx.rows_dtype)
        return grad_hidden * grad_total.to(grad_hidden.dtype), scaled, None, None, None, None, None
