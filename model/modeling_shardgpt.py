"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal grouped-query attention.

Parameter names are those of `transformers.LlamaForCausalLM` (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`), so a state dict copies across key for key.
The module imports nothing distributed: DDP, FSDP and DeepSpeed are applied from outside. This file is copied
beside every checkpoint, so it imports only torch, transformers and its own configuration.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_shardgpt import ShardGPTConfig


class ShardGPTRMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the input dtype (as Llama does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(config: ShardGPTConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the rotary angles, each (B, T, head_dim), for `position_ids` (B, T).

    Computed from the config on every forward (one small outer product per forward, shared by all layers)
    rather than kept in a buffer: a buffer would be cast by `.to(bf16)`, left empty by meta-device and
    ZeRO-3 initialisation, and must be rebuilt after `from_pretrained`.
    """
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)  # (head_dim/2,)
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (B, heads, T, head_dim) by the angles whose cos/sin are (B, T, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def causal_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, q_len, kv_len), True where a query may attend, or None when plain causal
    attention (`is_causal=True`, the fast path for training) or no mask at all (one new token, no padding)
    is exact.

    Queries are the last `q_len` of `kv_len` positions (a KV cache holds the first ones), so query i sits at
    absolute position `kv_len - q_len + i`. `attention_mask` (B, kv_len) marks real tokens with 1 and padding
    with 0, as transformers' tokenizers and `generate()` produce it.
    """
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (q_len == kv_len or q_len == 1):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    allowed = torch.arange(kv_len, device=device)[None, :] <= q_pos  # (q_len, kv_len)
    allowed = allowed[None, None]
    if padded:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
        # A left-padded row has queries that see no key at all; let them see themselves so softmax is finite.
        # Their outputs are padding and never used.
        allowed = allowed | (
            ~allowed.any(-1, keepdim=True) & torch.eye(q_len, kv_len, dtype=torch.bool, device=device)[None, None]
        )
    return allowed


def eager_attention(q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Attention written out, for checking SDPA: q (B, H, T, D), k and v (B, H, S, D)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class ShardGPTAttention(nn.Module):
    def __init__(self, config: ShardGPTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.o_proj.is_residual_projection = True  # read by `_init_weights`

    def forward(self, x, cos, sin, mask, past_key_values: Cache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)  # (B, KV, S, D), S = cached + T
        if self.num_kv_heads != self.num_heads:
            # Each group of query heads reads one key/value head. An explicit repeat (not SDPA's enable_gqa)
            # keeps every SDPA backend, the flash kernels included, available.
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        is_causal = mask is None and k.shape[-2] == T and T > 1
        if self.config._attn_implementation == "eager":
            y = eager_attention(q, k, v, mask, is_causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class ShardGPTMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ShardGPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.down_proj.is_residual_projection = True  # read by `_init_weights`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ShardGPTDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP wraps and checkpointing
    recomputes."""

    def __init__(self, config: ShardGPTConfig, layer_idx: int):
        super().__init__()
        # Llama's order, so state dicts list the same keys in the same order
        self.self_attn = ShardGPTAttention(config, layer_idx)
        self.mlp = ShardGPTMLP(config)
        self.input_layernorm = ShardGPTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ShardGPTRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, mask=None, past_key_values=None, **kwargs) -> torch.Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class ShardGPTPreTrainedModel(PreTrainedModel):
    config_class = ShardGPTConfig
    config: ShardGPTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ShardGPTDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, initializer_range) for every matrix, the residual projections (`o_proj`,
        `down_proj`) scaled down by sqrt(2 * layers) so the residual stream's variance does not grow with
        depth; norms start at one. `init.*` skips tensors already loaded by `from_pretrained`.

        Only modules that own parameters are initialised here: transformers skips a custom-code module
        without direct parameters, so the residual scaling is read from a flag on the projection itself."""
        std = self.config.initializer_range
        if getattr(module, "is_residual_projection", False):
            std = std / math.sqrt(2 * self.config.num_hidden_layers)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ShardGPTRMSNorm):
            init.ones_(module.weight)


class ShardGPTModel(ShardGPTPreTrainedModel):
    """The decoder stack without the language-model head; `LlamaModel` in transformers."""

    def __init__(self, config: ShardGPTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ShardGPTDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ShardGPTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, C)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        B, T, _ = inputs_embeds.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None].expand(B, T)
        cos, sin = rotary_cos_sin(self.config, position_ids, inputs_embeds.dtype)
        mask = causal_mask(attention_mask, T, past + T, inputs_embeds.device)

        h = inputs_embeds
        for layer in self.layers:
            # positional args: gradient checkpointing's reentrant path only tracks positional tensors
            h = layer(h, cos, sin, mask, past_key_values if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)


class ShardGPTForCausalLM(ShardGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ShardGPTConfig):
        super().__init__(config)
        self.model = ShardGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`labels` (B, T) are shifted here, as in transformers: position t predicts `labels[t + 1]`.
        `shift_labels` (B, T) are already shifted (position t predicts `shift_labels[t]`), which lets a
        packed block of T + 1 tokens train all T positions. Positions labelled -100 are ignored.

        With `num_items_in_batch` the loss is the *sum* over tokens divided by that count, so several
        micro batches (or ranks) with different numbers of counted tokens add up to the mean over all of
        them: gradient accumulation then weights tokens, not micro batches. Without it, the mean here.
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)  # (B, T, vocab)

        loss = None
        if labels is not None or shift_labels is not None:
            if shift_labels is None:
                shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
            loss = causal_lm_loss(logits, shift_labels, num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy in fp32 of logits (B, T, V) against already-shifted targets (B, T), -100 ignored."""
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(),
        shift_labels.flatten().to(logits.device),
        ignore_index=-100,
        reduction=reduction,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


__all__ = ["ShardGPTForCausalLM", "ShardGPTModel", "ShardGPTPreTrainedModel", "causal_lm_loss"]
