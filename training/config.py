"""The one typed configuration of a training run, checked before anything heavy starts.

`RunConfig` holds every flag of `recipes/train.py` (names as in transformers' `run_clm.py` and
`TrainingArguments`), owns the batch arithmetic (global batch = micro batch x accumulation x world size) and
resolves the `"auto"` values of a DeepSpeed JSON from those flags, so the same JSON serves the `deepspeed`
launcher, `accelerate launch` and the HF Trainer. A value the JSON fixes that disagrees with a flag is an
error naming both and the fix; so is a key DeepSpeed does not know.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data import DataArguments
from model import PRESETS, ShardGPTConfig
from training.profiling import parse_steps
from training.watchdog import GPU_STEP_TIMEOUT, HUNG

PRESET_NAMES = tuple(PRESETS)
SCHEDULERS = ("cosine", "linear", "constant")
TRACKERS = ("none", "all", "tensorboard", "wandb", "trackio", "mlflow")


def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RunConfig(DataArguments):
    """Flags of `recipes/train.py`. Data flags (corpus, tokenizer, block size, caches) come from
    `data.DataArguments`; the strategy (DDP, FSDP, ZeRO) comes from the launcher's config file."""

    preset: str = arg("tiny", f"Model size: one of {', '.join(PRESET_NAMES)} (`python -m model` lists them).")
    model_name_or_path: str | None = arg(
        None,
        "Start from these weights instead of a fresh --preset model: an exported shardgpt folder or any "
        "Llama-architecture transformers folder (its tokenizer too, unless --tokenizer_name is given).",
    )
    config_overrides: str | None = arg(
        None, "Replace fields of the preset, as run_clm.py does: `intermediate_size=4096,num_hidden_layers=4`."
    )
    output_dir: str = arg("runs/tiny", "Checkpoints, metrics and the exported model go here.")
    overwrite_output_dir: bool = arg(False, "Start afresh in an output_dir that already holds checkpoints.")
    deepspeed: str | None = arg(None, "A DeepSpeed JSON (ds_configs/*.json) for the deepspeed launcher/torchrun.")
    nvme_path: str | None = arg(None, "Directory for ZeRO NVMe offload; replaces the JSON's nvme_path values.")
    per_device_train_batch_size: int = arg(8, "Micro batch: sequences per rank per forward pass.")
    per_device_eval_batch_size: int = arg(8, "Sequences per rank per evaluation forward pass.")
    gradient_accumulation_steps: int = arg(1, "Micro batches per optimizer step.")
    global_batch_size: int | None = arg(
        None,
        "Sequences per optimizer step over all ranks; sets --gradient_accumulation_steps to global / (micro x "
        "world), so a run can change its number of ranks and keep its batch.",
    )
    learning_rate: float = arg(1e-3, "Peak learning rate of AdamW.")
    min_lr_ratio: float = arg(0.1, "The cosine schedule decays to learning_rate x min_lr_ratio.")
    weight_decay: float = arg(0.1, "AdamW weight decay, applied to matrices only.")
    decay_embeddings: bool = arg(False, "Also apply weight decay to the embedding matrix.")
    adam_beta1: float = arg(0.9, "AdamW beta1.")
    adam_beta2: float = arg(0.95, "AdamW beta2.")
    adam_epsilon: float = arg(1e-8, "AdamW epsilon.")
    max_grad_norm: float = arg(1.0, "Clip the global gradient norm to this (0 disables clipping).")
    max_steps: int = arg(200, "Optimizer steps to train.")
    warmup_steps: int | None = arg(
        None, "Linear warm-up steps before the schedule's decay; when given (0 included) it wins over --warmup_ratio."
    )
    warmup_ratio: float = arg(0.1, "Warm-up as a fraction of --max_steps (rounded up), unless --warmup_steps is given.")
    lr_scheduler_type: str = arg("cosine", f"One of {', '.join(SCHEDULERS)}.")
    seed: int = arg(42, "Seed of the initial weights and the data order; the same on every rank.")
    bf16: bool = arg(False, "Train in bfloat16 mixed precision.")
    fp16: bool = arg(False, "Train in float16 mixed precision with dynamic loss scaling.")
    bf16_gradient_reduction: bool = arg(
        False,
        "With --bf16: reduce gradients in bf16 (FSDP2's reduce_dtype; DeepSpeed's communication_data_type and "
        "data_types.grad_accum_dtype, which the JSON must set to 'bf16' or 'auto'): half the traffic, less exact.",
    )
    gradient_checkpointing: bool = arg(False, "Recompute each decoder layer's activations in the backward.")
    torch_compile: bool = arg(False, "Compile the model with torch.compile (inductor).")
    logging_steps: int = arg(10, "Log loss, lr, grad norm, tokens/s, MFU and memory every N steps.")
    eval_steps: int = arg(100, "Evaluate on the validation blocks every N steps (0: only at the end).")
    max_eval_batches: int | None = arg(50, "Cap on evaluation batches per rank (None: every validation block).")
    save_steps: int = arg(100, "Save a resumable checkpoint every N steps (0: never).")
    save_total_limit: int | None = arg(2, "Keep only the newest N checkpoints.")
    resume_from_checkpoint: str | None = arg(
        None, "A checkpoint directory, or `auto` for the newest complete and intact one."
    )
    skip_checkpoint_checksum: bool = arg(
        False, "On resume, check only the sizes of the checkpoint's files, not their CRC-32 (faster on huge ones)."
    )
    report_to: str = arg("none", f"Trackers, comma-separated: {', '.join(TRACKERS)}.")
    profile: bool = arg(
        False, "Record a torch.profiler trace of --profile_steps on every rank into output_dir/profile/rank<k>/."
    )
    profile_steps: str = arg("3-4", "The optimizer steps --profile records, `first-last` (counted from 1).")
    step_timeout: float | None = arg(
        None,
        "Seconds each phase of a step (training step, evaluation, checkpoint) may take before every rank dumps "
        f"its stack to output_dir/hang/ and the run stops (exit status {HUNG}); 0: never. "
        f"Default: {GPU_STEP_TIMEOUT:.0f} on GPUs, off on CPU.",
    )
    peak_flops: float | None = arg(None, "Peak FLOP/s of one device for MFU (default: from a table of GPUs).")
    skip_memory_check: bool = arg(
        False, "Start even if the memory planner predicts that the launch does not fit this machine's free memory."
    )
    sample_max_new_tokens: int = arg(64, "Tokens of the greedy sample printed at the end (0: none).")
    local_rank: int = arg(-1, "Set by the deepspeed launcher; read from the environment otherwise.")

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
    def mixed_precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    def global_batch(self, world_size: int) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def model_config(self) -> ShardGPTConfig:
        """The preset's config with --config_overrides applied (numbers and true/false only), or the config of
        --model_name_or_path."""
        if self.model_name_or_path:
            from training.build import start_config

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

    # ---------------------------------------------------------------- validation

    def validate(self, world_size: int) -> None:
        """Every flag-level check, before any process group, model or data exists."""
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"--preset {self.preset!r} is unknown; valid presets: {', '.join(PRESET_NAMES)}")
        if self.model_name_or_path and self.config_overrides:
            raise ValueError(
                f"--config_overrides {self.config_overrides!r} with --model_name_or_path: the checkpoint fixes the "
                "model's shape; drop --config_overrides"
            )
        self.model_config()  # a bad --config_overrides or checkpoint fails here, naming the field
        if self.model_name_or_path and self.tokenizer_name is None:
            from training.build import has_tokenizer

            if has_tokenizer(self.model_name_or_path):  # the checkpoint's own tokenizer
                self.tokenizer_name = self.model_name_or_path
        self.derive_accumulation(world_size)
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
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate {self.learning_rate} must be positive")
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
            self.check_profile_steps()
        if (self.step_timeout or 0) < 0:
            raise ValueError(f"--step_timeout {self.step_timeout} must be 0 (off) or more seconds")
        unknown = set(self.report_to.split(",")) - set(TRACKERS)
        if unknown:
            raise ValueError(f"--report_to {self.report_to!r}: unknown {sorted(unknown)}; choose from {TRACKERS}")
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be at least 1")
        if self.deepspeed and not Path(self.deepspeed).is_file():
            raise FileNotFoundError(f"--deepspeed {self.deepspeed!r}: no such file; pick one of ds_configs/*.json")
        if self.nvme_path is not None and not Path(self.nvme_path).is_dir():
            raise FileNotFoundError(
                f"--nvme_path {self.nvme_path!r} does not exist: create it on a fast local disk "
                f"(mkdir -p {self.nvme_path})"
            )
        self.validate_output_dir()

    def derive_accumulation(self, world_size: int) -> None:
        """--global_batch_size fixes the accumulation: global / (micro x world), which must be a whole number."""
        if self.global_batch_size is None:
            return
        micro, g = self.per_device_train_batch_size, self.global_batch_size
        if micro < 1 or world_size < 1 or g < 1 or g % (micro * world_size):
            raise ValueError(
                f"--global_batch_size {g} is not a multiple of micro {micro} x world {world_size} = "
                f"{micro * world_size}: pass a --global_batch_size that is, or another --per_device_train_batch_size"
            )
        accum = g // (micro * world_size)
        if self.gradient_accumulation_steps not in (1, accum):
            raise ValueError(
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps} contradicts --global_batch_size "
                f"{g} (micro {micro} x world {world_size} gives accumulation {accum}): pass only one of them"
            )
        self.gradient_accumulation_steps = accum

    def check_profile_steps(self) -> None:
        first, last = parse_steps(self.profile_steps)
        if last > self.max_steps:
            raise ValueError(
                f"--profile_steps {self.profile_steps} ends after --max_steps {self.max_steps}: profile earlier steps"
            )
        # A checkpoint inside the window would be recorded as part of the steps; and torch 2.13's profiler with
        # stacks fails to read back the events of FSDP's checkpoint-writer threads (UnicodeDecodeError).
        saves = [s for s in range(first, last) if self.save_steps and s % self.save_steps == 0]
        if saves:
            raise ValueError(
                f"--profile_steps {self.profile_steps} spans checkpoint-{saves[0]} (--save_steps {self.save_steps}): "
                f"profile steps between checkpoints, such as {saves[0] + 1}-{saves[0] + 1 + last - first}"
            )

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

    def check_data_size(self, num_train_blocks: int, world_size: int) -> None:
        g = self.global_batch(world_size)
        if num_train_blocks < g:
            raise ValueError(
                f"the training data has {num_train_blocks} blocks of {self.block_size} tokens, fewer than one "
                f"global batch of {g} (= micro {self.per_device_train_batch_size} x accumulation "
                f"{self.gradient_accumulation_steps} x world {world_size}): use more data, a smaller "
                "--per_device_train_batch_size or --block_size, or fewer ranks"
            )


# -------------------------------------------------------------------- DeepSpeed JSON

# Top-level keys DeepSpeed 0.19 reads (runtime/config.py and the feature configs it builds). DeepSpeed itself
# ignores unknown keys, so a typo ("zero_optimisation") silently trains without ZeRO; here it is an error.
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast", "amp", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "wall_clock_breakdown", "memory_breakdown", "flops_profiler", "tensorboard",
    "wandb", "csv_monitor", "comet", "monitor_config", "aio", "communication_data_type",
    "seq_parallel_communication_data_type", "checkpoint", "data_types", "dataloader_drop_last",
    "disable_allgather", "dump_state", "elasticity", "autotuning", "compression_training", "data_efficiency",
    "curriculum_learning", "pipeline", "hybrid_engine", "nebula", "timers", "quantize_training", "eigenvalue",
    "progressive_layer_drop", "sparse_attention", "weight_quantization", "compile", "tensor_parallel",
    "use_data_before_expert_parallel", "graph_harvesting", "log_level", "disable_python_gc",
    "zenflow", "use_node_local_storage", "legacy_fusion",
}  # fmt: skip


def load_json(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None


def check_deepspeed_keys(ds: dict, source: str) -> None:
    """Unknown keys are errors, with the closest known key as the fix. Keys starting with `_` are comments."""
    for key in ds:
        if key.startswith("_") or key in DEEPSPEED_KEYS:
            continue
        close = difflib.get_close_matches(key, DEEPSPEED_KEYS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would silently ignore it)"
        raise ValueError(f"DeepSpeed config {source}: unknown key {key!r}; {hint}")
    zero = ds.get("zero_optimization")
    if zero is not None:
        # DeepSpeed's own pydantic model of the section, in strict mode: unknown fields are errors.
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        try:
            DeepSpeedZeroConfig(strict=True, **{k: v for k, v in zero.items() if v != "auto"})
        except Exception as e:  # pydantic.ValidationError
            raise ValueError(f"DeepSpeed config {source}: {zero_config_error(e, DeepSpeedZeroConfig)}") from None


def zero_config_error(error, model) -> str:
    """The first problem of a pydantic ValidationError of `zero_optimization`, with its fix."""
    first = error.errors()[0] if hasattr(error, "errors") else {"loc": (), "msg": str(error), "type": ""}
    field = ".".join(str(part) for part in ("zero_optimization", *first["loc"]))
    if first["type"] == "extra_forbidden":
        known = [n for name, f in model.model_fields.items() for n in (name, f.alias) if n]
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would silently ignore it)"
        return f"unknown key {field}; {fix}"
    return f"{field} = {first.get('input')!r}: {first['msg']}; fix the value (DeepSpeed's ZeRO config reference)"


def gradient_reduction_dtype(bf16: bool, bf16_gradient_reduction: bool) -> str:
    """The dtype DeepSpeed reduces and accumulates gradients in where the JSON says "auto": fp32, or bf16 when
    bf16 training opts in with --bf16_gradient_reduction."""
    return "bf16" if bf16 and bf16_gradient_reduction else "fp32"


def autotp_size(ds: dict) -> int:
    """Ranks each layer is split over by DeepSpeed AutoTP (`tensor_parallel.autotp_size`); 1 without it."""
    return max(int((ds.get("tensor_parallel") or {}).get("autotp_size", 1) or 1), 1)


def data_parallel_size(ds: dict, world_size: int, source: str) -> int:
    """Ranks that train on different data: the world divided by the tensor-parallel size."""
    tp = autotp_size(ds)
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"DeepSpeed config {source}: tensor_parallel.autotp_size = {tp} does not divide the {world_size} "
            f"launched ranks; set it to one of {divisors}, or launch a multiple of {tp} ranks"
        )
    return world_size // tp


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def offload_devices(ds: dict) -> dict[str, str]:
    zero = ds.get("zero_optimization") or {}
    return {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}


def resolve_deepspeed(ds: dict, cfg: RunConfig, world_size: int, hidden_size: int, source: str) -> dict:
    """The JSON with every `"auto"` replaced by the value the flags give, after checking that every value
    the JSON fixes agrees with the flags. Returns a new dict; `ds` is left as it was."""
    check_deepspeed_keys(ds, source)
    ds = copy.deepcopy(ds)
    micro, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps

    def own(section: dict, key: str, value, flag: str, where: str = "") -> None:
        """Fill an `"auto"` (or absent) value; a fixed one must equal the flag's."""
        current = section.get(key, "auto")
        if current == "auto":
            section[key] = value
        elif current != value and not (isinstance(value, float) and abs(float(current) - value) <= 1e-12):
            given = (
                f"{flag} gives {value!r}" if not isinstance(value, bool) else f"{flag} is {'on' if value else 'off'}"
            )
            pass_it = (
                f"pass {flag} {current}"
                if not isinstance(value, bool)
                else f"{'' if current else 'do not '}pass {flag}"
            )
            raise ValueError(
                f"DeepSpeed config {source}: {where}{key} = {current!r} but {given}; "
                f'set {where}{key} to "auto" in the JSON, or {pass_it}'
            )

    own(ds, "train_micro_batch_size_per_gpu", micro, "--per_device_train_batch_size")
    own(ds, "gradient_accumulation_steps", accum, "--gradient_accumulation_steps")
    # The ranks of a tensor-parallel group train on the same batch: the global batch counts data-parallel ranks.
    dp = data_parallel_size(ds, world_size, source)
    global_batch = micro * accum * dp
    if ds.get("train_batch_size", "auto") not in ("auto", global_batch):
        tp = world_size // dp
        ranks = f"data-parallel ranks {dp} (world {world_size} / autotp_size {tp})" if tp > 1 else f"world {world_size}"
        raise ValueError(
            f"DeepSpeed config {source}: train_batch_size = {ds['train_batch_size']} but micro {micro} x "
            f'accumulation {accum} x {ranks} = {global_batch}; set train_batch_size to "auto", or '
            "change --per_device_train_batch_size / --gradient_accumulation_steps / the number of ranks"
        )
    # DeepSpeed's own batch check (runtime/config.py:602, 0.19.8) counts every rank as data-parallel, as it is
    # given no mpu when it is built (accelerate and the Trainer give none): under AutoTP its train_batch_size
    # counts each tensor-parallel group's one batch autotp_size times.
    ds["train_batch_size"] = micro * accum * world_size
    own(ds, "gradient_clipping", float(cfg.max_grad_norm), "--max_grad_norm")

    for dtype, flag in (("bf16", cfg.bf16), ("fp16", cfg.fp16)):
        section = ds.setdefault(dtype, {})
        own(section, "enabled", flag, f"--{dtype}", where=f"{dtype}.")
    if ds["bf16"]["enabled"] and ds["fp16"]["enabled"]:
        raise ValueError(f"DeepSpeed config {source}: bf16 and fp16 are both enabled: enable one")
    # Gradients reduced and accumulated in fp32 (DeepSpeed's default is the model's dtype, bf16 under bf16):
    # the project's one definition of mixed precision (docs/precision.md); --bf16_gradient_reduction opts out.
    reduce = gradient_reduction_dtype(cfg.bf16, cfg.bf16_gradient_reduction)
    own(ds, "communication_data_type", reduce, "--bf16_gradient_reduction")
    own(ds.setdefault("data_types", {}), "grad_accum_dtype", reduce, "--bf16_gradient_reduction",
        where="data_types.")  # fmt: skip

    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        own(params, "lr", cfg.learning_rate, "--learning_rate", "optimizer.params.")
        own(params, "weight_decay", cfg.weight_decay, "--weight_decay", "optimizer.params.")
        own(params, "eps", cfg.adam_epsilon, "--adam_epsilon", "optimizer.params.")
        betas = [cfg.adam_beta1, cfg.adam_beta2]
        if params.get("betas", "auto") == "auto":
            params["betas"] = betas
        elif list(params["betas"]) != betas:
            raise ValueError(
                f"DeepSpeed config {source}: optimizer.params.betas = {params['betas']} but --adam_beta1/"
                f'--adam_beta2 give {betas}; set betas to "auto", or pass the same betas as flags'
            )
    if "scheduler" in ds:
        params = ds["scheduler"].setdefault("params", {})
        for key, value in (
            ("warmup_min_lr", 0.0), ("warmup_max_lr", cfg.learning_rate), ("warmup_num_steps", cfg.num_warmup_steps),
            ("total_num_steps", cfg.max_steps),
        ):  # fmt: skip
            if params.get(key) == "auto":
                params[key] = value
        check_deepspeed_scheduler(ds["scheduler"], source)

    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        raise ValueError(
            f"DeepSpeed config {source}: zero_optimization.offload_param needs stage 3 (stage is {stage}); "
            "DeepSpeed would silently keep the parameters on the GPU: set stage to 3, or remove offload_param "
            "(offload_optimizer works with stages 1-3)"
        )
    # Communication buckets sized from the model, as the HF Trainer does.
    for key, value in (
        ("reduce_bucket_size", hidden_size * hidden_size),
        ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
        ("stage3_param_persistence_threshold", 10 * hidden_size),
    ):
        if zero.get(key) == "auto":
            zero[key] = value
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if section.get("device") == "nvme":
            if cfg.nvme_path:
                section["nvme_path"] = cfg.nvme_path
            path = section.get("nvme_path")
            if not path or not Path(path).is_dir():
                raise FileNotFoundError(
                    f"DeepSpeed config {source}: zero_optimization.{key}.nvme_path = {path!r} does not exist: "
                    f"create it on a fast local disk, or pass --nvme_path DIR"
                )
            check_libaio(source)
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ValueError(
            f'DeepSpeed config {source}: no flag resolves {", ".join(leftover)} = "auto"; set them to values in '
            "the JSON (the flags fill batch sizes, clipping, precision, optimizer and scheduler values and ZeRO's "
            "bucket sizes)"
        )
    return ds


# Scheduler params that DeepSpeed (runtime/lr_schedules.py, 0.19.8) requires to be positive integers; it raises
# "warmup_num_steps must be a positive integer" only inside `deepspeed.initialize`, after the process group.
POSITIVE_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_num_steps",),
    "WarmupDecayLR": ("warmup_num_steps", "total_num_steps"),
    "WarmupCosineLR": ("warmup_num_steps", "total_num_steps"),
}
SCHEDULER_FIX = {
    "warmup_num_steps": "pass --warmup_steps 1 or more (or a --warmup_ratio that gives at least one step)",
    "total_num_steps": 'pass --max_steps, or set it to "auto"',
}


def check_deepspeed_scheduler(scheduler: dict, source: str) -> None:
    """The JSON's scheduler block, after its "auto" values are filled, as DeepSpeed would take it: a known type,
    parameters its class accepts, and positive step counts."""
    from deepspeed.runtime import lr_schedules

    kind, params = scheduler.get("type"), scheduler.get("params", {})
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ValueError(
            f"DeepSpeed config {source}: scheduler.type = {kind!r} is not a DeepSpeed scheduler; choose one of "
            f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}, or remove the scheduler block (the flags' schedule is used)"
        )
    accepted = set(inspect.signature(getattr(lr_schedules, kind)).parameters) - {"self", "optimizer"}
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"DeepSpeed config {source}: scheduler.params.{key} is not a parameter of {kind}; remove it "
                f"({kind} takes {', '.join(sorted(accepted))})"
            )
    for key in POSITIVE_SCHEDULER_PARAMS.get(kind, ()):
        value = params.get(key)
        if key in params and not (isinstance(value, int) and value > 0):
            raise ValueError(
                f"DeepSpeed config {source}: scheduler.params.{key} = {value!r}, but DeepSpeed's {kind} needs a "
                f"positive integer: {SCHEDULER_FIX[key]}"
            )


def check_libaio(source: str) -> None:
    """NVMe offload runs through DeepSpeed's async_io op, which compiles against libaio at first use; a
    missing libaio would otherwise fail minutes later, inside `deepspeed.initialize`."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise RuntimeError(
            f"DeepSpeed config {source} offloads to NVMe, but DeepSpeed's async_io op cannot be built here: "
            "install libaio (apt-get install libaio-dev, or conda install -c conda-forge libaio), or choose a "
            "CPU-offload config such as ds_configs/zero3_offload_cpu.json"
        )


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
