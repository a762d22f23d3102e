"""Published large-scale runs the step-time planner is checked against, as their papers report them.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21):
GPT models (vocabulary 51,200, sequence 2048, activation recomputation, mixed precision) on DGX A100 80GB nodes of
Selene (8 GPUs per node, NVLink 3, 8 HDR InfiniBand NICs per node), DDP over the data-parallel ranks. Throughput is
TFLOP/s per GPU counted by the paper's equation 3, 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step, which includes
the recomputed forward. Table 1 (weak scaling, tensor x pipeline x data parallelism) and Table 2 (175B, global batch
1536 fixed: ZeRO-3 without model parallelism against tensor x pipeline, model-parallel size 96) as transcribed here.

MosaicML llm-foundry's published H100 benchmarks (scripts/train/benchmarking/README.md, "H100 80GB BF16"): MPT models
(vocabulary 50,368, sequence 2048, expansion ratio 4, shapes from scripts/train/yamls/pretrain/mpt-*.yaml) under FSDP
full shard, with the micro batch, accumulation and activation checkpointing each row lists, and MFU in PaLM's
convention (6N + 12 L h T per token, as the planner's). The row the H100 efficiency constant comes from (7B on 8 GPUs)
is left out; these test what the planner adds to it: other sizes, other GPU counts, the network, checkpointing.

The GPT and MPT shapes map onto this project's Llama-shaped model with the same matrices: a SwiGLU MLP of 8h/3 (three
matrices of h x 8h/3 hold GPT's two of h x 4h), key-value heads = heads, a tied head. The schedule is taken as 1F1B
with micro batches of one sequence (the paper tunes the micro batch per row and interleaves stages for some runs: the
planner models neither).
"""

from __future__ import annotations

from dataclasses import dataclass

from model import ShardGPTConfig
from training.planning.hardware import cluster
from training.planning.step_time import Layout, predict_step

SEQ_LEN, VOCAB = 2048, 51200


@dataclass(frozen=True)
class PublishedRun:
    source: str
    parameters: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    strategy: str = "ddp"


MEGATRON_TABLE_1 = [
    PublishedRun("Megatron-LM 2021, Table 1", *row)
    for row in (
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
        ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
        ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
        ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    )
]
MEGATRON_TABLE_2 = [
    PublishedRun("Megatron-LM 2021, Table 2", "175B", 96, 12288, 96, tp, pp, gpus, 1536, tflops, strategy)
    for strategy, tp, pp, gpus, tflops in (
        ("zero3", 1, 1, 384, 144), ("zero3", 1, 1, 768, 88), ("zero3", 1, 1, 1536, 44),
        ("ddp", 8, 12, 384, 153), ("ddp", 8, 12, 768, 149), ("ddp", 8, 12, 1536, 141),
    )
]  # fmt: skip


@dataclass(frozen=True)
class FSDPRun:
    parameters: str
    heads: int
    hidden: int
    layers: int
    gpus: int
    micro_batch: int
    accumulation: int
    checkpointing: bool
    mfu: float
    source: str = "llm-foundry H100 benchmarks"


MPT_VOCAB = 50368
LLM_FOUNDRY_H100 = [
    FSDPRun(*row)
    for row in (
        ("1B", 16, 2048, 24, 64, 20, 1, False, 0.4085),
        ("3B", 20, 2560, 32, 64, 6, 3, False, 0.4080),
        ("13B", 40, 5120, 40, 64, 2, 1, False, 0.3986),
        ("30B", 56, 7168, 48, 8, 3, 21, True, 0.3811),
        ("30B", 56, 7168, 48, 32, 14, 3, True, 0.4392),
        ("70B", 64, 8192, 80, 32, 2, 16, True, 0.3615),
        ("70B", 64, 8192, 80, 64, 8, 4, True, 0.4257),
    )
]


def gpt_config(run: PublishedRun | FSDPRun, vocab: int = VOCAB) -> ShardGPTConfig:
    """The run's GPT (or MPT) as this project's model: the same matrices (module docstring)."""
    return ShardGPTConfig(
        vocab_size=vocab, hidden_size=run.hidden, intermediate_size=round(8 * run.hidden / 3),
        num_hidden_layers=run.layers, num_attention_heads=run.heads, num_key_value_heads=run.heads,
        max_position_embeddings=SEQ_LEN,
    )  # fmt: skip


def megatron_flops(run: PublishedRun) -> float:
    """FLOPs of one step by the paper's equation 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    b, s, l, h = run.batch, SEQ_LEN, run.layers, run.hidden
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def run_layout(run: PublishedRun) -> Layout:
    """The run's layout: its degrees, micro batches of one sequence under a pipeline (the whole share of the batch
    otherwise, one micro batch a step), activation checkpointing on."""
    dp = run.gpus // (run.tp * run.pp)
    micro = 1 if run.pp > 1 else run.batch // dp
    return Layout(run.strategy, dp, run.tp, run.pp, 1, "1F1B", micro, run.batch // (dp * micro), True)


def compare(runs: list[PublishedRun]) -> list[dict]:
    """Each run's predicted TFLOP/s per GPU (the paper's FLOPs over the predicted step), beside the published."""
    out = []
    for run in runs:
        layout = run_layout(run)
        row = predict_step(gpt_config(run), cluster("a100-80gb", run.gpus), layout, SEQ_LEN)
        predicted = megatron_flops(run) / row["step_seconds"] / run.gpus / 1e12
        seconds = {k: row[k] for k in ("step_seconds", "bubble_seconds", "communication_seconds")}
        out.append(dict(source=run.source, parameters=run.parameters, layout=layout.name, gpus=run.gpus,
                        batch=run.batch, published_tflops=run.tflops_per_gpu, predicted_tflops=predicted,
                        error=predicted / run.tflops_per_gpu - 1, **seconds))  # fmt: skip
    return out


def compare_mfu(runs: list[FSDPRun]) -> list[dict]:
    """Each FSDP run's predicted MFU on H100s, beside the published."""
    out = []
    for run in runs:
        layout = Layout("fsdp", run.gpus, micro_batch=run.micro_batch, micro_batches=run.accumulation,
                        checkpointing=run.checkpointing)  # fmt: skip
        row = predict_step(gpt_config(run, MPT_VOCAB), cluster("h100", run.gpus), layout, SEQ_LEN)
        seconds = {k: row[k] for k in ("step_seconds", "communication_seconds")}
        out.append(dict(source=run.source, parameters=run.parameters, layout=layout.name, gpus=run.gpus,
                        published_mfu=run.mfu, predicted_mfu=row["mfu"], error=row["mfu"] / run.mfu - 1,
                        **seconds))  # fmt: skip
    return out
