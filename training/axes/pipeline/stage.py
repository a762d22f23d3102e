"""A pipeline stage: the embedding (first stage), a run of decoder layers, the final norm and head (last stage), the
model's own modules, and `keep_stages`, which trims a rank's whole model to its stages in place (the parameters keep
their HF names, so the optimizer's groups, the export and the checkpoints read them as the whole model's)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from training.axes.pipeline.busy_clock import BackwardMark, BusyClock
from training.axes.pipeline.schedules import stage_layers


class Stage(nn.Module):
    """One pipeline stage of the model: the embedding (first stage), a run of decoder layers, and the final norm and
    head (last stage). Its modules are the model's own (shared, not copied). The first stage takes token ids, the
    others the hidden states (B, T, C) the stage before sends; the last returns its micro batch's summed
    cross-entropy, shape (1,), which the schedule's loss function scales."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, clock: BusyClock | None = None):
        super().__init__()
        self.clock = clock  # this rank's: every stage it holds adds its compute
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = model.model.rotary_emb
        self.sequence_shards = 1  # under tensor parallelism (`split_stage`): the ranks a sequence is sharded over

    def forward(self, x: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        timed = self.clock is not None and torch.is_grad_enabled()
        start = self.clock.mark() if timed else None
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, C)
        h = BackwardMark.apply(h, self.clock, False) if timed else h  # the backward ends here (the embedding's: after)
        out = self.layers_forward(h, shift_labels)
        if timed:
            self.clock.spans.append((start, self.clock.mark()))
            out = BackwardMark.apply(out, self.clock, True)  # the backward starts here
        return out

    def layers_forward(self, h: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        # A later stage under sequence parallelism receives its rank's shard of the sequence; its attention sees the
        # whole sequence (gathered), whose positions and mask these are.
        seq_len = h.shape[1] * (self.sequence_shards if self.embed_tokens is None else 1)
        position_ids = torch.arange(seq_len, device=h.device).unsqueeze(0)
        whole = h if seq_len == h.shape[1] else h.new_empty(h.shape[0], seq_len, 0)  # the mask reads shape and dtype
        # None where the attention kernel's own causal masking is exact (sdpa, training: no padding), as in the model.
        mask = create_causal_mask(
            config=self.config, inputs_embeds=whole, attention_mask=None, cache=None, position_ids=None
        )
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids)
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h), targets=shift_labels).reshape(1)  # summed cross-entropy, fp32


def keep_stages(model: nn.Module, stages: list[int], num_stages: int, clock: BusyClock | None = None) -> list[Stage]:
    """This rank's `stages` of `model`, whose other layers, embedding and head are dropped in place (the model keeps
    its HF parameter names). Returns the Stage modules, in stage order."""
    num_layers = model.config.num_hidden_layers
    kept = {i for s in stages for i in stage_layers(num_layers, num_stages, s)}
    first, last = 0 in stages, num_stages - 1 in stages
    for i in range(num_layers):
        if i not in kept:
            model.model.layers[i] = nn.Module()  # a placeholder: the kept layers keep their indices (names)
    result = [
        Stage(model, stage_layers(num_layers, num_stages, s), s == 0, s == num_stages - 1, clock)
        for s in sorted(stages)
    ]
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = model.lm_head = None
    return result
