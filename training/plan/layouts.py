"""Every layout of a run on a cluster, enumerated and ranked: the degrees that divide the GPUs, the micro batches
that make the global batch, the memory each layout needs at its peak (`Memory`), and the step time of those that
fit (`plan`); Llama configs read from their published config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

from model import ShardGPTConfig
from training.mesh import Mesh
from training.plan.communication import ModelShape
from training.plan.hardware import Cluster
from training.plan.memory.activations import (
    activation_bytes,
    layer_activation_bytes,
    logits_bytes,
    selective_layer_bytes,
    whole_logits_bytes,
)
from training.plan.memory.layout import repo_json
from training.plan.memory.planner import predict, zero_paper
from training.plan.memory.stages import PIPELINE_SCHEDULES, gathered_stage, in_flight, interleaved_in_flight
from training.plan.ring import ACTIVATION_BYTES
from training.plan.step_compute import model_flops_per_token, rank_shape
from training.plan.step_layout import (
    DP_STRATEGIES,
    MICRO_BATCHES,
    WITH_PIPELINE,
    WITH_SEQUENCE_PARALLEL,
    WITH_TENSOR_PARALLEL,
    Layout,
)
from training.plan.step_time import predict_step
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- memory


class Memory:
    """Bytes one GPU of a layout needs at its peak, the memory planner's (`training/plan/memory/planner.predict`) where
    it models the layout (data parallelism with Ulysses, AutoTP under ZeRO-1, FSDP2 x TP, DDP's and FSDP2's
    pipelines, tensor parallelism inside their stages); otherwise
    its pieces composed: the ZeRO paper's model states of the rank's slice (`zero_paper`), the activations of the
    micro batches a stage holds (`layer_activation_bytes`, `in_flight`) and the chunked loss's logits."""

    def __init__(self, config: ShardGPTConfig, seq_len: int):
        self.config, self.seq_len = config, seq_len
        self.cache: dict[Layout, tuple[float, str]] = {}
        self.planned: dict[tuple, float] = {}

    def __call__(self, layout: Layout) -> tuple[float, str]:
        """(bytes, "planner" or "composed")."""
        if layout not in self.cache:
            self.cache[layout] = self._predict(layout)
        return self.cache[layout]

    def _predict(self, layout: Layout) -> tuple[float, str]:
        c, world = self.config, layout.world
        strategy = Strategy.from_name(layout.strategy, world).with_degrees(sp=layout.sp)
        ds = None
        if layout.tp > 1 and layout.sharding == "zero1" and layout.pp == 1 and layout.runs_here:
            strategy, ds = strategy.with_degrees(tp=layout.tp), repo_json(Strategy.from_name("zero1-autotp", 2))
            ds["tensor_parallel"]["autotp_size"] = layout.tp
        if layout.tp > 1 and layout.sharding in ("ddp", "fsdp") and layout.runs_here:  # FSDP2 x TP (SP); in stages
            strategy = strategy.with_degrees(tp=layout.tp)
        planned = layout.tp == 1 and layout.pp == 1 or ds is not None or strategy.tp_size > 1
        planned |= layout.pp > 1 and layout.tp == 1 and layout.sharding in ("ddp", "fsdp")
        planned &= not layout.selective  # the memory planner plans the script's recomputation: all or none
        if layout.pp > 1:
            strategy = replace(strategy.with_degrees(pp=layout.pp), pp_schedule=layout.memory_schedule)
        if planned:  # the memory planner's figure, shared by the layouts it cannot tell apart (interleavings)
            key = (strategy, layout.micro_batch, layout.checkpointing, layout.micro_batches, ds is not None)
            if key not in self.planned:
                try:
                    row = predict(c, strategy, "bf16", layout.micro_batch, self.seq_len, layout.checkpointing,
                                  ds_config=ds, micro_batches=layout.micro_batches)  # fmt: skip
                    self.planned[key] = float(row["total"])
                except ValueError:  # a pipeline torch's schedules refuse (1F1B with M < P, uneven layers)
                    self.planned[key] = math.inf
            return self.planned[key], "planner"
        shape = rank_shape(c, layout)
        stage = {"ddp": 0, "fsdp": 3}.get(layout.sharding) or layout.typed.zero_stage
        states = zero_paper(shape.parameters, layout.dp, stage, "bf16")
        e, tokens = ACTIVATION_BYTES, layout.micro_batch * self.seq_len // layout.sp
        # torch's DTensor pipelines (this project's, torchtitan's) hold the first stage's embedding gradient whole on
        # each tensor-parallel rank until the schedule ends (the memory planner's `embedding_gradient_rows`), in fp32
        whole_rows = 0
        if layout.pp > 1 and layout.tp > 1 and layout.stack == "shardgpt":
            whole_rows = c.vocab_size * c.hidden_size - c.vocab_size * c.hidden_size // layout.tp
        # FSDP2 under a pipeline: the stage gathered whole by the last backward, its gradients accumulated whole
        # (the memory planner's stages); without one, keeping units gathered (SHARD_GRAD_OP) holds the parameters whole
        if layout.sharding == "fsdp" and layout.pp > 1:
            states += sum(item.nbytes for item in gathered_stage(shape.parameters, e, whole_rows))
        else:
            states += 4 * whole_rows
        if layout.pp == 1 and layout.typed.fsdp_sharding == "SHARD_GRAD_OP":
            states += e * shape.parameters
        layers, tp, sequence = layout.stage_layers(c), layout.tp, layout.sequence_parallel
        # Megatron-LM and this project gather the column-split inputs again in the backward; a compiled layer of this
        # project keeps torch's styles' layout, the gathered inputs whole
        gathered = layout.stack == "shardgpt" and layout.compiled
        if layout.pp == 1 and not layout.selective:
            activations = activation_bytes(c, layout.micro_batch, self.seq_len, e, layout.checkpointing, tp,
                                           sequence_parallel=sequence, gathered=gathered)  # fmt: skip
        else:
            layer = layer_activation_bytes(c, e, tp, sequence, gathered)
            per_layer = e * c.hidden_size // (tp if sequence else 1) if layout.checkpointing else layer
            per_layer = selective_layer_bytes(c, e, tp, sequence) if layout.selective else per_layer
            held = in_flight(layout.memory_schedule, layout.pp, layout.micro_batches, 0) if layout.pp > 1 else 1
            # Interleaving: the first rank holds its warm-up's stage-micro-batches and one more, each a v-th of its
            # layers (up to 1 + (P - 1) / (P v) times 1F1B's, Korthikanti et al. 2022, section 4.2.3; with as few
            # micro batches as ranks, every one of them: torch's and Megatron-Core's schedules)
            if layout.virtual_stages > 1:
                v = layout.virtual_stages
                held = interleaved_in_flight(layout.pp, v, layout.micro_batches, 0) / v
            activations = held * layers * per_layer * tokens
            activations += layer * tokens if layout.checkpointing else 0
        # the chunked loss's largest moment, or the whole logits where a run's loss takes them at once (torchtitan's:
        # bf16 logits upcast whole, eager in 2024, compiled from April 2025), a tp-th of the vocabulary each
        if layout.whole_loss:
            loss = whole_logits_bytes(c, layout.micro_batch, self.seq_len, e, layout.compiled_loss)
        else:
            loss = logits_bytes(c, layout.micro_batch, self.seq_len, e)
        return states + activations + loss / tp, "composed"


# ---------------------------------------------------------------------------------------------- enumeration


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_options(config: ShardGPTConfig, num_gpus: int, gpus_per_node: int, seq_len: int,
                   fixed: dict[str, int | None]) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """(tp, pp, sp, dp) with tp x pp x sp x dp = num_gpus: tp within a node and dividing the heads and key-value
    heads, pp dividing the layers, sp dividing the heads and the sequence and a multiple or divisor of the key-value
    heads (Ulysses, as training/axes/ulysses.py checks); `fixed` pins any of them."""
    heads, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    out = []
    for tp in divisors(num_gpus):
        if tp > gpus_per_node or heads % tp or kv % tp:
            continue
        for pp in divisors(num_gpus // tp):
            if pp > layers:  # stages of unequal layers too: Megatron-LM's and Llama 3's runs split them so
                continue
            for sp in divisors(num_gpus // (tp * pp)):
                if sp > 1 and (
                    tp > 1 or pp > 1 or heads % sp or kv % sp and sp % kv or seq_len % sp or sp > gpus_per_node
                ):
                    continue
                dp = num_gpus // (tp * pp * sp)
                degrees = dict(tp=tp, pp=pp, sp=sp, dp=dp)
                if all(fixed.get(k) in (None, v) for k, v in degrees.items()):
                    out.append((tp, pp, sp, dp))
    return out


# The planner's flags for the mesh's axes (recipes/plan_memory.py --step_time): its errors name them.
PLANNER_FLAGS = {"pp": "--pipeline_parallel_degree", "dp_replicate": "--data_parallel_degree",
                 "sp": "--sequence_parallel_degree", "tp": "--tensor_parallel_degree"}  # fmt: skip


def check_degrees(num_gpus: int, fixed: dict[str, int | None]) -> None:
    """Refuse, in one line, explicit degrees that cannot make `num_gpus`: the mesh's one divisibility check
    (`Mesh.of_world`), then, with every degree given, that they multiply to the GPU count."""
    given = {k: v for k, v in fixed.items() if v is not None}
    if any(v < 1 for v in given.values()):
        raise ValueError(f"degrees must be at least 1: {given}")
    degrees = {"pp": given.get("pp", 1), "sp": given.get("sp", 1), "tp": given.get("tp", 1)}
    mesh = Mesh.of_world(num_gpus, **degrees, replicas=given.get("dp", 1), flags=PLANNER_FLAGS, unit="GPUs")
    if len(given) == 4 and mesh.dp_shard != 1:
        spelled = " x ".join(f"{PLANNER_FLAGS['dp_replicate' if k == 'dp' else k]} {v}" for k, v in given.items())
        raise ValueError(
            f"{spelled} = {math.prod(given.values())} do not multiply to the {num_gpus} GPUs: choose degrees whose "
            "product is the GPU count"
        )


def check_batch(global_batch: int, seq_len: int, options: list[tuple[int, int, int, int]], micro: int | None) -> None:
    """Refuse, in one line, a global batch that no layout's data-parallel ranks (x the pinned micro batch) divide."""
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global batch {global_batch} sequences of {seq_len} tokens: both must be at least 1")
    shares = sorted({dp * (micro or 1) for *_, dp in options})
    if not any(global_batch % share == 0 for share in shares):
        per = " x micro batch" if micro else ""
        raise ValueError(
            f"global batch {global_batch} sequences does not divide over data-parallel ranks{per} "
            f"({', '.join(map(str, shares))}): choose a multiple of one of them"
        )


def schedules(config: ShardGPTConfig, pp: int, pinned: int | None) -> list[tuple[str, int]]:
    """The pipeline schedules tried at `pp` stages, with the stages each rank holds: GPipe and 1F1B, and interleaved
    1F1B at every number of stages a rank up to a layer a stage (or the one `pinned`); `layouts` keeps the uneven
    splits for the runtimes that run them (Megatron-LM's, Llama 3's)."""
    if pp == 1:
        return [("1F1B", 1)]
    found = list(range(2, config.num_hidden_layers // pp + 1))
    if pinned is not None:
        found = [pinned] if pinned > 1 else []
    return [(s, 1) for s in PIPELINE_SCHEDULES if not pinned or pinned == 1] + [("Interleaved1F1B", v) for v in found]


def runtimes(lay: Layout) -> list[Layout]:
    """The layout under the runtimes that run it: this project's where it runs here (and, for FSDP2 x TP,
    torchtitan's with Megatron's sequence parallelism beside it); DDP and ZeRO-1 (Megatron's distributed optimizer)
    without Ulysses under Megatron-Core's too, with sequence parallelism under tensor
    parallelism (STACKS). Options this project's runtime lacks make a layout not run here."""
    tensor = lay.tp > 1
    # this project's runtime: Megatron's sequence parallelism wherever torch's DTensor plan splits the layers
    lay = replace(lay, tp_overlap=lay.tp_overlap and tensor, sequence_parallel=tensor and lay.dtensor_parallel)
    megatron = replace(lay, stack="megatron-core", sequence_parallel=tensor)
    if lay.strategy in ("ddp", "zero1") and lay.sp == 1:
        here = replace(lay, tp_overlap=False, fp8=False).runs_here
        return [lay, megatron] if here else [megatron]
    both = [replace(lay, sequence_parallel=False), replace(lay, sequence_parallel=True)]
    return both if tensor and lay.sharding == "fsdp" else [lay]


def layouts(config: ShardGPTConfig, cluster: Cluster, global_batch: int, seq_len: int,
            fixed: dict | None = None, any_layout: bool = False) -> list[Layout]:  # fmt: skip
    """Every layout of the cluster for `global_batch` sequences a step (before the memory check) that recipes/train.py
    runs (`Layout.runs_here`), or with `any_layout` Megatron-LM's too. `fixed`: any of tp, pp, sp, dp (degrees),
    strategy, schedule, micro_batch, checkpointing pinned to a value."""
    fixed = fixed or {}
    flags = {k: bool(fixed.get(k)) for k in ("tp_overlap", "fp8", "compiled", "whole_loss", "compiled_loss")}
    degrees = {k: fixed.get(k) for k in ("tp", "pp", "sp", "dp")}
    check_degrees(cluster.num_gpus, degrees)
    options = degree_options(config, cluster.num_gpus, cluster.gpus_per_node, seq_len, degrees)
    if not options:
        raise ValueError(f"no layout of {cluster.num_gpus} GPUs has the degrees {degrees} for this model's "
                         f"{config.num_attention_heads} heads and {config.num_hidden_layers} layers")  # fmt: skip
    check_batch(global_batch, seq_len, options, fixed.get("micro_batch"))
    micros = (fixed["micro_batch"],) if fixed.get("micro_batch") else MICRO_BATCHES  # a pinned one, listed or not
    out = []
    for tp, pp, sp, dp in options:
        if global_batch % dp:
            continue
        names = WITH_PIPELINE if pp > 1 else WITH_TENSOR_PARALLEL if tp > 1 else DP_STRATEGIES
        if sp > 1:
            names = [n for n in names if n in WITH_SEQUENCE_PARALLEL]
        if tp > 1 and pp > 1:
            names = [n for n in names if n in WITH_TENSOR_PARALLEL]
        for name in names:
            for schedule, v in schedules(config, pp, fixed.get("virtual_stages")):
                for micro in micros:
                    if (global_batch // dp) % micro:
                        continue
                    m = global_batch // dp // micro
                    even = config.num_hidden_layers % (pp * v) == 0
                    if v > 1 and (m % pp or pp * v > config.num_hidden_layers):
                        continue  # interleaving takes micro batches in rounds of P (torch's and Megatron-LM's)
                    for checkpointing, selective in ((False, False), (False, True), (True, False)):
                        lay = Layout(name, dp, tp, pp, sp, schedule, micro, m, checkpointing, v, **flags,
                                     selective=selective)  # fmt: skip
                        for variant in runtimes(lay):
                            if even or not variant.runs_here:  # recipes/train.py splits the layers evenly
                                out.append(variant)
    pins = ("strategy", "schedule", "micro_batch", "checkpointing", "virtual_stages", "selective", "stack",
            "sequence_parallel")  # fmt: skip
    pinned = {k: v for k, v in fixed.items() if k in pins}
    out = [lay for lay in out if all(getattr(lay, k) == v for k, v in pinned.items() if v is not None)]
    here = [lay for lay in out if lay.runs_here]
    if out and not here and not any_layout:
        pins = ", ".join(f"{k} {v}" for k, v in fixed.items() if v is not None and v is not False)
        raise ValueError(
            f"no layout with {pins} runs in recipes/train.py (tensor parallelism as AutoTP under ZeRO or under "
            "FSDP2, a pipeline only under DDP or FSDP2 on stages of equal layers with tensor parallelism inside its "
            "stages, Ulysses only under ZeRO; without Megatron's sequence parallelism, TP overlap or fp8): pin "
            "another, or pass --any_layout to predict Megatron-LM's and torchtitan's layouts too"
        )
    return out if any_layout else here


def plan(config: ShardGPTConfig, cluster: Cluster, global_batch: int, seq_len: int, fixed: dict | None = None,
         any_layout: bool = False, attn_implementation: str = "sdpa") -> dict:  # fmt: skip
    """Every layout recipes/train.py runs (with `any_layout`, Megatron-LM's too) that fits the cluster's GPU memory,
    predicted and ranked by tokens/s (fastest first), each saying whether the script runs it (`runs_here`), with the
    inputs; `rejected` counts those that do not fit."""
    memory = Memory(config, seq_len)
    rows, rejected = [], 0
    smallest_too_large: dict[Layout, int] = {}  # memory grows with the micro batch: past one that does not fit, skip
    for lay in layouts(config, cluster, global_batch, seq_len, fixed, any_layout):
        key = replace(lay, micro_batch=0, micro_batches=0)
        if lay.micro_batch > smallest_too_large.get(key, math.inf):
            rejected += 1
            continue
        needed, source = memory(lay)
        if needed > cluster.memory_bytes:
            smallest_too_large[key] = min(lay.micro_batch, smallest_too_large.get(key, math.inf))
            rejected += 1
            continue
        row = predict_step(config, cluster, lay, seq_len, attn_implementation)
        row.update(memory_gib=needed / 2**30, memory_source=source, runs_here=lay.runs_here)
        rows.append(row)
    rows.sort(key=lambda r: (-r["tokens_per_second"], r["memory_gib"]))  # ties: the one that needs less memory
    inputs = dict(cluster=dataclasses.asdict(cluster), global_batch=global_batch, seq_len=seq_len,
                  any_layout=any_layout, attn_implementation=attn_implementation,
                  parameters=ModelShape.of(config).parameters,
                  model_flops_per_token=model_flops_per_token(config, seq_len))  # fmt: skip
    return {"inputs": inputs, "layouts": rows, "rejected_for_memory": rejected}


LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
)  # fmt: skip


def llama_config(path: str, **overrides) -> ShardGPTConfig:
    """A Llama config.json (transformers' LlamaConfig fields; model/configs/ holds Llama 3's) as this project's
    model, any field replaced by `overrides`."""
    with open(path) as f:
        fields = {**json.load(f), **overrides}
    missing = [k for k in LLAMA_FIELDS[:5] if k not in fields]
    if missing:
        raise ValueError(f"{path} is not a Llama config.json: it lacks {', '.join(missing)}")
    heads = fields["num_attention_heads"]
    if fields.get("head_dim", fields["hidden_size"] // heads) * heads != fields["hidden_size"]:
        raise ValueError(f"{path}: head_dim x num_attention_heads must equal hidden_size in this project's model")
    return ShardGPTConfig(**{k: fields[k] for k in LLAMA_FIELDS if k in fields})
