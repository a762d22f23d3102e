"""The one typed configuration of a training run, checked before anything heavy starts.

`RunConfig` holds every flag of `recipes/train.py` (names as in transformers' `run_clm.py` and
`TrainingArguments`; choices are `Literal`s, which the argument parser enforces) and owns the batch arithmetic
(global batch = micro batch x accumulation x data-parallel ranks, the world over the tensor-parallel degree).
`RunConfig.resolve` makes the run's final config once, before any process group (training/launch.py calls it); it is
frozen. The DeepSpeed JSON's `"auto"` values are resolved from it in `training/deepspeed_config.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from data.arguments import DataArguments, flag
from model import PRESETS, ShardGPTConfig
from training.adamw import recipe_learning_rate
from training.axes.pipeline.schedules import ALL_SCHEDULES, check_pipeline, stages_per_rank
from training.limits import HUNG, PHASE_CEILING, STEP_FACTOR, STEP_FLOOR, check_profile_steps
from training.optim_arguments import OptimArguments

PRESET_NAMES = tuple(PRESETS)
Preset = Literal[PRESET_NAMES]
Scheduler = Literal["cosine", "linear", "constant"]
PipelineSchedule = Literal[ALL_SCHEDULES]
SCHEDULERS = get_args(Scheduler)
TRACKERS = ("none", "all", "tensorboard", "wandb", "trackio", "mlflow")  # --report_to takes several, comma-separated


@dataclass(frozen=True)
class RunConfig(OptimArguments, DataArguments):
    """Flags of `recipes/train.py`. Data flags (corpus, tokenizer, block size, caches) come from
    `data.DataArguments`; the strategy (DDP, FSDP, ZeRO) comes from the launcher's config file."""

    preset: Preset = flag("tiny", f"Model size: one of {', '.join(PRESET_NAMES)} (`python -m model` lists them).")
    model_name_or_path: str | None = flag(
        None,
        "Start from these weights instead of a fresh --preset model: an exported shardgpt folder or any "
        "Llama-architecture transformers folder (its tokenizer too, unless --tokenizer_name is given).",
    )
    config_overrides: str | None = flag(
        None, "Replace fields of the preset, as run_clm.py does: `intermediate_size=4096,num_hidden_layers=4`."
    )
    output_dir: str = flag("runs/tiny", "Checkpoints, metrics and the exported model go here.")
    overwrite_output_dir: bool = flag(False, "Start afresh in an output_dir that already holds checkpoints.")
    deepspeed: str | None = flag(None, "A DeepSpeed JSON (ds_configs/*.json) for the deepspeed launcher/torchrun.")
    nvme_path: str | None = flag(None, "Directory for ZeRO NVMe offload; replaces the JSON's nvme_path values.")
    per_device_train_batch_size: int = flag(8, "Micro batch: sequences per rank per forward pass.")
    per_device_eval_batch_size: int = flag(8, "Sequences per rank per evaluation forward pass.")
    gradient_accumulation_steps: int = flag(1, "Micro batches per optimizer step.")
    global_batch_size: int | None = flag(
        None,
        "Sequences per optimizer step over all ranks; sets --gradient_accumulation_steps to global / (micro x "
        "data-parallel ranks), so a run can change its number of ranks and keep its batch. The ranks of a "
        "tensor-parallel group train on one batch: data-parallel ranks = world / autotp_size.",
    )
    learning_rate: float | None = flag(
        None,
        "Peak learning rate of AdamW. Default: by the model's size, GPT-3's (Brown et al. 2020, Table 2.1): 6e-4 "
        "for 125M parameters down to 1.2e-4 for 6.7B; 1e-3 below 50M (docs/model.md lists each preset's).",
    )
    min_lr_ratio: float = flag(0.1, "The cosine schedule decays to learning_rate x min_lr_ratio.")
    weight_decay: float = flag(0.1, "AdamW weight decay, applied to matrices only.")
    decay_embeddings: bool = flag(False, "Also apply weight decay to the embedding matrix.")
    adam_beta1: float = flag(0.9, "AdamW beta1.")
    adam_beta2: float = flag(0.95, "AdamW beta2.")
    adam_epsilon: float = flag(1e-8, "AdamW epsilon.")
    max_grad_norm: float = flag(1.0, "Clip the global gradient norm to this (0 disables clipping).")
    max_steps: int = flag(200, "Optimizer steps to train.")
    warmup_steps: int | None = flag(
        None, "Linear warm-up steps before the schedule's decay; when given (0 included) it wins over --warmup_ratio."
    )
    warmup_ratio: float = flag(
        0.1, "Warm-up as a fraction of --max_steps (rounded up), unless --warmup_steps is given."
    )
    lr_scheduler_type: Scheduler = flag("cosine", f"One of {', '.join(SCHEDULERS)}.")
    seed: int = flag(42, "Seed of the initial weights and the data order; the same on every rank.")
    bf16: bool = flag(False, "Train in bfloat16 mixed precision.")
    fp16: bool = flag(False, "Train in float16 mixed precision with dynamic loss scaling.")
    bf16_gradient_reduction: bool = flag(
        False,
        "With --bf16: reduce gradients in bf16 (FSDP2's reduce_dtype; DeepSpeed's communication_data_type and "
        "data_types.grad_accum_dtype, which the JSON must set to 'bf16' or 'auto'): half the traffic, less exact.",
    )
    gradient_checkpointing: bool = flag(False, "Recompute each decoder layer's activations in the backward.")
    torch_compile: bool = flag(False, "Compile the model with torch.compile (inductor).")
    pipeline_parallel_degree: int = flag(
        1,
        "Pipeline parallelism: split the decoder's layers into stages over this many ranks "
        "(torch.distributed.pipelining); a step's micro batches are --gradient_accumulation_steps. The other "
        "ranks' degree is data parallelism: DDP, or FSDP2 with accelerate_configs/fsdp.yaml.",
    )
    pipeline_parallel_schedule: PipelineSchedule = flag(
        "1F1B",
        "The pipeline schedule, by torch's name: GPipe, 1F1B, or the multi-stage Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble.",
    )
    pipeline_parallel_virtual_stages: int | None = flag(
        None,
        "Stages each pipeline rank holds under a multi-stage schedule (ZBVZeroBubble: 2). Default: 2 under those, "
        "1 under GPipe and 1F1B.",
    )
    tensor_parallel_degree: int = flag(
        1,
        "Tensor parallelism for launches without an accelerate parallelism_config (torchrun, python, args.json): "
        "split each decoder layer over this many consecutive ranks by the model's own plan (torch's DTensor), inside "
        "each pipeline stage: needs --pipeline_parallel_degree 2 or more. Under FSDP2 set the YAML's "
        "parallelism_config_tp_size instead; under DeepSpeed, the JSON's tensor_parallel.autotp_size.",
    )
    logging_steps: int = flag(10, "Log loss, lr, grad norm, tokens/s, MFU and memory every N steps.")
    eval_steps: int = flag(100, "Evaluate on the validation blocks every N steps (0: only at the end).")
    max_eval_batches: int | None = flag(50, "Cap on evaluation batches per rank (None: every validation block).")
    save_steps: int = flag(100, "Save a resumable checkpoint every N steps (0: never).")
    save_total_limit: int | None = flag(2, "Keep only the newest N checkpoints.")
    save_async: bool = flag(False, "Write checkpoints in the background: the step waits for a host-memory copy.")
    resume_from_checkpoint: str | None = flag(
        None, "A checkpoint directory, or `auto` for the newest complete and intact one."
    )
    skip_checkpoint_checksum: bool = flag(
        False, "On resume, check only the sizes of the checkpoint's files, not their CRC-32 (faster on huge ones)."
    )
    trust_checkpoint: bool = flag(
        False, "Load a checkpoint whose pickles name more than this project's checkpoints do (docs/checkpoints.md)."
    )
    resume_inexact: bool = flag(
        False, "Resume even when a rank's saved random states are missing or unreadable, with this launch's instead."
    )
    report_to: str = flag("none", f"Trackers, comma-separated: {', '.join(TRACKERS)}.")
    profile: bool = flag(
        False, "Record a torch.profiler trace of --profile_steps on every rank into output_dir/profile/rank<k>/."
    )
    profile_steps: str = flag("3-4", "The optimizer steps --profile records, `first-last` (counted from 1).")
    step_timeout: float | None = flag(
        None,
        "Seconds each phase of a step (training step, evaluation, checkpoint) may take before every rank dumps "
        f"its stack to output_dir/hang/ and the run stops (exit status {HUNG}); 0: never. "
        f"Default, measured: a training step {STEP_FACTOR:g}x the slowest so far after the first (at least "
        f"{STEP_FLOOR:g} s); the first steps, an evaluation or a save {PHASE_CEILING:g} s.",
    )
    peak_flops: float | None = flag(None, "Peak FLOP/s of one device for MFU (default: from a table of GPUs).")
    skip_memory_check: bool = flag(
        False, "Start even if the memory planner predicts that the launch does not fit this machine's free memory."
    )
    sample_max_new_tokens: int = flag(64, "New tokens of each sample printed at the end (0: no sample).")
    sample_count: int = flag(3, "Samples printed at the end, each prompted from the start of a validation document.")
    sample_temperature: float = flag(0.8, "Sampling temperature of the samples (nanoGPT's sample.py: 0.8).")
    sample_top_k: int = flag(200, "Sample from the k likeliest tokens only (nanoGPT's sample.py: 200; 0: all).")
    sample_greedy: bool = flag(False, "Greedy samples (the likeliest token each time) instead of sampled ones.")
    local_rank: int = flag(-1, "Set by the deepspeed launcher; read from the environment otherwise.")

    def __post_init__(self):
        # The degrees first: the launch's data-parallel count divides by them before `validate` runs.
        for name in ("pipeline_parallel_degree", "pipeline_parallel_virtual_stages", "tensor_parallel_degree"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} {value} must be at least 1 (1: no {name.split('_')[0]} parallelism)")
        # A preset's default learning rate is known as soon as the flags are; a checkpoint's once `resolve` reads it.
        if self.learning_rate is None and not self.model_name_or_path and self.preset in PRESETS:
            object.__setattr__(self, "learning_rate", recipe_learning_rate(self.model_config()))

    # ---------------------------------------------------------------- derived values

    @property
    def verify_checksums(self) -> bool:
        return not self.skip_checkpoint_checksum

    @property
    def num_warmup_steps(self) -> int:
        """The warm-up in force. HF's rule is that a warmup_steps > 0 wins over warmup_ratio; here any given
        --warmup_steps wins, 0 included, because the ratio defaults to 0.1 (HF's to 0) and `--warmup_steps 0`
        must still mean no warm-up. The ratio is rounded up as HF's `get_warmup_steps` does."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * self.max_steps)

    @property
    def pipeline_stages_per_rank(self) -> int:
        """Stages each pipeline rank holds: --pipeline_parallel_virtual_stages, or the schedule's default."""
        return stages_per_rank(self.pipeline_parallel_schedule, self.pipeline_parallel_virtual_stages)

    @property
    def mixed_precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def global_batch(self, data_parallel_size: int) -> int:
        """Sequences per optimizer step: micro x accumulation x the ranks that train on different data."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * data_parallel_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def model_config(self) -> ShardGPTConfig:
        """The preset's config with --config_overrides applied (numbers and true/false only), or the config of
        --model_name_or_path."""
        if self.model_name_or_path:
            from training.pretrained import start_config

            return start_config(self.model_name_or_path)
        overrides, preset = {}, ShardGPTConfig.from_preset(self.preset)
        for item in (self.config_overrides or "").split(","):
            if not item.strip():
                continue
            key, _, value = (part.strip() for part in item.partition("="))
            if not hasattr(preset, key) or not value:
                raise ValueError(
                    f"--config_overrides {self.config_overrides!r}: {item.strip()!r} is not `field=value` with a "
                    f"field of ShardGPTConfig, such as {', '.join(PRESETS[self.preset])}"
                )
            overrides[key] = json.loads(value.lower()) if value.lower() in ("true", "false") else float(value)
            if isinstance(overrides[key], float) and overrides[key].is_integer():
                overrides[key] = int(overrides[key])
        return ShardGPTConfig.from_preset(self.preset, **overrides)

    # ---------------------------------------------------------------- the run's final config

    def resolve(self, data_parallel_size: int, launch_precision: str = "no") -> RunConfig:
        """The run's final config, made once before any process group: every flag checked (`validate`), then what
        the flags and the launch settle, in a new RunConfig: the accumulation --global_batch_size gives over
        `data_parallel_size` ranks (training/launch.py's `Launched.data_parallel_ranks`), the tokenizer of
        --model_name_or_path's folder (unless --tokenizer_name), and the precision of the accelerate config's
        mixed_precision (`launch_precision`: "no" where it sets none)."""
        self.validate(data_parallel_size)
        bf16, fp16 = self.precision(launch_precision)
        learning_rate = self.learning_rate or recipe_learning_rate(self.model_config())  # a checkpoint's size
        return replace(
            self, gradient_accumulation_steps=self.accumulation(data_parallel_size),
            tokenizer_name=self.start_tokenizer(), bf16=bf16, fp16=fp16, learning_rate=learning_rate,
        )  # fmt: skip

    def accumulation(self, data_parallel_size: int) -> int:
        """--gradient_accumulation_steps, or what --global_batch_size fixes: global / (micro x data-parallel ranks),
        which must be a whole number."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        micro, g, dp = self.per_device_train_batch_size, self.global_batch_size, data_parallel_size
        if micro < 1 or dp < 1 or g < 1 or g % (micro * dp):
            raise ValueError(
                f"--global_batch_size {g} is not a multiple of micro {micro} x data-parallel ranks {dp} = "
                f"{micro * dp}: pass a --global_batch_size that is, or another --per_device_train_batch_size"
            )
        accum = g // (micro * dp)
        if self.gradient_accumulation_steps not in (1, accum):
            raise ValueError(
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps} contradicts --global_batch_size "
                f"{g} (micro {micro} x data-parallel ranks {dp} gives accumulation {accum}): pass only one of them"
            )
        return accum

    def start_tokenizer(self) -> str | None:
        """--tokenizer_name; without it, the tokenizer saved in --model_name_or_path's folder, if it has one."""
        if self.model_name_or_path and self.tokenizer_name is None:
            from training.pretrained import has_tokenizer

            if has_tokenizer(self.model_name_or_path):
                return self.model_name_or_path
        return self.tokenizer_name

    def precision(self, launch: str) -> tuple[bool, bool]:
        """(bf16, fp16) of the run. The accelerate config's `mixed_precision` (`launch`) sets the precision when
        no flag does; a flag that says otherwise is refused naming both. `mixed_precision: "no"` (also what
        `accelerate launch` exports when the YAML has no such key) leaves precision to the flags. fp16 needs CUDA:
        on CPU accelerate turns its autocast off without a word, so the run would be fp32 while claiming fp16."""
        if launch not in ("no", "bf16", "fp16"):
            raise ValueError(
                f"the accelerate config sets mixed_precision: {launch}, which this script does not train in: "
                "set mixed_precision: bf16 (or 'no' and pass --bf16)"
            )
        bf16, fp16 = self.bf16, self.fp16
        if launch != "no" and self.mixed_precision == "no":
            bf16, fp16 = launch == "bf16", launch == "fp16"
        elif launch not in ("no", self.mixed_precision):
            raise ValueError(
                f"the accelerate config sets mixed_precision: {launch} but the flags give --{self.mixed_precision}: "
                f"drop --{self.mixed_precision} (the YAML's {launch} is used), or set mixed_precision in the YAML to "
                f"{self.mixed_precision}"
            )
        if fp16 and not torch.cuda.is_available():
            raise ValueError(
                "fp16 (--fp16 or the accelerate config's mixed_precision: fp16) needs a CUDA GPU: on CPU accelerate "
                "silently trains in fp32; pass --bf16 instead (or set mixed_precision: bf16)"
            )
        return bf16, fp16

    # ---------------------------------------------------------------- validation

    def validate(self, data_parallel_size: int) -> None:
        """Every flag-level check, before any process group, model or data exists. Choices the argument parser
        enforces (`Literal`) are checked here too, for a config made in code."""
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"--preset {self.preset!r} is unknown; valid presets: {', '.join(PRESET_NAMES)}")
        if self.model_name_or_path and self.config_overrides:
            raise ValueError(
                f"--config_overrides {self.config_overrides!r} with --model_name_or_path: the checkpoint fixes the "
                "model's shape; drop --config_overrides"
            )
        self.model_config()  # a bad --config_overrides or checkpoint fails here, naming the field
        if self.model_name_or_path and Path(self.model_name_or_path).is_dir():  # its .bin/.pt pickles: no code
            from training.checkpoints.safety import check_checkpoint

            check_checkpoint(self.model_name_or_path, self.trust_checkpoint, "--model_name_or_path")
        self.accumulation(data_parallel_size)  # a --global_batch_size the ranks do not divide fails here
        positive = (
            "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
            "max_steps", "logging_steps",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be at least 1")
        for name in ("eval_steps", "save_steps", "warmup_steps", "weight_decay", "max_grad_norm"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name} {getattr(self, name)} must be 0 or more")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"--learning_rate {self.learning_rate} must be positive")
        self.check_optim()
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min_lr_ratio {self.min_lr_ratio} must be in [0, 1]")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"--warmup_ratio {self.warmup_ratio} must be in [0, 1] (a fraction of --max_steps)")
        if (self.warmup_steps or 0) > self.max_steps:
            raise ValueError(
                f"--warmup_steps {self.warmup_steps} exceeds --max_steps {self.max_steps}: "
                f"pass --warmup_steps {self.max_steps} or fewer, "
                "or --warmup_ratio instead (0.1, the default, is usual)"
            )
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"--lr_scheduler_type {self.lr_scheduler_type!r}: choose one of {', '.join(SCHEDULERS)}")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are both set: choose one precision")
        if self.bf16_gradient_reduction and not self.bf16:
            raise ValueError("--bf16_gradient_reduction needs --bf16 (it lowers bf16 training's gradient reduction)")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"--save_total_limit {self.save_total_limit} must be at least 1 (or unset to keep all)")
        if self.profile:
            check_profile_steps(self.profile_steps, self.max_steps, self.save_steps)
        if self.pipeline_parallel_degree != 1 or self.pipeline_parallel_virtual_stages is not None:
            self.check_pipeline(self.accumulation(data_parallel_size))
        if self.sample_count < 1 or self.sample_max_new_tokens < 0 or self.sample_top_k < 0:
            raise ValueError(
                f"--sample_count {self.sample_count}, --sample_max_new_tokens {self.sample_max_new_tokens} and "
                f"--sample_top_k {self.sample_top_k}: the count must be at least 1, the others 0 or more"
            )
        if not self.sample_temperature > 0:
            raise ValueError(
                f"--sample_temperature {self.sample_temperature} must be positive (pass --sample_greedy for greedy)"
            )
        if (self.step_timeout or 0) < 0:
            raise ValueError(f"--step_timeout {self.step_timeout} must be 0 (off) or more seconds")
        unknown = set(self.report_to.split(",")) - set(TRACKERS)
        if unknown:
            raise ValueError(f"--report_to {self.report_to!r}: unknown {sorted(unknown)}; choose from {TRACKERS}")
        if data_parallel_size < 1:
            raise ValueError(f"data-parallel ranks {data_parallel_size} must be at least 1")
        if self.deepspeed and not Path(self.deepspeed).is_file():
            raise FileNotFoundError(f"--deepspeed {self.deepspeed!r}: no such file; pick one of ds_configs/*.json")
        if self.nvme_path is not None and not Path(self.nvme_path).is_dir():
            raise FileNotFoundError(
                f"--nvme_path {self.nvme_path!r} does not exist: create it on a fast local disk "
                f"(mkdir -p {self.nvme_path})"
            )
        self.validate_output_dir()

    def check_pipeline(self, micro_batches: int) -> None:
        """The pipeline flags against torch's schedules (`micro_batches`: the accumulation in force) and the model's
        depth (training/axes/pipeline/schedules.py). A degree below 1 is refused as the config is made."""
        if self.pipeline_parallel_degree == 1:
            raise ValueError(
                f"--pipeline_parallel_virtual_stages {self.pipeline_parallel_virtual_stages} without pipeline "
                "parallelism: pass --pipeline_parallel_degree 2 or more, or drop it"
            )
        check_pipeline(self.pipeline_parallel_schedule, self.pipeline_parallel_degree, self.pipeline_stages_per_rank,
                       micro_batches, self.model_config().num_hidden_layers)  # fmt: skip

    def validate_output_dir(self) -> None:
        """Refuse to train over saved checkpoints unless told to resume or overwrite: nothing saved is lost."""
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--output_dir {self.output_dir!r} is a file: pass a directory")
        has_checkpoints = out.is_dir() and any(out.glob("checkpoint-*"))
        if has_checkpoints and not self.resume_from_checkpoint and not self.overwrite_output_dir:
            raise FileExistsError(
                f"--output_dir {self.output_dir!r} already holds checkpoints: pass --resume_from_checkpoint auto "
                "to continue, or --overwrite_output_dir to start afresh (old checkpoints are then replaced as "
                "new ones are saved), or choose another --output_dir"
            )

    def check_data_size(self, num_train_blocks: int, data_parallel_size: int) -> None:
        g = self.global_batch(data_parallel_size)
        if num_train_blocks < g:
            raise ValueError(
                f"the training data has {num_train_blocks} blocks of {self.block_size} tokens, fewer than one "
                f"global batch of {g} (= micro {self.per_device_train_batch_size} x accumulation "
                f"{self.gradient_accumulation_steps} x data-parallel ranks {data_parallel_size}): use more data, a "
                "smaller --per_device_train_batch_size or --block_size, or fewer ranks"
            )
