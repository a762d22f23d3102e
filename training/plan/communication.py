"""What a training step should send, in closed form: the payload bytes of each kind of collective per rank and step
for a strategy with its settings, and the ZeRO paper's volume (Rajbhandari et al. 2020, section 7), in the
convention of training/loop/comms.py, which counts what a step really sends."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts, in elements, that decide what a data-parallel step moves."""

    parameters: int
    """Psi: every parameter element once (a tied embedding and head counted once)."""
    outside_layers: int
    """Elements outside the decoder layers (the embedding, the final norm, an untied head): FSDP2's root group."""
    tied_embedding: int = 0
    """The embedding's elements when the head shares it (used twice in each forward), else 0."""
    persistent: int = 0
    """Elements of parameters at most ZeRO-3's `stage3_param_persistence_threshold`, kept whole on every rank."""
    norms: int = 0
    """Elements of the RMSNorm weights, which tensor parallelism leaves whole on every rank."""
    matrices: int = 0
    """Elements of the decoder layers' matrices: what the model's tensor-parallel plan splits."""

    @classmethod
    def of(cls, config, persistence_threshold: int = 0) -> ModelShape:
        """The shape of a ShardGPTConfig's model (a Llama: no biases, two RMSNorms per layer and a final one)."""
        h, layers = config.hidden_size, config.num_hidden_layers
        embedding = config.vocab_size * h
        head = 0 if config.tie_word_embeddings else embedding
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        attention = 2 * h * h + 2 * h * config.num_key_value_heads * head_dim  # q and o; k and v
        layer = attention + 3 * h * config.intermediate_size + 2 * h
        sizes = [embedding, head, h] + [h, h] * layers  # the norms: each layer's two and the final one
        persistent = sum(n for n in sizes if 0 < n <= persistence_threshold)
        return cls(layers * layer + embedding + head + h, embedding + head + h,
                   embedding if config.tie_word_embeddings else 0, persistent, (2 * layers + 1) * h,
                   layers * (layer - 2 * h))  # fmt: skip


def expected_payloads(strategy, shape: ModelShape, bytes_per_element: int = 4, micro_batches: int = 1,
                      optim: str = "adamw_torch") -> dict[str, int] | None:  # fmt: skip
    """The payload bytes of each kind of collective that carries parameters or gradients, per rank and step of
    `micro_batches` micro batches, for a data-parallel strategy with the settings in force (`bytes_per_element`: the
    communication dtype's), measured to the byte on 2 and 4 CPU ranks. The loss's and the gradient norm's
    all-reduces (a few bytes) are not in it. None where no closed form is known here: tensor or pipeline parallelism,
    FSDP1 or ZeRO-3 with live-parameter limits below the model over several micro batches, and ZeRO-3 with limits
    between 0 and the model.

    - DDP: one all-reduce of the gradients, Psi, once a step (accelerate's `no_sync` skips the others).
    - FSDP2 (and FSDP1), FULL_SHARD: each decoder layer all-gathered in the forward and again in the backward, the
      root group (the parameters outside the layers) once, since it stays gathered after the forward (accelerate
      sets that for FSDP2; FSDP1's root unit does it by default): 2 Psi minus the root's, every micro batch; the
      gradients reduce-scattered, Psi, once a step (accelerate turns FSDP2's gradient sync off until the last).
      SHARD_GRAD_OP: all-gathers of Psi every micro batch, reduce-scatters of Psi. Hybrid (replicas > 1): the same
      within a replica's shard group, and each rank's reduce-scattered shard all-reduced across the replicas, Psi /
      shard_size (each weight's rows dividing by the shard count; FSDP2 pads the rest).
    - ZeRO-1/2: DeepSpeed's `use_multi_rank_bucket_allreduce` (default true) reduces each gradient bucket with an
      all-reduce, where the paper has a reduce-scatter; false: a reduce to each partition's owner. ZeRO-1 reduces
      once a step, ZeRO-2 every micro batch. Then an all-gather of the updated partitions, Psi.
    - ZeRO-3: the gradients reduce-scattered, Psi, every micro batch. With `stage3_max_live_parameters` and
      `stage3_max_reuse_distance` at least Psi, every gathered parameter stays until the micro batch ends: all-gathers
      of Psi less the persistent parameters each micro batch, and the persistent ones (whole on every rank) once a
      step. At 0 (one micro batch), each module's parameters are released after use and gathered again:
      in the forward and the backward, the tied embedding once more in each (it is the head too), and the
      persistent parameters never again.
    - --optim muon (training/muon.py) orthogonalizes each decoder matrix whole: where a rank holds shards (FSDP2) or
      partitions (ZeRO-1/2/3) of them, the step all-gathers their update once more, the matrices' elements (FSDP2:
      one call per matrix; ZeRO: one per group); DDP holds them whole and sends nothing more.
    """
    psi, ds = shape.parameters, (strategy.deepspeed or {}).get("zero_optimization", {})
    m = micro_batches
    if strategy.tp_size > 1 or strategy.pp_size > 1 or strategy.sp_size > 1:
        return None
    if strategy.family == "ddp":
        elements = {"all_reduce": psi}
    elif strategy.family == "fsdp" and strategy.fsdp_sharding != "NO_SHARD":  # FSDP1 too: its root unit is kept
        if m > 1 and strategy.fsdp_version == 1:
            return None
        kept = strategy.fsdp_sharding == "SHARD_GRAD_OP"
        elements = {"all_gather": m * (psi if kept else 2 * psi - shape.outside_layers), "reduce_scatter": psi}
        if strategy.replicas > 1:
            elements["all_reduce"] = psi // strategy.shard_size
    elif strategy.family == "deepspeed" and strategy.zero_stage in (1, 2):
        reduction = "all_reduce" if ds.get("use_multi_rank_bucket_allreduce", True) else "reduce"
        elements = {reduction: (m if strategy.zero_stage == 2 else 1) * psi, "all_gather": psi}
    elif strategy.family == "deepspeed" and strategy.zero_stage == 3:
        live, reuse = (int(ds.get(k, 1e9)) for k in ("stage3_max_live_parameters", "stage3_max_reuse_distance"))
        if min(live, reuse) >= psi:
            gathered = m * (psi - shape.persistent) + shape.persistent
        elif live == reuse == 0 and m == 1:
            gathered = 2 * (psi - shape.persistent) + shape.persistent + 2 * shape.tied_embedding
        else:
            return None
        elements = {"all_gather": gathered, "reduce_scatter": m * psi}
    else:
        return None
    if optim == "muon" and strategy.family in ("fsdp", "deepspeed"):
        elements["all_gather"] = elements.get("all_gather", 0) + shape.matrices
    return {kind: n * bytes_per_element for kind, n in elements.items()}


def autotp_payloads(strategy, shape: ModelShape, split_modules: dict[str, int], micro_tokens: int, micro_batches: int,
                    hidden_size: int, bytes_per_element: int = 4) -> dict[str, int]:  # fmt: skip
    """The payload bytes per rank and step under DeepSpeed AutoTP with ZeRO-1 (ds_configs/autotp.json), measured to the
    byte on 2 and 4 CPU ranks with one micro batch per step. `split_modules`: the count of each style the model's plan
    split (strategy.json's `tensor_parallel.split_modules`); `micro_tokens`: a micro batch's sequences x block; fp32
    activations.

    - Each micro batch, in the forward, the partial outputs of every row-split module (o_proj, down_proj) and of the
      vocabulary-split embedding are all-reduced; in the backward, the partial input gradients of every column-split
      module (q, k, v, gate, up, the head). Each is micro_tokens x hidden.
    - The loss over the vocabulary-split logits (DeepSpeed's vocab-parallel cross entropy): 3 all-reduces of one
      value per token (the maximum, the target's logit, the sum of exponentials).
    - ZeRO-1 over the data-parallel ranks, on this rank's slice (1/tp of the split weights, the norms whole): an
      all-reduce of its gradients (`use_multi_rank_bucket_allreduce`, even over a single data-parallel rank) and, with
      more than one, an all-gather of the updated partitions.
    """
    activations = split_modules.get("rowwise", 0) + split_modules.get("embedding_rowwise", 0)
    activations += split_modules.get("colwise", 0) + split_modules.get("colwise_gather_output", 0)
    per_micro = activations * micro_tokens * hidden_size + 3 * micro_tokens
    local = (shape.parameters - shape.norms) // strategy.tp_size + shape.norms
    payloads = {"all_reduce": (micro_batches * per_micro + local) * bytes_per_element}
    if strategy.data_parallel_size > 1:
        payloads["all_gather"] = local * bytes_per_element
    return payloads


def dtensor_payloads(strategy, shape: ModelShape, split_modules: dict[str, int], micro_tokens: int,
                     micro_batches: int, hidden_size: int,
                     bytes_per_element: int = 4) -> dict[str, int] | None:  # fmt: skip
    """The payload bytes per rank and step under FSDP2 x TP (the model's plan with torch's DTensor styles and
    Megatron's sequence parallelism, training/axes/tensor/plan.sequence_parallel_plan), measured to the byte on 4 CPU
    ranks (dp_shard 2 x tp 2, and dp_replicate 2 x tp 2: DDP x TP) and on 8 (hybrid: dp_replicate 2 x dp_shard 2 x tp
    2) with one micro batch a step. `split_modules`: the count of each style the plan split (2 row-split modules a
    layer); each activation collective carries micro_tokens x hidden.

    - Each micro batch and layer, in the forward: the attention's and the MLP's input gathered over the sequence (2
      all-gathers), the row-split projections' partial outputs reduce-scattered onto it (2 reduce-scatters); in the
      backward the transposes: 2 all-gathers, 2 reduce-scatters (the column-split modules' input gradients added first),
      and the two inputs gathered again for the column-split modules' weight gradients (2 all-gathers: Megatron's
      layout, `tensor.save_sequence_shards`; with activation checkpointing the recomputed forward's gathers in their
      place). Besides, the embedding's partial rows reduce-scattered onto the sequence shards and the final norm's input
      gathered in the forward, the embedding's output gradient gathered in the backward; the decoder norms' weight
      gradients, partial over the sequence shards, all-reduced (hidden each, 2 a layer); the loss over vocabulary
      shards' all-reduces (`vocab_parallel_loss_bytes`, fp32).
    - FSDP2 over the data-parallel ranks, on this rank's slice (1/tp of the split matrices and of the embedding's
      and head's vocabulary rows, the norms whole), as plain FSDP2 on the whole model (`expected_payloads`): each
      decoder layer gathered in the forward and again in the backward, the group outside the layers (embedding,
      final norm, head) once, kept gathered: 2 x the slice - the outside, each micro batch; the gradients
      reduce-scattered once a step.
    - Replicated copies (dp_replicate, a dp_shard of 1: DDP x TP, `replicated_tensor_parallel`): FSDP2 sends nothing
      within a copy of one rank; the slice's gradients all-reduced across the copies once a step, DDP's traffic.
    - Replicas of a sharded copy (hybrid, dp_shard above 1): FSDP2's traffic within the copy's shard group as above,
      and each rank's reduce-scattered shard of the slice all-reduced across the replicas once a step (as hybrid
      FSDP2 without tensor parallelism: `expected_payloads`).
    """
    tp = strategy.tp_size
    vocabulary = shape.outside_layers - hidden_size  # the embedding and an untied head: split by vocabulary rows
    split = shape.matrices + vocabulary
    local = shape.parameters - split + split // tp
    outside = vocabulary // tp + hidden_size  # FSDP2's root group on this rank: its rows, the final norm
    regions = 2 * split_modules.get("rowwise", 0)  # a gather and a scatter each way per row-split module
    regathers = split_modules.get("rowwise", 0)  # each region's input gathered again in the backward
    activation = micro_tokens * hidden_size
    sharded = strategy.shard_size > 1  # else whole copies: no gathers, no scatters, an all-reduce of the slice
    across = (local // strategy.shard_size) if strategy.replicas > 1 else 0  # the replicas' all-reduce
    payloads = {
        "all_reduce": micro_batches * (shape.norms - hidden_size) + across,
        "all_gather": micro_batches * ((regions + regathers + 2) * activation + (2 * local - outside) * sharded),
        "reduce_scatter": micro_batches * (regions + 1) * activation + local * sharded,
    }
    payloads = {kind: n * bytes_per_element for kind, n in payloads.items()}
    payloads["all_reduce"] += micro_batches * vocab_parallel_loss_bytes(micro_tokens, hidden_size)
    return payloads


def vocab_parallel_loss_bytes(tokens: int, hidden_size: int) -> int:
    """All-reduced bytes of the loss over vocabulary shards (training/axes/tensor/vocab.vocab_parallel_cross_entropy)
    for a micro batch of `tokens`, in fp32 whatever the run computes in: the logits' row maxima, the softmax's
    denominators and the targets' logits (3 a token), and the hidden states' gradient (hidden a token)."""
    return 4 * tokens * (3 + hidden_size)


def pipeline_payloads(strategy, shape: ModelShape, config, micro_tokens: int, micro_batches: int, rank: int,
                      bytes_per_element: int = 4) -> dict[str, int] | None:  # fmt: skip
    """The payload bytes of global rank `rank` per step under pipeline parallelism (training/axes/pipeline/runtime.py),
    with tensor parallelism inside its stages or not, and one process, DDP's average or FSDP2 across the pipelines;
    measured to the byte under GPipe and 1F1B on 2 to 8 CPU ranks (2 stages of one layer; tp 1 and 2; one process,
    DDP and FSDP2), and by hand under Interleaved1F1B (tp 2 x pp 2, 4 stages of one layer). Ranks differ: the first
    stage holds the embedding, the last the final norm and the head. None under FSDP2 with several stages a rank
    (not measured). Each activation message carries micro_tokens x
    hidden values; FSDP2's shards as even splits (each weight's rows dividing by the data-parallel ranks).

    - Point-to-point, each micro batch, at each boundary of the rank's stage with a neighbour's: the activations
      forward and their gradient backward, sent or received (a message each way, counted on both of its ranks); under
      tensor parallelism the rank's sequence shard, a tp-th of them.
    - Tensor parallelism inside the stage, with Megatron's sequence parallelism (`split_stage`), as under FSDP2 x TP
      (`dtensor_payloads`) on the stage's layers: each micro batch and layer 6 all-gathers (the backward's 2 regathers
      among them) and 4 reduce-scatters of its activations; the first stage reduce-scatters its embedding's partial rows
      and gathers their gradient, the last gathers its final norm's input and all-reduces the loss over vocabulary
      shards (`vocab_parallel_loss_bytes`, fp32). The decoder norms' weight gradients, partial over the shards,
      all-reduced once a step after the schedule (hidden each, 2 a layer: `Pipeline.settle_split_gradients`).
    - The tied embedding's two gradients (first and last stage) summed once a step: an all-reduce of the embedding's
      rows on the rank (1/tp of them under tensor parallelism), or their FSDP2 shard (the same rows on both).
    - Across the pipelines, on the rank's slice of its stage (1/tp of each decoder matrix and of the embedding's and
      head's vocabulary rows, the norms whole): DDP's
      average, an all-reduce once a step, after the schedule. FSDP2: each unit (the layers, the stage's root)
      gathered once more than there are micro batches: a forward reshards it (FULL_SHARD), a backward keeps it until
      the last (torch's schedules), so of the step's alternating forwards and backwards each forward's successor and
      the first event gather; SHARD_GRAD_OP gathers once. The gradients reduce-scattered in the last backward.
    - The schedule's own bookkeeping, 4 bytes each: the step's loss broadcast from the last stage, and each rank's
      busy share of the schedule gathered from every rank (not under the zero-bubble schedules).
    The loss's and the gradient norm's all-reduces (a few scalars) are not in it.
    """
    from training.axes.pipeline.schedules import ZERO_BUBBLE, stage_layers, stage_ranks

    looped = strategy.pp_stages_per_rank > 1 and strategy.family == "fsdp"  # FSDP2's gathers: not measured
    if looped or strategy.cp_size > 1 or strategy.sp_size > 1 or strategy.replicas > 1:
        return None
    pp, tp, m, h = strategy.pp_size, strategy.tp_size, micro_batches, config.hidden_size
    owners = stage_ranks(strategy.pp_schedule, pp, strategy.pp_stages_per_rank)
    me, last = strategy.pipeline_rank(rank), len(owners) - 1
    mine = [s for s, owner in enumerate(owners) if owner == me]
    layers = sum(len(stage_layers(config.num_hidden_layers, len(owners), s)) for s in mine)
    embedding = (shape.tied_embedding or (shape.outside_layers - h) // 2) // tp  # this rank's vocabulary rows
    head = 0 if shape.tied_embedding else embedding
    per_layer = shape.matrices // config.num_hidden_layers
    local = layers * (per_layer // tp + 2 * h)
    local += (embedding if 0 in mine else 0) + (h + head if last in mine else 0)
    if shape.tied_embedding and last in mine and 0 not in mine:
        local += embedding  # the head's copy of the tied embedding
    boundaries = sum((s > 0 and owners[s - 1] != me) + (s < last and owners[s + 1] != me) for s in mine)
    sharded = strategy.family == "fsdp"
    dp = strategy.data_parallel_size
    activation = micro_tokens * h
    elements = {"point_to_point": m * 2 * boundaries * activation // tp, "all_reduce": 0, "all_gather": 0}
    if tp > 1:  # sequence parallelism's regions, as under FSDP2 x TP (`dtensor_payloads`), on the stage's layers
        regions = 2 * list(config.base_model_tp_plan.values()).count("rowwise") * layers
        ends = (0 in mine) + (last in mine)  # the embedding's output gradient, the final norm's input
        elements["all_gather"] += m * (regions + regions // 2 + ends) * activation  # and the backward's regathers
        elements["reduce_scatter"] = m * (regions + (0 in mine)) * activation  # and the embedding's partial rows
        elements["all_reduce"] += 2 * layers * h  # the decoder norms' weight gradients, once a step
    if shape.tied_embedding and owners[0] != owners[-1] and (0 in mine or last in mine):
        elements["all_reduce"] += embedding // (dp if sharded else 1)
    if dp > 1 and sharded:
        gathers = m + 1 if strategy.fsdp_sharding == "FULL_SHARD" else 1
        elements["all_gather"] += gathers * local
        elements["reduce_scatter"] = elements.get("reduce_scatter", 0) + local
    elif dp > 1:
        elements["all_reduce"] += local
    payloads = {kind: n * bytes_per_element for kind, n in elements.items() if n}
    if tp > 1 and last in mine:  # the loss over vocabulary shards, each micro batch
        payloads["all_reduce"] = payloads.get("all_reduce", 0) + m * vocab_parallel_loss_bytes(micro_tokens, h)
    payloads["broadcast"] = 4
    if strategy.pp_schedule not in ZERO_BUBBLE:
        payloads["all_gather"] = payloads.get("all_gather", 0) + 4 * strategy.world_size
    return payloads


def ulysses_payloads(strategy, shape: ModelShape, config, micro_tokens: int, micro_batches: int,
                     bytes_per_element: int = 4) -> dict[str, int] | None:  # fmt: skip
    """The payload bytes per rank and step under DeepSpeed's Ulysses sequence parallelism
    (training/axes/ulysses.py), measured to the byte on 2 and 4 CPU ranks; None where the ZeRO stage has no closed
    form. `config`: the model's ShardGPTConfig; `micro_tokens`: a micro batch's sequences x block (whole sequences; each
    rank holds 1/sp of them).

    - Each micro batch and decoder layer, forward and backward: an all-to-all of this rank's q, k, v before the
      attention and one of its output after it (q and the output hidden wide, k and v key-value heads x head_dim),
      each over micro_tokens / sp positions; and, in the forward, an all-gather of the position ids (int64).
    - The ZeRO stage's own traffic over every rank, as without sequence parallelism (`expected_payloads`).
    """
    base = expected_payloads(strategy.with_degrees(sp=1), shape, bytes_per_element, micro_batches)
    if base is None:
        return None
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    local = micro_tokens // strategy.sp_size  # positions this rank holds
    exchanged = 2 * layers * local * (2 * h + 2 * config.num_key_value_heads * head_dim)  # forward and backward
    payloads = dict(base)
    payloads["all_to_all"] = micro_batches * exchanged * bytes_per_element
    payloads["all_gather"] = payloads.get("all_gather", 0) + micro_batches * layers * micro_tokens * 8
    return payloads


def step_payloads(strategy, shape: ModelShape, config, micro_tokens: int, micro_batches: int,
                  split_modules: dict[str, int] | None = None, bytes_per_element: int = 4,
                  rank: int = 0, optim: str = "adamw_torch") -> dict[str, int] | None:  # fmt: skip
    """The closed form for any launch the training script runs, for global rank `rank`: a pipeline's (with tensor
    parallelism in its stages or not), AutoTP's or FSDP2 x TP's (`split_modules`: the count of each style the model's
    plan splits), Ulysses', or the data-parallel strategy's; None where there is none."""
    if optim == "muon" and strategy.pp_size > 1 and strategy.family == "fsdp":
        return None  # each stage's matrices gathered: not in the pipeline's closed form here
    if strategy.pp_size > 1:  # under DDP Muon sends nothing more
        return pipeline_payloads(strategy, shape, config, micro_tokens, micro_batches, rank, bytes_per_element)
    if strategy.tp_size > 1:
        hidden = config.hidden_size
        payloads = dtensor_payloads if strategy.family == "fsdp" else autotp_payloads
        return payloads(strategy, shape, split_modules, micro_tokens, micro_batches, hidden, bytes_per_element)
    if strategy.sp_size > 1:
        return ulysses_payloads(strategy, shape, config, micro_tokens, micro_batches, bytes_per_element)
    return expected_payloads(strategy, shape, bytes_per_element, micro_batches, optim)


def paper_volume(strategy, psi: int, bytes_per_element: int = 4) -> int | None:
    """The ZeRO paper's volume per rank and step (section 7) for `strategy`'s data-parallel sharding, in bytes:
    2 Psi for DDP, ZeRO-1 and ZeRO-2 (FSDP's SHARD_GRAD_OP), 3 Psi for ZeRO-3 (FSDP's FULL_SHARD), offloaded or not.
    None where the paper has no figure (tensor or pipeline parallelism, hybrid sharding)."""
    if strategy.tp_size > 1 or strategy.pp_size > 1 or strategy.sp_size > 1 or strategy.replicas > 1:
        return None
    if strategy.family == "ddp" or (strategy.family == "deepspeed" and strategy.zero_stage in (1, 2)):
        units = 2
    elif strategy.family == "deepspeed" and strategy.zero_stage == 3:
        units = 3
    elif strategy.family == "fsdp" and strategy.fsdp_sharding != "NO_SHARD":
        units = 3 if strategy.fsdp_sharding == "FULL_SHARD" else 2
    else:
        return None
    return units * psi * bytes_per_element
