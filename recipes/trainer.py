"""Train shardgpt with `transformers.Trainer`: the model, data, flags and DeepSpeed JSONs of recipes/train.py,
the loop of the Trainer.

    python recipes/trainer.py --preset debug
    torchrun --nproc_per_node 2 recipes/trainer.py --deepspeed ds_configs/zero2.json
    deepspeed --num_gpus 2 recipes/trainer.py --deepspeed ds_configs/zero3.json
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/trainer.py

Its per-step losses equal recipes/train.py's for the same flags (docs/trainer.md): the same initial weights
(training/core/build.py), data order (data.EpochSampler), AdamW groups and schedule (training/loop/optim.py), and
the same loss, the token mean over the global batch however it is split into micro batches and ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelerate.utils import set_seed
from torch.utils.data import Subset
from transformers import default_data_collator
from transformers.trainer_utils import IntervalStrategy, get_last_checkpoint

from data import BlockDataset, prepare_data
from training.arguments import parse_run_config
from training.checkpoints.safety import check_checkpoint
from training.compat import check_versions
from training.core.build import build_model
from training.core.family import family_of
from training.core.ranks import run_rank
from training.flops import flops_per_token, peak_flops
from training.launch import resolve_launch
from training.loop.hf_trainer import (
    MetricsCallback,
    PreemptionCallback,
    ProfilerCallback,
    ShardGPTTrainer,
    training_arguments,
)
from training.loop.preemption import Preempted, stop_message
from training.loop.profiling import make_profiler
from training.report.console import configure_console, no_transformers_bars
from training.report.curves import plot_training_curves
from training.report.sample import generation_config, print_samples


def main(argv: list[str] | None = None) -> object:
    configure_console()  # the project's lines on rank 0; third-party messages known to be harmless, filtered
    check_versions()  # torch, transformers, accelerate and deepspeed at least the tested floors
    cfg = parse_run_config(argv)  # a mistyped choice or flag ends in one `error:` line
    if cfg.pipeline_parallel_degree > 1:
        raise ValueError(
            f"--pipeline_parallel_degree {cfg.pipeline_parallel_degree} needs recipes/train.py: the HF Trainer has no "
            "pipeline engine (it prepares the whole model on every rank); launch recipes/train.py with the same flags"
        )
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once, as train.py's
    cfg, strategy = launch.cfg, launch.strategy
    if cfg.streaming:
        raise ValueError("--streaming needs recipes/train.py: the Trainer path samples blocks by index")
    if cfg.save_async:
        raise ValueError("--save_async needs recipes/train.py: the Trainer saves its checkpoints itself")
    if cfg.step_timeout:
        raise ValueError(f"--step_timeout {cfg.step_timeout:g} needs recipes/train.py: the Trainer has no watchdog")
    config = cfg.model_config()
    if strategy.sp_size > 1:
        # transformers' Trainer computes each rank's loss as the whole sequence's, from the gathered per-rank losses:
        # under ZeRO-1/2, which divide by world / sp, every gradient is sp times too large
        # (training/axes/ulysses.py).
        raise ValueError(
            f"sequence parallelism (sp_size {strategy.sp_size}) needs recipes/train.py: the HF Trainer's Ulysses loss "
            f"gives gradients {strategy.sp_size} times too large under ZeRO-1/2 (its clipping and logged norms "
            "with them); launch recipes/train.py with the same config and flags"
        )
    if strategy.family != "deepspeed" and strategy.tp_size > 1:
        # The Trainer prepares the model through accelerate, whose FSDP2 x TP preparation cannot import with
        # transformers 5 (training/axes/tensor/plan.py); recipes/train.py applies the plan itself.
        raise ValueError(
            f"tensor parallelism of degree {strategy.tp_size} under {strategy.family.upper()} needs recipes/train.py: "
            "the HF Trainer prepares it through accelerate, which cannot with transformers 5; launch recipes/train.py "
            "with the same config and flags, or use DeepSpeed AutoTP (ds_configs/autotp.json) with the Trainer"
        )
    family_of(strategy).check_start(strategy)  # DeepSpeed: the ops it compiles said, a stale build lock refused
    resume = cfg.resume_from_checkpoint
    if resume == "auto":  # the newest, as the Trainer picks it
        resume = get_last_checkpoint(cfg.output_dir) if Path(cfg.output_dir).is_dir() else None
    if resume is not None:  # before the Trainer (or DeepSpeed, which unpickles fully) reads it: no code in its pickles
        check_checkpoint(resume, cfg.trust_checkpoint)
    args = training_arguments(cfg, strategy)
    is_main = args.process_index == 0  # creating the arguments initialised the process group
    set_seed(cfg.seed)  # then data, then model, in recipes/train.py's order: the same initial weights
    packed = prepare_data(cfg, config.max_position_embeddings, is_main, args.distributed_state.wait_for_everyone)
    dp = strategy.data_parallel_size  # ranks that train on different data (AutoTP: world / autotp_size)
    cfg.check_data_size(len(packed.train), dp)
    net = build_model(config, packed.tokenizer, cfg.gradient_checkpointing, cfg.model_name_or_path)
    validation = None
    if packed.validation is not None and len(packed.validation):
        validation = BlockDataset(packed.validation)
        if cfg.max_eval_batches is not None:  # the blocks recipes/train.py evaluates on
            cap = cfg.max_eval_batches * cfg.per_device_eval_batch_size * dp
            validation = Subset(validation, range(min(cap, len(validation))))
    if validation is None:
        args.eval_strategy = IntervalStrategy.NO
    if is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    trainer = ShardGPTTrainer(
        model=net, args=args, train_dataset=BlockDataset(packed.train), eval_dataset=validation,
        data_collator=default_data_collator, processing_class=packed.tokenizer, run_config=cfg, strategy=strategy,
        fused_adamw=args.device.type == "cuda" and not strategy.offloads,
    )  # fmt: skip
    tokens_per_step = cfg.global_batch(dp) * cfg.block_size
    flops = flops_per_token(config, cfg.block_size) * tokens_per_step
    peak = peak_flops(args.device, cfg.peak_flops)
    profiler = make_profiler(cfg, args.process_index, args.device)  # does nothing without --profile
    trainer.add_callback(MetricsCallback(trainer, strategy, tokens_per_step, flops, peak, profiler.records))
    trainer.add_callback(ProfilerCallback(profiler))
    preemption = PreemptionCallback()
    trainer.add_callback(preemption)
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.state.global_step
    if preemption.signal is not None and step < cfg.max_steps:
        raise Preempted(stop_message(preemption.signal, step, Path(cfg.output_dir) / f"checkpoint-{step}"))

    trainer.model.config.use_cache = True
    trainer.model.generation_config = generation_config(cfg, packed.tokenizer.eos_token_id)  # as recipes/train.py's
    with no_transformers_bars():
        trainer.save_model(cfg.output_dir)  # collective under ZeRO-3: gathers the full weights
        if is_main and cfg.sample_max_new_tokens:
            print_samples(Path(cfg.output_dir), packed.tokenizer, packed.validation, cfg)
    if is_main:  # rank 0 only: the picture of metrics.jsonl (the Trainer printed its own summary)
        print(f"training curves: {plot_training_curves(Path(cfg.output_dir) / 'metrics.jsonl')}")
    trainer.accelerator.wait_for_everyone()  # collective: nobody tears the group down before the export
    trainer.accelerator.end_training()
    return trainer  # kept by run_rank until the process exits: freeing it could hang in torch's gloo teardown


if __name__ == "__main__":
    run_rank(main)
