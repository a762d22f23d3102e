"""The planner's model: the memory one rank needs to train shardgpt under each strategy, before any GPU is rented.

Per rank: parameters, gradients, optimizer states (fp32 master copies and Adam's moments), activations, logits
and temporary buffers; for offload, host RAM and NVMe. `predict()` returns them as a dict; `recipes/plan_memory.py`
prints them.

Model states (parameters, gradients, optimizer states) are counted exactly as DDP, FSDP2 and DeepSpeed 0.19
allocate them for this model, tensor by tensor: DeepSpeed's flat buffers and their alignment, the ZeRO-1/2
gradient partition that holds every gradient touching a rank's partition whole, ZeRO-3's persistent small
parameters, FSDP2's padded shards, DDP's gradient buckets, Adam's step counters. `training/measure/ledger.py`
counts the same on 2 CPU ranks, and `tests/recipes/test_memory.py` checks that both agree to the byte.
Activations, logits and temporaries follow the formulas in docs/memory.md.

`predict` composes the parts: the model's layout on a rank and each strategy's DeepSpeed config (`layout.py`),
the model states (`states.py`), the activations and temporaries (`activations.py`) and a pipeline's stages
(`stages.py`).

Tensor parallelism (DeepSpeed AutoTP, `zero1-autotp`): every module of the model's tp plan holds 1/tp of its
weight on each rank (q, k, v, gate, up and the vocabulary-parallel embedding and tied head by rows, o and down by
columns), the norms stay whole; ZeRO-1 then partitions that local model over the world / tp data-parallel ranks.
Under FSDP2 x TP (a YAML's parallelism_config, training/axes/tensor/plan.py) the modules split the same way, the
norms whole, and the chunked loss runs over the vocabulary shards; FSDP2 shards each rank's slice on its dim 0 over
the data-parallel ranks; Megatron's sequence parallelism keeps every saved tensor of a layer on sequence shards.
"""

from __future__ import annotations

import math

from model import ShardGPTConfig
from training.mesh import Mesh
from training.plan.memory.activations import (
    activation_bytes,
    adam_temporaries,
    logits_bytes,
    temporaries,
    whole_logits_bytes,
)
from training.plan.memory.layout import (
    BYTES,
    STRATEGIES,
    layout,
    offload_device,
    ranks_to_check,
    zero_config,
)
from training.plan.memory.stages import pipeline_stages
from training.plan.memory.states import bytes_by_category, model_states
from training.strategy import Strategy

# ---------------------------------------------------------------------------------------------- prediction


def predict(config: ShardGPTConfig, strategy: Strategy, precision: str = "bf16", micro_batch: int = 1,
            seq_len: int = 2048, activation_checkpointing: bool = False, ds_config: dict | None = None,
            rank: int | None = None, decay_embeddings: bool = False,
            bf16_gradient_reduction: bool = False, cpu_ranks: bool = False,
            micro_batches: int = 1, optim: str = "adamw_torch") -> dict:  # fmt: skip
    """Bytes one GPU needs, by category, for `strategy` on its `world_size` GPUs.

    Returns params, grads, optimizer_states (fp32 master copies + Adam), activations, logits, temporary and
    total on the GPU; model_states (params + grads + optimizer_states on the GPU); host_ram and nvme per GPU
    (offload); detail (every item, by label and place) and the inputs. `rank`: one rank's figures (ZeRO-1/2
    and FSDP differ slightly between ranks); default the largest over ranks. `ds_config`: a DeepSpeed JSON
    (dict) instead of the repo's ds_configs/ file for the strategy. `cpu_ranks`: the ranks are CPU processes, as
    in the test suite (torch's unfused AdamW steps there, and the repo's JSONs have their buckets capped, as
    training caps them: `training/deepspeed_config.py`'s CPU_BUCKETS).

    A pipeline (`strategy.pp_size` > 1, GPipe or 1F1B, `micro_batches` per step: --gradient_accumulation_steps)
    is planned stage by stage (`pipeline_stages`): the figures of its largest stage, and every stage's in "stages".
    """
    world_size = strategy.world_size
    if strategy.pp_size > 1:
        stages = pipeline_stages(config, strategy, precision, micro_batch, seq_len, micro_batches,
                                 activation_checkpointing, decay_embeddings, cpu_ranks)  # fmt: skip
        return {**max(stages, key=lambda stage: stage["total"]), "stages": stages}
    sp, asked = strategy.sp_size, strategy.name  # Ulysses: ZeRO partitions over every rank, each holds T / sp
    strategy = strategy.with_degrees(sp=1)
    dtensor = strategy.family == "fsdp" and strategy.tp_size > 1  # FSDP2 x TP: the chunked loss over vocabulary shards
    # Hybrid FSDP2 (replicas of a copy sharded over shard_size ranks; DDP x TP is its shard size of 1): each rank holds
    # what FSDP2 over its copy's ranks holds, the replicas' all-reduce running in place on the reduce-scattered shard.
    hybrid = strategy.family == "fsdp" and strategy.replicas > 1 and strategy.fsdp_version == 2
    hybrid &= strategy.fsdp_sharding == "FULL_SHARD" and not strategy.offloads
    if not hybrid and (strategy.with_degrees(tp=1) if dtensor else strategy).name not in STRATEGIES:
        known = ", ".join(STRATEGIES)
        raise ValueError(f"the planner does not model {strategy.name}; choose one of {known}, hybrid FSDP2, or all")
    if seq_len % sp:
        raise ValueError(f"seq_len {seq_len} is not divisible by sequence-parallel size {sp}")
    if precision not in BYTES:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(BYTES)}")
    if world_size < 1 or micro_batch < 1 or seq_len < 1:
        raise ValueError("world_size, micro_batch and seq_len must be at least 1")
    tp = strategy.tp_size
    Mesh.of_world(world_size, tp=tp)  # refuses a tensor-parallel size that does not divide the ranks
    whole, lay = layout(config, decay_embeddings), layout(config, decay_embeddings, tp, optim)
    # ZeRO and the optimizer see one tensor-parallel slice over the data-parallel ranks; FSDP2 shards it over a copy's
    dp = strategy.shard_size if strategy.family == "fsdp" else world_size // tp
    zero = None
    if strategy.family == "deepspeed":
        zero = zero_config(strategy, config, dp, precision, micro_batch, ds_config, bf16_gradient_reduction, cpu_ranks)
    ranks = [rank // tp] if rank is not None else ranks_to_check(strategy, dp)
    states = max((model_states(lay, strategy, dp, r, precision, zero) for r in ranks),
                 key=lambda items: sum(it.nbytes for it in items if it.where == "gpu"))  # fmt: skip
    temps = temporaries(lay, strategy, dp, precision, zero)
    if cpu_ranks:  # torch's unfused AdamW
        temps.append(adam_temporaries(lay, strategy, dp, zero, BYTES[precision]))
    e = BYTES[precision]
    gpu = bytes_by_category(states)
    out = {
        "params": gpu["params"],
        "grads": gpu["grads"],
        "optimizer_states": gpu["master_params"] + gpu["optimizer_states"],
        "activations": activation_bytes(
            config, micro_batch, seq_len, e, activation_checkpointing, tp, sp, sequence_parallel=dtensor
        ),
        "logits": logits_bytes(config, micro_batch, seq_len // sp, e, tp if dtensor else 1)
        if tp == 1 or dtensor
        else whole_logits_bytes(config, micro_batch, seq_len, e),
        "temporary": sum(it.nbytes for it in temps if it.where == "gpu"),
    }
    out["model_states"] = out["params"] + out["grads"] + out["optimizer_states"]
    out["total"] = out["model_states"] + out["activations"] + out["logits"] + out["temporary"]
    out["host_ram"] = sum(it.nbytes for it in states + temps if it.where == "host")
    # Under DDP and ZeRO-1/2 every rank builds the model in fp32 in host RAM before `accelerator.prepare` moves
    # it. Under ZeRO-3 (inside zero.Init) and FSDP2 (on the meta device, then sharded and initialised one tensor
    # at a time) a rank holds its partition and the one module or tensor being built (training/core/build.py).
    # Under FSDP2 x TP every rank builds the whole model before it keeps its slices (training/axes/tensor/plan.py).
    partitioned = strategy.zero_stage == 3 or strategy.family == "fsdp" and not dtensor
    out["host_ram_at_start"] = 4 * (
        math.ceil(whole.psi / world_size) + whole.largest_module if partitioned else whole.psi
    )
    if strategy.zero_stage == 3 and offload_device(zero, "offload_param") == "nvme":
        # zero.Init swaps each partition out to NVMe as soon as it is built: the host keeps the parameter swap
        # buffers, the max_in_cpu share and the module being built.
        kept = ("partitions_in_cpu", "param_swap_buffers")
        out["host_ram_at_start"] = 4 * whole.largest_module + sum(
            it.nbytes for it in states + temps if it.label in kept
        )
    out["nvme"] = sum(it.nbytes for it in states + temps if it.where == "nvme")
    out["detail"] = {f"{it.where}:{it.category}.{it.label}": it.nbytes for it in states + temps if it.nbytes}
    out["inputs"] = dict(strategy=asked, world_size=world_size, precision=precision, micro_batch=micro_batch,
                         seq_len=seq_len, activation_checkpointing=activation_checkpointing, psi=whole.psi,
                         tensor_parallel_size=tp, sequence_parallel_size=sp)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- ZeRO paper


def zero_paper(psi: int, world: int, stage: int, precision: str) -> int:
    """Model-state bytes per rank in the ZeRO paper (Rajbhandari et al. 2020, section 5), stage 0 = DDP.

    Mixed precision Adam (K = 12: fp32 master weights, momentum, variance; 2-byte weights and gradients):
      baseline 16 psi, ZeRO-1 4 psi + 12 psi/Nd, ZeRO-2 2 psi + 14 psi/Nd, ZeRO-3 16 psi/Nd.
    fp32 (4-byte weights and gradients, Adam's 8 bytes, no master copy: the weights are fp32 already):
      baseline 16 psi, ZeRO-1 8 psi + 8 psi/Nd, ZeRO-2 4 psi + 12 psi/Nd, ZeRO-3 16 psi/Nd.
    """
    w, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    shard = {0: (w + g + k, 0), 1: (w + g, k), 2: (w, g + k), 3: (0, w + g + k)}[stage]
    return shard[0] * psi + shard[1] * psi / world
