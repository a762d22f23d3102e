"""A pipeline's memory per stage: the parameters a stage keeps, the micro batches a schedule holds in flight on
it, and the model states and activations of each pipeline rank under DDP or FSDP2.
"""

from __future__ import annotations

from model import ShardGPTConfig
from training.axes.pipeline.schedules import check_pipeline, stage_layers
from training.axes.table import composes, composes_with, wrapper
from training.plan.memory.activations import (
    adam_temporaries,
    final_norm_bytes,
    layer_activation_bytes,
    loss_chunk_bytes,
    rotary_bytes,
    saved_loss_bytes,
)
from training.plan.memory.layout import BYTES, Layout, layout, ranks_to_check
from training.plan.memory.states import Item, adam, bytes_by_category, fsdp_states
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- pipeline stages

# The schedules whose activations the planner models. The interleaved and zero-bubble ones hold several stages per
# rank and order their micro batches differently (their split backwards too): not modelled.
PIPELINE_SCHEDULES = ("GPipe", "1F1B")


def in_flight(schedule: str, pp: int, micro_batches: int, stage: int) -> int:
    """Micro batches whose activations stage `stage` of `pp` holds at once, at most: GPipe runs every forward before
    any backward (M); under 1F1B stage s runs P - s forwards before its first backward, then one forward per
    backward (min(M, P - s)). Measured with torch's schedules: tests/training/test_bubble.py."""
    if schedule == "GPipe":
        return micro_batches
    if schedule == "1F1B":
        return min(micro_batches, pp - stage)
    raise ValueError(f"the planner models {' and '.join(PIPELINE_SCHEDULES)}'s activations, not {schedule}'s")


def interleaved_in_flight(pp: int, per_rank: int, micro_batches: int, rank: int) -> int:
    """Stage-micro-batches (a micro batch in one of its stages) rank `rank` of `pp` holds at once under torch's
    Interleaved1F1B with `per_rank` stages a rank: its warm-up forwards, (v - 1) x the micro batches of a round plus
    2 for each rank after it (`_get_warmup_ops`: a round is M / max(1, M // P) micro batches), then one forward before
    each backward, at most every micro batch in every stage (M v, where M <= P leaves no steady state: GPipe's
    count). Where M is a multiple of P this is Korthikanti et al. 2022's P (1 + (P - 1) / (P v)) x v on the first
    rank, and Megatron-Core's schedule's. Measured with torch's schedule: tests/training/test_bubble.py."""
    rounds = max(1, micro_batches // pp)
    warmup = (per_rank - 1) * (micro_batches // rounds) + 2 * (pp - 1 - rank)
    every = micro_batches * per_rank
    return every if warmup >= every else warmup + 1


def stage_layout(lay: Layout, num_stages: int, stage: int) -> Layout:
    """The parameters stage `stage` keeps (`keep_stages`, training/axes/pipeline/): its decoder layers, the embedding on
    the
    first stage, the final norm and the head on the last, where a tied head is a second copy of the embedding."""
    config = lay.config
    layers = tuple(f"model.layers.{i}." for i in stage_layers(config.num_hidden_layers, num_stages, stage))
    first, last = stage == 0, stage == num_stages - 1

    def kept(name: str) -> bool:
        if name == "model.embed_tokens.weight":
            return first or (last and config.tie_word_embeddings)
        if name in ("model.norm.weight", "lm_head.weight"):
            return last
        return name.startswith(layers)

    keep = [i for i, name in enumerate(lay.names) if kept(name)]
    new = {old: j for j, old in enumerate(keep)}
    by_module: dict[str, int] = {}
    for i in keep:
        module = lay.names[i].rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + lay.numels[i]
    groups = [[new[i] for i in group if i in new] for group in lay.groups]
    return Layout(
        config, [lay.names[i] for i in keep], [lay.numels[i] for i in keep], [lay.rows[i] for i in keep],
        [g for g in groups if g], [new[i] for i in lay.root if i in new], lay.layer_numel, max(by_module.values()),
    )  # fmt: skip


def stage_held(config: ShardGPTConfig, micro_batch: int, seq_len: int, e: int, checkpointing: bool, schedule: str,
               pp: int, micro_batches: int, stage: int, hidden: int = 4, tp: int = 1) -> tuple[int, int]:  # fmt: skip
    """What stage `stage` holds for its backward at its peak: (activations, the chunked loss's saved gradients).

    Per micro batch in flight (`in_flight`): its layers' saved tensors (`layer_activation_bytes` per layer and
    token; with activation checkpointing the layer's input), the rotary cos and sin the stage computed for it, and
    on the last stage the final norm's and the loss's saved tensors, on the others the output torch's PipelineStage
    keeps until the micro batch's backward (h per token in the hidden states' dtype, `hidden` bytes). Once: the
    first stage's token ids, 8 bytes per token of the whole step (the schedule's micro batches are views of the
    step's ids, whose storage any of them keeps), and with checkpointing the one layer being recomputed.
    Measured to the byte on the model's own stages (tests/training/test_bubble.py), fp32, without tensor
    parallelism and with it (`tp` ranks a stage, with Megatron's sequence parallelism: training/axes/tensor/plan.py's
    `split_stage`), where each layer saves `layer_activation_bytes`' sequence-parallel share (measured outside
    pipelines too: training/measure/tensor_memory.py), and the input kept with checkpointing and the output sent on are
    the rank's sequence shard."""
    c = config
    tokens = micro_batch * seq_len
    first, last = stage == 0, stage == pp - 1
    layer = layer_activation_bytes(c, e, tp, sequence_parallel=tp > 1)
    per_layer = e * c.hidden_size // tp if checkpointing else layer  # a layer's input: the rank's sequence shard
    per_micro = len(stage_layers(c.num_hidden_layers, pp, stage)) * per_layer * tokens + rotary_bytes(c, seq_len, e)
    per_micro += (final_norm_bytes(c, e) if last else hidden * c.hidden_size // tp) * tokens
    n = in_flight(schedule, pp, micro_batches, stage)
    recomputed = layer_activation_bytes(c, e, tp, tp > 1, gathered=True)  # in torch's layout: the inputs gathered
    once = (8 * tokens * micro_batches if first else 0) + (recomputed * tokens if checkpointing else 0)
    return n * per_micro + once, n * saved_loss_bytes(c, micro_batch, seq_len, e, tp) if last else 0


def models_pipeline(strategy: Strategy) -> bool:
    """Whether `pipeline_stages` plans `strategy`: one stage per rank under GPipe or 1F1B, each stage one process,
    DDP or FSDP2 (full shard or shard-grad-op), its layers split by the model's plan over tp ranks or not, as
    training/axes/pipeline/runtime.py runs them."""
    if strategy.family == "fsdp" and (strategy.fsdp_version != 2 or strategy.offloads or strategy.replicas > 1):
        return False
    held_by = wrapper(strategy.family, strategy.zero_stage)
    tensor = strategy.tp_size == 1 or composes_with("tp", "pp", held_by)  # the plan inside each stage
    return (composes("pp", held_by) and tensor and strategy.pp_stages_per_rank == 1
            and strategy.pp_schedule in PIPELINE_SCHEDULES)  # fmt: skip


def pipeline_stages(config: ShardGPTConfig, strategy: Strategy, precision: str, micro_batch: int, seq_len: int,
                    micro_batches: int, checkpointing: bool = False, decay_embeddings: bool = False,
                    cpu_ranks: bool = False) -> list[dict]:  # fmt: skip
    """Bytes one rank of each pipeline stage needs, by category as `predict`'s, for a pipeline of
    `strategy.pp_size` stages, one per rank, under GPipe or 1F1B (`strategy.pp_schedule`), `micro_batches` a step.

    Model states as training/axes/pipeline/runtime.py keeps them: a stage's parameters (under tensor parallelism its
    slices: 1/tp of each decoder matrix and of the embedding's and head's vocabulary rows, the norms whole) on each
    of its ranks, with one
    all-reduce of a flat copy of its gradients where pipelines run side by side (ddp-pp: no DDP reducer, so no
    buckets), or FSDP2-sharded over the stage's data-parallel ranks (fsdp-pp: FSDP's shards, units and prefetch,
    the stage's embedding, norm and head its root unit). Activations: `stage_held`. Besides, torch's PipelineStage
    allocates at its first step one receive buffer per micro batch for the activations (every stage but the
    first) and one for their gradients (every stage but the last), micro x T x h each, a tp-th under tensor
    parallelism (`_prepare_forward_infra`, torch 2.13; from its source, not measured); the in-flight micro batches'
    saved layer inputs are those buffers in fp32, counted twice here (4h of a layer's tens of h per token).
    """
    pp, schedule = strategy.pp_size, strategy.pp_schedule
    sharded = strategy.family == "fsdp"
    if not models_pipeline(strategy):
        raise ValueError(
            f"the planner does not model {strategy.name} ({schedule}): it plans pipelines of one stage per rank "
            f"under {' or '.join(PIPELINE_SCHEDULES)}, each stage one process, DDP or FSDP2 (single-pp, ddp-pp, "
            "fsdp-pp, fsdp-shard-grad-op-pp, each with -tpN)"
        )
    if precision not in BYTES or micro_batch < 1 or seq_len < 1:
        raise ValueError(f"precision {precision!r} (one of {', '.join(BYTES)}), micro_batch and seq_len at least 1")
    check_pipeline(schedule, pp, 1, micro_batches, config.num_hidden_layers)
    e, tp = BYTES[precision], strategy.tp_size
    hidden = e if sharded else 4  # FSDP2's bf16 parameters compute in bf16; autocast keeps the residual stream fp32
    whole = layout(config, decay_embeddings)
    sliced = layout(config, decay_embeddings, tp) if tp > 1 else whole  # a rank's slices
    tokens, h = micro_batch * seq_len, config.hidden_size
    stages = []
    for stage in range(pp):
        lay = stage_layout(sliced, pp, stage)
        # the first stage looks the tokens up: under tensor parallelism its embedding's gradient comes back whole
        whole_rows = embedding_gradient_rows(config, lay, tp) if stage == 0 else 0
        states, temps = stage_states(lay, strategy, precision, cpu_ranks, whole_rows)
        boundaries = (stage > 0) + (stage < pp - 1)
        shard = tokens * h // tp  # under tensor parallelism a rank receives its sequence shard
        temps.append(Item("buffers", "pipeline_receive_buffers", boundaries * micro_batches * shard * hidden))
        activations, loss = stage_held(config, micro_batch, seq_len, e, checkpointing, schedule, pp, micro_batches,
                                       stage, hidden, tp)  # fmt: skip
        gpu = bytes_by_category(states)
        row = {
            "params": gpu["params"],
            "grads": gpu["grads"],
            "optimizer_states": gpu["master_params"] + gpu["optimizer_states"],
            "activations": activations,
            "logits": loss + (loss_chunk_bytes(config, micro_batch, seq_len, e, tp) if stage == pp - 1 else 0),
            "temporary": sum(it.nbytes for it in temps),
            "held_for_backward": activations + loss,
        }
        row["model_states"] = row["params"] + row["grads"] + row["optimizer_states"]
        row["total"] = row["model_states"] + row["activations"] + row["logits"] + row["temporary"]
        # Every rank builds the whole model from the seed before it keeps its stage (training/axes/pipeline/runtime.py).
        row.update(host_ram=0, host_ram_at_start=4 * whole.psi, nvme=0)
        row["detail"] = {f"{it.where}:{it.category}.{it.label}": it.nbytes for it in states + temps if it.nbytes}
        row["inputs"] = dict(
            strategy=strategy.name, world_size=strategy.world_size, precision=precision, micro_batch=micro_batch,
            seq_len=seq_len, activation_checkpointing=checkpointing, psi=whole.psi, tensor_parallel_size=tp,
            pipeline_schedule=schedule, micro_batches=micro_batches, stage=stage, stage_psi=lay.psi,
            layers=list(stage_layers(config.num_hidden_layers, pp, stage)),
            micro_batches_in_flight=in_flight(schedule, pp, micro_batches, stage),
        )  # fmt: skip
        stages.append(row)
    return stages


def embedding_gradient_rows(config: ShardGPTConfig, lay: Layout, tp: int) -> int:
    """Elements of the embedding's gradient a tensor-parallel rank holds beyond its vocabulary rows while a pipeline's
    schedule runs: torch's DTensor has no row-wise strategy for the embedding's backward (`embedding_dense_backward`:
    replicated, column-wise or partial, torch 2.11 and 2.13), so the vocabulary-parallel embedding's gradient comes
    back whole on each rank and is cut to its rows once a step, after the schedule
    (training/axes/pipeline/runtime.settle_split_gradients); under FSDP2 it is accumulated whole. Measured to the byte
    (tests/training/test_pipeline.py, FSDP2 x TP x PP)."""
    if tp == 1 or "model.embed_tokens.weight" not in lay.names:
        return 0
    rows = lay.numels[lay.names.index("model.embed_tokens.weight")]
    return config.vocab_size * config.hidden_size - rows


def stage_states(lay: Layout, strategy: Strategy, precision: str, cpu_ranks: bool,
                 whole_rows: int = 0) -> tuple[list[Item], list[Item]]:  # fmt: skip
    """One rank's model states of the stage `lay` holds, and its temporaries: FSDP2's over the stage's
    data-parallel ranks, or the stage whole (fp32 weights, gradients and AdamW; autocast's weight copies in bf16; the
    flat copy of the gradients that their all-reduce over the data-parallel ranks averages). On CPU ranks, unfused
    AdamW's two fp32 temporaries of the largest tensor it steps. `whole_rows`: the embedding's gradient elements a
    tensor-parallel rank holds beyond its own rows while the schedule runs (`embedding_gradient_rows`), in fp32.

    Under FSDP2, torch's pipelining turns the gradient sync and the resharding after each backward off until the
    step's last backward (pipelining/stage.py: `backward_maybe_with_nosync`, then `perform_reduce_grad`): by then every
    unit of the stage is gathered, and its gradients are accumulated whole in the reduce dtype (FSDP2's
    `unsharded_accumulated_grad`; fp32 in this project's policy, training/core/fsdp.fsdp_precision), until
    the reduce-scatters after the last backward."""
    dp, e = strategy.data_parallel_size, BYTES[precision]
    if strategy.family == "fsdp":
        states = max((fsdp_states(lay, dp, r, offload=False) for r in ranks_to_check(strategy, dp)),
                     key=lambda items: sum(it.nbytes for it in items))  # fmt: skip
        temps = gathered_stage(lay.psi, e, whole_rows)
        if cpu_ranks:
            temps.append(adam_temporaries(lay, strategy, dp, None, e))
        return states, temps
    states = [Item("params", "weights", 4 * lay.psi), Item("grads", "param.grad", 4 * lay.psi)]
    adam(states, lay.psi, len(lay.numels), "gpu")
    temps = [Item("buffers", "autocast_weight_copies", e * lay.psi if precision != "fp32" else 0),
             Item("buffers", "gradient_all_reduce", 4 * lay.psi if dp > 1 else 0),
             Item("buffers", "adam_temporaries", 8 * max(lay.numels) if cpu_ranks else 0),
             Item("buffers", "embedding_gradient_whole", 4 * whole_rows)]  # fmt: skip
    return states, temps


def gathered_stage(psi: int, e: int, whole_rows: int = 0) -> list[Item]:
    """What an FSDP2 pipeline stage of `psi` parameters holds whole by its last backward (`stage_states`): its
    parameters in the compute dtype (`e` bytes) and its gradients accumulated in fp32, the reduce dtype, the
    embedding's whole under tensor parallelism (`whole_rows` more: `embedding_gradient_rows`)."""
    return [Item("buffers", "unsharded_params", e * psi),
            Item("buffers", "unsharded_accumulated_grads", 4 * (psi + whole_rows))]  # fmt: skip
