"""shardgpt under `transformers.Trainer`: the Trainer subclass whose loss is the training
script's, its callbacks (metrics, preemption), and the TrainingArguments built from a RunConfig.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments

from data import EpochSampler
from model.export import write_model_code
from training import faults
from training.compat import keep_zero3_param_dtype, skip_deepspeed_muon
from training.config import RunConfig
from training.core.family import family_of
from training.core.gradnorm import clip_, grad_norm
from training.core.inspection import StateShares, observe_strategy
from training.loop.comms import StepCommunication
from training.loop.engine import verify_in_force
from training.loop.metrics import MetricsWriter, memory_gb
from training.loop.optim import make_optimizer, make_scheduler
from training.loop.preemption import PreemptionWatch
from training.loop.profiling import StepProfiler

IGNORE_INDEX = -100
# RunConfig flags that TrainingArguments has under the same name and meaning.
SAME_FLAGS = (
    "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "max_steps",
    "lr_scheduler_type", "seed", "bf16", "fp16", "torch_compile", "logging_steps", "save_total_limit",
)  # fmt: skip


class ShardGPTTrainer(Trainer):
    """The Trainer with recipes/train.py's data order, optimizer, schedule and loss normalisation."""

    def __init__(self, *args, run_config: RunConfig, strategy, fused_adamw: bool, **kwargs):
        self.run_config, self.strategy, self.fused_adamw = run_config, strategy, fused_adamw
        super().__init__(*args, **kwargs)
        if not family_of(strategy).clips_itself():  # DeepSpeed norms in float64 itself
            # The Trainer clips, and logs the norm, through its accelerator's `clip_grad_norm_`: on this Trainer's
            # accelerator that is recipes/train.py's norm, summed in float64 (training/core/gradnorm.py).
            self.accelerator.clip_grad_norm_ = self.clip_grad_norm_

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """`Accelerator.clip_grad_norm_` with the norm summed in float64 (collective under FSDP: the shards')."""
        if norm_type != 2:
            raise ValueError(f"norm_type {norm_type}: the gradient norm here is the 2-norm")
        self.accelerator.unscale_gradients()  # fp16: the loss scaler's gradients back to their true size first
        parameters = list(parameters)
        shards = family_of(self.strategy).norm_group(self.model_wrapped, self.strategy)  # FSDP1's flat shards
        total = grad_norm(parameters, self.accelerator.device, shards)
        clip_(parameters, max_norm, total)
        return total

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save (its gather of every strategy's shards), then the folder made to load as the Hub
        loads it: under FSDP2 `save_pretrained` copies torch's FSDP sources in place of the model's
        (model/export.py's `write_model_code`). The same for the model folder of each checkpoint."""
        super().save_model(output_dir, _internal_call)
        folder = Path(output_dir or self.args.output_dir)
        if self.args.should_save and (folder / "config.json").is_file():  # rank 0 only: a file write
            write_model_code(folder)

    def _get_train_sampler(self, train_dataset=None):
        # ShardedLoader's order; accelerate deals batch k to data-parallel rank k % ranks, as ShardedLoader does
        # (DeepSpeed AutoTP: the ranks of a tensor-parallel group get the same batch).
        n = len(self.train_dataset if train_dataset is None else train_dataset)
        cfg = self.run_config
        return EpochSampler(n, cfg.global_batch(self.args.world_size // self.get_tp_size()), cfg.seed)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # The Trainer counts targets only in batches that carry `labels`; ours carry `shift_labels`. The count
        # over every micro batch and rank makes each micro batch's loss sum(CE) / targets in the global batch.
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batches).to(device)
        if self.args.world_size > 1:
            # collective; a tensor-parallel group's ranks hold the same batch: its count once
            count = self.accelerator.gather(count).sum() // self.get_tp_size()
        return batches, count

    def create_optimizer(self, model=None):
        if self.optimizer is None:  # under DeepSpeed, called only when the JSON has no optimizer section
            net = self.model if model is None else model
            zero = family_of(self.strategy).muon_layout(self.strategy)  # --optim muon: ZeRO's flat partitions
            self.optimizer = make_optimizer(self.run_config, net, None, self.fused_adamw, zero)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:  # under DeepSpeed, called only when the JSON has no scheduler section
            optimizer = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = make_scheduler(self.run_config, optimizer, None)
        return self.lr_scheduler


class MetricsCallback(TrainerCallback):
    """Appends one JSON per log to output_dir/metrics.jsonl with recipes/train.py's keys (rank 0), refuses a run
    whose prepared model is not sharded as the launch asked, and writes what is in force to strategy.json, with the
    collectives of one optimizer step counted as recipes/train.py counts them (training/loop/comms.StepCommunication:
    the third, or the first after it that --profile does not record; `profiled` says which it records)."""

    def __init__(self, trainer: Trainer, strategy, tokens_per_step: int, flops_per_step: float, peak,
                 profiled=lambda step: False):  # fmt: skip
        self.trainer, self.strategy, self.profiled = trainer, strategy, profiled
        self.comms, self.counting = None, contextlib.nullcontext()
        self.tokens_per_step, self.flops_per_step, self.peak = tokens_per_step, flops_per_step, peak
        self.metrics = MetricsWriter(trainer.accelerator, trainer.args.output_dir)
        self.train_time, self.steps, self.t0 = 0.0, 0, 0.0
        self.seen, self.shares = {}, None
        # Under torch_compile the first step compiles: timed apart as compile_time_s, as recipes/train.py does.
        self.compiling, self.compile_time = trainer.args.torch_compile, None

    def on_train_begin(self, args, state, control, **kwargs):
        model, optimizer = self.trainer.model_wrapped, self.trainer.optimizer
        self.seen = verify_in_force(self.trainer.accelerator, model, self.strategy)
        self.seen |= observe_strategy(model, optimizer, self.strategy)
        self.shares = StateShares(optimizer)  # measured at the first optimizer step, as recipes/train.py does
        self.comms = StepCommunication(state.global_step + 1, state.max_steps, self.profiled)
        if state.is_world_process_zero and args.deepspeed:  # as the Trainer resolved it
            (Path(args.output_dir) / "ds_config.json").write_text(json.dumps(args.hf_deepspeed_config.config, indent=2))

    def on_step_begin(self, args, state, control, **kwargs):
        # The counted step's collectives, from its first micro batch's forward to the optimizer's step: the
        # gradient reduction, DeepSpeed's gathers, clipping's norm (the Trainer's loss is reduced when it logs).
        self.counting = self.comms.during(state.global_step + 1)
        self.counting.__enter__()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.counting.__exit__(None, None, None)  # first: the other callbacks' collectives are not the step's
        self.counting = contextlib.nullcontext()
        elapsed = time.perf_counter() - self.t0
        if self.compiling:
            self.compile_time, self.compiling = elapsed, False
        else:
            self.train_time, self.steps = self.train_time + elapsed, self.steps + 1
        written = self.shares is not None or state.global_step == self.comms.measured
        if self.shares is not None:  # the first optimizer step has run
            self.seen |= self.shares.read(self.seen["parameters"])
            self.shares = None
        if state.global_step == self.comms.measured:
            self.seen["communication"] = self.comms.read()  # collective: every rank's bytes, gathered
        if written and state.is_world_process_zero:  # rank 0 only
            (Path(args.output_dir) / "strategy.json").write_text(json.dumps(self.seen, indent=2))
        control.should_log |= state.global_step >= state.max_steps  # recipes/train.py logs the last step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            dt = self.train_time / self.steps if self.steps else None  # None: only the compiling step
            scheduler = kwargs.get("lr_scheduler")
            record = {
                "step": state.global_step,
                "loss": logs["loss"],  # mean over the steps since the last log of the global batches' token means
                # After the scheduler's step, as recipes/train.py logs it (the Trainer's learning_rate is before).
                "lr": scheduler.get_last_lr()[0] if scheduler is not None else logs.get("learning_rate"),
                "grad_norm": logs.get("grad_norm"),
                "tokens_per_sec": self.tokens_per_step / dt if dt else None,
                "step_time_s": dt,
                "mfu": self.flops_per_step / dt / args.world_size / self.peak if self.peak and dt else None,
                "epoch": logs.get("epoch"),
                **memory_gb(args.device),
            }
            if self.compile_time is not None:  # once, in the first record after compilation
                record["compile_time_s"], self.compile_time = self.compile_time, None
            self.train_time, self.steps = 0.0, 0
        elif "eval_loss" in logs:
            loss = logs["eval_loss"]
            record = {"step": state.global_step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50))}
        else:
            return
        self.metrics.write(record)  # rank 0 writes


class PreemptionCallback(TrainerCallback):
    """SIGTERM or SIGUSR1 (training/loop/preemption.py): after the step in flight every rank, agreeing through a
    collective, has the Trainer save a checkpoint and stop; `main` then ends the run with exit status 75."""

    def __init__(self):
        self.watch = PreemptionWatch()
        self.signal = None

    def on_step_end(self, args, state, control, **kwargs):
        faults.maybe_signal(state.global_step, args.process_index, args.world_size)
        self.signal = self.watch.agreed(args.device)  # collective: every rank stops after the same step
        if self.signal is not None and state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True  # the Trainer saves (collective), then stops


class ProfilerCallback(TrainerCallback):
    """--profile under the Trainer: training/loop/profiling.py's recorder around the optimizer steps of
    --profile_steps."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def on_step_begin(self, args, state, control, **kwargs):
        self.profiler.begin(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.end(state.global_step)
        self.profiler.write()


def cpu_ranks(strategy) -> dict:
    """TrainingArguments for several CPU ranks (gloo), which the Trainer does not set up by itself: `use_cpu` gives
    accelerate's MULTI_CPU DDP; under DeepSpeed it would start a process group with no backend and count a world
    of 1, so accelerate's state is set up here, as recipes/train.py's Accelerator does, and the Trainer uses it."""
    if torch.cuda.is_available() or strategy.world_size == 1:
        return {}
    if strategy.family == "fsdp":
        raise ValueError(
            "FSDP through the Trainer needs GPUs (accelerate runs FSDP only on accelerator devices); on CPU ranks "
            "use recipes/train.py, or a DeepSpeed config"
        )
    if strategy.deepspeed is None:
        return {"use_cpu": True, "ddp_backend": "gloo"}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    keep_zero3_param_dtype()  # the engine's ZeRO-3 partitions keep fp32 on CPU (see training/compat.py)
    PartialState(backend="gloo", timeout=timedelta(minutes=30))  # collective: initialises the process group
    # use_cpu: TrainingArguments refuses --bf16 without a GPU unless it is set; with the configured state above it
    # changes nothing else (DeepSpeed stays in force, as strategy.json shows).
    return {"accelerator_config": {"use_configured_state": True}, "use_cpu": True}


def training_arguments(cfg: RunConfig, strategy) -> TrainingArguments:
    # The Trainer fills the JSON's "auto" values itself; it gets our resolved copy only for --nvme_path or an
    # accelerate config's DeepSpeed section.
    deepspeed = cfg.deepspeed if cfg.deepspeed and not cfg.nvme_path else strategy.deepspeed
    if strategy.deepspeed is not None:
        skip_deepspeed_muon(strategy.deepspeed)  # 2.7 s of CPU a rank otherwise (training/compat.py)
    return TrainingArguments(
        **{name: getattr(cfg, name) for name in SAME_FLAGS},
        warmup_steps=cfg.num_warmup_steps,  # --warmup_steps, or --warmup_ratio of --max_steps
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        deepspeed=deepspeed,
        logging_nan_inf_filter=False,  # a non-finite loss is logged as such
        eval_strategy="steps",
        eval_steps=cfg.eval_steps or cfg.max_steps,  # 0: only at the end, as recipes/train.py
        prediction_loss_only=True,
        label_names=["shift_labels"],
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or None,
        report_to=cfg.report_to.split(","),
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        **cpu_ranks(strategy),
    )
