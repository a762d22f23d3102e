"""A layout of a cluster for the step-time planner (training/plan/step_time.py): a data-parallel strategy and the
degrees of tensor, sequence and pipeline parallelism whose product is the GPU count, with the options a runtime runs
it with; which of them recipes/train.py runs, read from the axes table (training/axes/table.py), and whose runtime
runs the rest (`STACKS`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from model import ShardGPTConfig
from training.axes.table import AXES, composes, composes_with, wrapper
from training.strategy import Strategy

# The data-parallel strategies a layout can use, by `Strategy.name`, and each one's wrapper (training/axes/table.py).
# fsdp-shard-grad-op: FSDP2 keeping each unit gathered from its forward to its backward (reshard_after_forward=False),
# a gather a micro batch where full sharding gathers twice (what torchtitan runs under a pipeline).
DP_STRATEGIES = ("ddp", "fsdp", "fsdp-shard-grad-op", "zero1", "zero2", "zero3", "zero2-offload-cpu",
                 "zero3-offload-cpu")  # fmt: skip
WRAPPER = {name: wrapper(s.family, s.zero_stage) for name in DP_STRATEGIES for s in [Strategy.from_name(name)]}
# The axes table's compositions: what recipes/train.py runs, and what published runs used beside it (Megatron-LM's
# DDP, DeepSpeed's ZeRO-1 under its pipeline), which `any_layout` adds. Of the DeepSpeed stages AutoTP trains under, the
# planners model ZeRO-1 (the memory planner's `zero1-autotp`). Each axis runs alone here (`Axis.alone`).
PIPELINE_HERE = tuple(n for n in DP_STRATEGIES if composes("pp", WRAPPER[n]))
WITH_PIPELINE = tuple(n for n in DP_STRATEGIES if n in PIPELINE_HERE or n in AXES["pp"].published_under)
ONLOADED = tuple(n for n in DP_STRATEGIES if not Strategy.from_name(n).offloads)
TENSOR_PARALLEL_HERE = tuple(n for n in ONLOADED if composes("tp", WRAPPER[n]))
WITH_TENSOR_PARALLEL = tuple(n for n in DP_STRATEGIES if n in TENSOR_PARALLEL_HERE or n in AXES["tp"].published_under)
TP_WITH_PIPELINE_HERE = tuple(n for n in PIPELINE_HERE if composes_with("tp", "pp", WRAPPER[n]))
WITH_SEQUENCE_PARALLEL = tuple(n for n in DP_STRATEGIES if composes("sp", WRAPPER[n]))
MICRO_BATCHES = (1, 2, 4, 8, 16)  # micro batch sizes tried, in sequences

# Whose runtime runs the layout (STACKS): this project's ("shardgpt": OVERLAP above; under a pipeline the
# data-parallel reduction waits for the flush, training/axes/pipeline/; tensor parallelism with torch's DTensor
# styles or DeepSpeed's AutoTP, which all-reduce each column-split module's input gradient on its own, 7 all-reduces a
# layer, measured: training/plan/communication.dtensor_payloads); Megatron-LM 2021's and BLOOM's Megatron-DeepSpeed
# ("megatron-lm-2021": the same overlap, 4 all-reduces a layer: Shoeybi et al. 2019, section 3); or Megatron-Core's as
# its H100 runs launch it (README, "Training Speed and
# Scalability": `--overlap-grad-reduce --overlap-param-gather`, `--tp-comm-overlap`, pipeline communication
# overlapped): its gradient buckets reduced as they are ready in each stage's last micro batch's backward, the
# distributed optimizer (`zero1` here: a reduce-scatter of the gradients and an all-gather of the updated
# parameters, Megatron-Core's docs/distrib_optimizer.md) gathering them during the next step's first forward, the
# interleaved schedule's sends and receives beside its compute (`overlap_p2p_comm`), its reductions in the gradients'
# bf16 (`DistributedDataParallelConfig.grad_reduce_in_fp32 = False`).
STACKS = ("shardgpt", "megatron-core", "megatron-lm-2021")


@dataclass(frozen=True)
class Layout:
    """One way to lay a step out over the cluster's GPUs."""

    strategy: str  # one of DP_STRATEGIES
    dp: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    schedule: str = "1F1B"  # GPipe, 1F1B or Interleaved1F1B, with pp > 1
    micro_batch: int = 1  # sequences per micro batch per data-parallel rank
    micro_batches: int = 1  # M: micro batches per step (gradient accumulation, or the pipeline's)
    checkpointing: bool = False
    virtual_stages: int = 1  # stages each pipeline rank holds (Interleaved1F1B: 2 or more)
    sequence_parallel: bool = False  # Megatron's: norms and residuals on sequence shards between the tp regions
    stack: str = "shardgpt"  # whose runtime overlaps the communication (STACKS)
    tp_overlap: bool = False  # tensor-parallel collectives overlapped with their GEMMs (TP_OVERLAP)
    fp8: bool = False  # the decoder layers' linear layers in fp8 (FP8)
    compiled: bool = False  # torch.compile fuses the memory-bound kernels (COMPILED_ELEMENTWISE_ACCESSES)
    selective: bool = False  # selective recomputation (selective_recomputed_gemms)
    whole_loss: bool = False  # the loss on the whole (tokens, vocabulary) logits in fp32, not in chunks (memory only)
    compiled_loss: bool = False  # that loss compiled on its own: its logits kept, not their fp32 copies (memory only)

    def stage_layers(self, config: ShardGPTConfig) -> int:
        """Decoder layers on the busiest pipeline rank: its `virtual_stages` stages of an equal share of the layers
        each, rounded up where they do not split evenly."""
        return math.ceil(config.num_hidden_layers / (self.pp * self.virtual_stages)) * self.virtual_stages

    @property
    def memory_schedule(self) -> str:
        """The schedule the memory planner plans: an interleaved one as 1F1B's, which holds as many micro batches in
        flight (Narayanan et al. 2021, section 2.2.2) on as many layers a rank."""
        return "1F1B" if self.virtual_stages > 1 else self.schedule

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def typed(self) -> Strategy:
        """The data-parallel strategy, typed (over the data-parallel ranks)."""
        return Strategy.from_name(self.strategy, self.dp)

    @property
    def sharding(self) -> str:
        """How the strategy shards, as OVERLAP keys it: ddp, fsdp or zero1/2/3 (offloaded or not)."""
        typed = self.typed
        return f"zero{typed.zero_stage}" if typed.family == "deepspeed" else typed.family

    @property
    def runs_here(self) -> bool:
        """Whether recipes/train.py runs this layout (the axes table: PIPELINE_HERE, TENSOR_PARALLEL_HERE,
        TP_WITH_PIPELINE_HERE): with this project's runtime (Megatron's sequence parallelism exactly where torch's
        DTensor plan splits the layers), none of the options it lacks (tensor-parallel overlap, fp8, selective
        recomputation); Megatron-LM's layouts (tensor parallelism with DDP, ZeRO-1 under a pipeline) do not."""
        if self.stack != "shardgpt" or self.tp_overlap or self.fp8 or self.selective or self.whole_loss:
            return False
        # Megatron's sequence parallelism runs here wherever torch's DTensor plan splits the layers, always.
        if self.sequence_parallel != (self.tp > 1 and self.dtensor_parallel):
            return False
        if self.pp > 1:
            tensor = self.tp == 1 or self.strategy in TP_WITH_PIPELINE_HERE
            return self.strategy in PIPELINE_HERE and self.sp == 1 and tensor
        if self.tp > 1:
            return self.strategy in TENSOR_PARALLEL_HERE and self.sp == 1
        return self.sp == 1 or self.strategy in WITH_SEQUENCE_PARALLEL

    @property
    def dtensor_parallel(self) -> bool:
        """Whether this project splits the layers with torch's DTensor plan (training/axes/tensor/plan.py): under
        FSDP2 and inside pipeline stages; DeepSpeed's AutoTP elsewhere."""
        return self.sharding == "fsdp" or self.pp > 1

    @property
    def name(self) -> str:
        parts = [self.strategy, f"dp{self.dp}"] + [f"{k}{v}" for k, v in (("tp", self.tp), ("sp", self.sp)) if v > 1]
        if self.pp > 1:
            parts.append(f"pp{self.pp} {self.schedule}")
            parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts.append(f"micro {self.micro_batch} x{self.micro_batches}")
        options = [("SP", self.sequence_parallel), ("TP overlap", self.tp_overlap), ("fp8", self.fp8),
                   ("compiled", self.compiled), ("ckpt", self.checkpointing), ("selective", self.selective),
                   ("compiled whole-logits loss" if self.compiled_loss else "whole-logits loss", self.whole_loss),
                   (self.stack, self.stack != "shardgpt")]  # fmt: skip
        return " ".join(parts + [word for word, on in options if on])
