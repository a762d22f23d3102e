"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal grouped-query attention.

Parameter names are those of `transformers.LlamaForCausalLM` (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`), so a state dict copies across key for key.
The forward is built from transformers' own parts as `modeling_llama.py` is: the mask from `masking_utils`,
the attention kernel from `ALL_ATTENTION_FUNCTIONS` (eager, sdpa, flex_attention, flash attention, hub
kernels), hidden states and attention weights recorded by `capture_outputs`, the loss from `loss_function`.
So every `attn_implementation`, cache and output option of transformers applies to it as it does to Llama.
The module imports nothing distributed: DDP, FSDP and DeepSpeed are applied from outside. This file is copied
beside every checkpoint, so it imports only torch, transformers and its own configuration.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations import use_kernel_forward_from_hub
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import capture_outputs

from .configuration_shardgpt import ShardGPTConfig


@use_kernel_forward_from_hub("RMSNorm")
class ShardGPTRMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the input dtype (as Llama does). The attribute names are
    Llama's, which the hub's RMSNorm kernels read when `use_kernels=True`."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class ShardGPTRotaryEmbedding(nn.Module):
    """cos and sin of the rotary angles, each (B, T, head_dim), for `position_ids` (B, T).

    The inverse frequencies are computed from the config on every forward (one small outer product per
    forward, shared by all layers) rather than kept in a buffer as Llama does: a buffer would be cast by
    `.to(bf16)`, left empty by meta-device and ZeRO-3 initialisation, and must be rebuilt after `from_pretrained`.
    """

    def __init__(self, config: ShardGPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim
        inv_freq = 1.0 / (self.rope_theta**exponent)  # (head_dim/2,)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (B, heads, T, head_dim) by the angles whose cos/sin are (B, T, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out, the `attn_implementation="eager"` of the attention interface: query (B, H, T, D),
    key and value (B, KV, S, D), `attention_mask` additive (B or 1, 1, T, S) as `create_causal_mask` builds it
    for eager. Returns the output (B, T, H, D) and the attention weights (B, H, T, S)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = (query @ key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


class ShardGPTAttention(nn.Module):
    def __init__(self, config: ShardGPTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        # Read by the attention interface: grouped-query attention, the softmax scale, and causal masking.
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.o_proj.is_residual_projection = True  # read by `_init_weights`

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        # -1 heads, not the config's count: under tensor parallelism each rank holds a slice of the heads.
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, KV, S, D)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        y, weights = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(y.reshape(*input_shape, -1).contiguous()), weights


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

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(normed, position_embeddings, attention_mask, cache, **kwargs)
        h = hidden_states + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class ShardGPTPreTrainedModel(PreTrainedModel):
    config_class = ShardGPTConfig
    config: ShardGPTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ShardGPTDecoderLayer"]
    # Attention goes through transformers' attention interface, so all its kernels apply, as for Llama.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": ShardGPTDecoderLayer, "attentions": ShardGPTAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, initializer_range) for every matrix, the residual projections (`o_proj`,
        `down_proj`) scaled down by sqrt(2 * layers) so the residual stream's variance does not grow with
        depth; norms start at one. `init.*` skips tensors already loaded by `from_pretrained`.

        The rule builders rely on: every initial value is drawn here, from the global RNG and the config alone, one
        module at a time in `initialize_weights`' order (children before parents), writing only that module's own
        parameters and reading no other values. The constructors' own draws (`nn.Linear.reset_parameters`) do not
        count. So a model built without drawing (on the meta device, under `no_init_weights`, inside ZeRO-3's
        `zero.Init`) gets the same weights by running this method module by module on whole temporaries of each
        module's parameters, which is how a sharded model starts without any rank holding all of it.

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
        self.rotary_emb = ShardGPTRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, C)
        # Unlike Llama, the config's `use_cache` is not applied in training: a cache there would only copy every
        # layer's keys and values. An explicit `use_cache=True` still builds one.
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # Position ids from the caller may pack several documents into one row, which the mask then keeps apart.
        # Ones made here cannot, and looking for packing in them costs a device sync per training forward.
        packed_position_ids = position_ids
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)

        # None when the attention kernel's own causal masking is exact (training: no padding): the fast path.
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=packed_position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            # hidden states positional: gradient checkpointing's reentrant path only tracks positional tensors
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=mask,
                cache=cache,
                position_ids=position_ids,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


# The chunked loss is a custom operator (`torch.library.custom_op`) with its own autograd formula: torch.compile sees
# one opaque call with fresh outputs, never the chunk loop's in-place writes, so the gradients cannot depend on how a
# torch version's compiler treats in-place writes inside a traced autograd function (torch 2.11 zeroed them). The
# namespace is this module's own: the file is also imported from exported folders (trust_remote_code) beside it.
_OP_NAMESPACE = "shardgpt_" + "".join(c if c.isalnum() else "_" for c in __name__)


@torch.library.custom_op(f"{_OP_NAMESPACE}::chunked_cross_entropy", mutates_args=())
def _chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), and its gradients with respect to `hidden`
    (N, C) and `weight` (V, C, fp32), without the (N, V) logits.

    The tokens are taken `chunk_size` at a time: a chunk's logits (chunk, V) are computed with the matmul in
    `compute_dtype` (the autocast dtype, as `lm_head` would run) and softmaxed in fp32; they give the chunk's loss
    and at once its gradient (softmax - one-hot), which is turned into the gradients of the chunk's hidden states
    and added to the weight's fp32 gradient before the next chunk. Targets equal to -100 are ignored.
    """
    w = weight.to(compute_dtype)  # (V, C), one cast for all chunks
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size].to(compute_dtype), targets[start : start + chunk_size]
            counted = (t != -100).unsqueeze(1)  # (n, 1)
            t = t.clamp(min=0).unsqueeze(1)  # ignored rows point at class 0; masked below on the (n, C) side
            logp = torch.log_softmax((h @ w.T).float(), dim=-1)  # (n, V): the only vocabulary-wide tensors
            total -= (logp.gather(1, t) * counted).sum()
            grad = logp.exp_().scatter_add_(1, t, -counted.float()).to(compute_dtype)  # d(CE)/d logits
            # Ignored rows are zeroed on the narrow side: their hidden states' gradient and their share of the
            # weight's gradient (h masked), not the (n, V) softmax.
            grad_hidden[start : start + chunk_size] = (grad @ w) * counted  # (n, C)
            grad_weight += grad.T @ (h * counted)  # (V, C)
    return total, grad_hidden, grad_weight


@_chunked_cross_entropy.register_fake
def _(hidden, weight, targets, chunk_size, compute_dtype):
    total = hidden.new_empty((), dtype=torch.float32)
    return total, torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)


def _save_gradients(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])  # the two gradients: (N, C) and (V, C); no logits
    ctx.weight_dtype = inputs[1].dtype


def _scale_gradients(ctx, grad_total, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    return (
        grad_hidden * grad_total.to(grad_hidden.dtype),
        (grad_weight * grad_total).to(ctx.weight_dtype),
        None,
        None,
        None,
    )


_chunked_cross_entropy.register_autograd(_scale_gradients, setup_context=_save_gradients)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
    """The summed cross-entropy of `hidden` (N, C) against `targets` (N,) through the head `weight` (V, C), fp32,
    computed a chunk of tokens at a time (`_chunked_cross_entropy`). Under autocast the matmuls take its dtype,
    as `lm_head` would. No double backward."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _chunked_cross_entropy(hidden, weight, targets, chunk_size, dtype)[0]


class ShardGPTLMHead(nn.Linear):
    """`lm_head`: an `nn.Linear` (vocab, hidden) that, given targets, returns the summed cross-entropy
    (`chunked_cross_entropy`) instead of the logits. The loss goes through the module's own call so that engines
    that gather the weight around a module's forward (ZeRO-3, FSDP) see it used."""

    chunk_size = 1024  # tokens per chunk: (1024, vocab) fp32 logits at a time; larger chunks run matmuls better

    def forward(self, hidden_states: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden_states)
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (B*T, C)
        return chunked_cross_entropy(hidden, self.weight, targets.reshape(-1), self.chunk_size)


class ShardGPTForCausalLM(ShardGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: ShardGPTConfig):
        super().__init__(config)
        self.model = ShardGPTModel(config)
        self.lm_head = ShardGPTLMHead(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """`labels` (B, T) are shifted here, as in transformers: position t predicts `labels[t + 1]`.
        `shift_labels` (B, T) are already shifted (position t predicts `shift_labels[t]`), which lets a
        packed block of T + 1 tokens train all T positions. Positions labelled -100 are ignored.

        With `num_items_in_batch` the loss is the *sum* over tokens divided by that count, so several
        micro batches (or ranks) with different numbers of counted tokens add up to the mean over all of
        them: gradient accumulation then weights tokens, not micro batches. Without it, the mean here.
        In training mode the loss is `chunked_cross_entropy` (fp32, a chunk of tokens at a time) and `logits` is
        None: the (B, T, vocab) logits and their gradient are never held. In eval mode, or without labels, the
        logits are computed and returned as in Llama, and the loss is transformers' `ForCausalLMLoss`
        (`self.loss_function`) on them: the same value.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state  # (B, T, C)
        loss = logits = None
        # The chunked loss needs this model's own head: tensor parallelism may swap it for its own layer (DeepSpeed
        # AutoTP's LinearLayer), and the logits path below then computes the same loss.
        own_head = isinstance(self.lm_head, ShardGPTLMHead)
        if self.training and own_head and (labels is not None or shift_labels is not None):
            # Training: the chunked loss; the (B, T, vocab) logits never exist.
            if shift_labels is None:
                shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]  # position t predicts labels[t + 1]
            total = self.lm_head(hidden, targets=shift_labels)  # sum of the tokens' cross-entropy, fp32
            if num_items_in_batch is None:
                num_items_in_batch = (shift_labels != -100).sum()
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            loss = total / num_items_in_batch
        else:
            logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))  # (B, T, vocab)
        if shift_labels is not None:
            shift_labels = shift_labels.contiguous()  # the loss flattens it with `.view`; a slice of a batch is not
        if logits is not None and (labels is not None or shift_labels is not None):
            loss = self.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=self.config.vocab_size,
                num_items_in_batch=num_items_in_batch,
                shift_labels=shift_labels,
                **kwargs,
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["ShardGPTForCausalLM", "ShardGPTModel", "ShardGPTPreTrainedModel"]
