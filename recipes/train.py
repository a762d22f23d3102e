"""Train shardgpt under any strategy: the launcher's config chooses DDP, FSDP or DeepSpeed ZeRO-1/2/3.

    python recipes/train.py                                     # tiny preset, default corpus, one process
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/train.py --preset debug
    deepspeed --num_gpus 2 recipes/train.py --deepspeed ds_configs/zero3.json
    torchrun --nproc_per_node 2 recipes/train.py --deepspeed ds_configs/zero2.json

Sections: setup, data, model (optimizer and prepare), resume, loop, export. Every rank runs every line; the
few rank-0-only actions (file writes, printing) are marked, and so is every collective.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from accelerate.utils import set_seed
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from data import ShardedLoader, prepare_data
from model.export import save_model_folder_streamed
from training import faults
from training.arguments import parse_run_config
from training.checkpoints.background import BackgroundSaveError
from training.checkpoints.checkpoint import check_resume, load_checkpoint, resolve_resume_once
from training.checkpoints.space import CheckpointSpaceError
from training.compat import check_versions
from training.core.accelerator import make_accelerator
from training.core.family import family_of
from training.core.ranks import BAD_INPUT, run_rank
from training.flops import flops_per_token, peak_flops
from training.launch import resolve_launch
from training.loop.comms import StepCommunication
from training.loop.engine import prepare
from training.loop.metrics import MetricsWriter, StepLog, format_record
from training.loop.preemption import Preempted, PreemptionWatch, stop_message
from training.loop.profiling import make_profiler
from training.loop.step import NonFiniteLossError, ZeroGradientError, check_gradients_flow
from training.loop.watchdog import make_watchdog
from training.plan.memory.fit import check_launch_fits
from training.report.console import configure_console, no_transformers_bars
from training.report.curves import plot_training_curves
from training.report.model_card import write_model_card
from training.report.sample import generation_config, print_samples
from training.report.summary import HostPeak, WallClock, peak_memory_per_rank, run_summary

logger = logging.getLogger("shardgpt")


def main(argv: list[str] | None = None) -> object:
    # ------------------------------------------------------------------ setup
    # Everything that can be checked without a process group is checked here, before anything heavy.
    clock = WallClock()  # this launch's phases: start-up (the imports) until now, set-up, training, export
    configure_console()  # the project's lines on rank 0; third-party messages known to be harmless, filtered
    check_versions()  # torch, transformers, accelerate and deepspeed at least the tested floors
    # The launch, resolved once (training/launch.py): the flags (a mistyped choice or flag ends in one `error:` line),
    # the launcher's environment and the DeepSpeed JSON, read here and never again. Its run config is final: every
    # flag checked; the accumulation --global_batch_size gives over the data-parallel ranks, the checkpoint's own
    # tokenizer and the accelerate config's precision filled in. Its strategy holds the mesh of every axis's degree
    # and the resolved DeepSpeed config.
    launch = resolve_launch(parse_run_config(argv))
    cfg, strategy, world = launch.cfg, launch.strategy, launch.world
    config = cfg.model_config()
    check_resume(cfg, strategy)  # no code in its pickles, nothing lost, the global batch, and it converts
    family_of(strategy).check_start(strategy)  # DeepSpeed: the ops it compiles said, a stale build lock refused
    check_launch_fits(launch, config)  # the planner's prediction against this host's free memory and disk

    accelerator = make_accelerator(cfg, strategy, launch.environment)  # collective: initialises the process group
    is_main = accelerator.is_main_process
    set_seed(cfg.seed)  # same seed on every rank: identical initial weights without a broadcast
    out = Path(cfg.output_dir)
    if is_main:  # rank 0 only: the resolved configs, for the record and for the export
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if strategy.deepspeed is not None:
            (out / "ds_config.json").write_text(json.dumps(strategy.deepspeed, indent=2))

    # ------------------------------------------------------------------ data
    # Rank 0 tokenizes and caches while the others wait (collective barrier inside), then all read the cache.
    packed = prepare_data(cfg, config.max_position_embeddings, is_main, accelerator.wait_for_everyone)
    # Ranks of one tensor-parallel group read the same batch (each computes its slice of every layer on it); those of
    # one sequence-parallel group too, each keeping its slice of every sequence.
    dp, dp_rank = strategy.data_parallel_size, strategy.data_parallel_rank(accelerator.process_index)
    if not cfg.streaming:  # a stream's length is unknown; the loader checks its first global batch
        cfg.check_data_size(len(packed.train), dp)
    tokenizer = packed.tokenizer
    loader = ShardedLoader(
        packed.train, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, dp, dp_rank, cfg.seed,
        strategy.sp_size, strategy.sequence_parallel_rank(accelerator.process_index),
    )  # fmt: skip

    # ------------------------------------------------------------------ model, optimizer, prepare
    # The model (fresh from the seed, or --model_name_or_path's weights), AdamW and the schedule, prepared for the
    # strategy (training/loop/engine.py): the whole model wrapped in DDP, FSDP2 or a DeepSpeedEngine by accelerate, or
    # this rank's pipeline stages. Collective: ZeRO-3 and FSDP2 build into each rank's shards, `prepare` shards or
    # broadcasts, a pipeline creates its groups.
    engine = prepare(cfg, strategy, accelerator, config, tokenizer)
    net, optimizer, scheduler = engine.net, engine.optimizer, engine.scheduler
    seen = engine.in_force()  # refuses a run that would not shard as asked; what the prepared objects say
    logger.info("strategy in force: %s", seen)
    if cfg.report_to != "none":
        hparams = {k: v for k, v in cfg.to_dict().items() if v is not None}
        # W&B writes under output_dir unless the user's WANDB_DIR says where (as the HF Trainer honours it).
        wandb_dir = {} if os.environ.get("WANDB_DIR") else {"dir": cfg.output_dir}
        accelerator.init_trackers("shardgpt", config=hparams, init_kwargs={"wandb": wandb_dir})

    # ------------------------------------------------------------------ resume
    step = 0
    # Rank 0 picks and verifies the checkpoint (sizes, checksums unless skipped, no pickle that runs code, nothing an
    # exact resume needs missing); collective: every rank gets it.
    resume = resolve_resume_once(accelerator, cfg)
    if resume is not None:
        # collective: every rank loads its shard; a checkpoint of another strategy or world size converts first
        t0 = time.perf_counter()
        with HostPeak() as held:
            state = load_checkpoint(accelerator, resume, config.to_dict(), strategy, (net, optimizer, scheduler))
        clock.measured("checkpoint_load", time.perf_counter() - t0, held)
        loader.load_state_dict(state["loader"])
        step = state["step"]
        logger.info("resumed from %s at step %d", resume, step)

    # ------------------------------------------------------------------ loop
    tokens_per_step = loader.global_batch_size * cfg.block_size
    peak = peak_flops(accelerator.device, cfg.peak_flops)
    log = StepLog(tokens_per_step, flops_per_token(config, cfg.block_size) * tokens_per_step, world, peak,
                  accelerator.device, cfg.fp16, compiling=cfg.torch_compile)  # fmt: skip
    metrics = MetricsWriter(accelerator, cfg.output_dir)
    # A restarted generation of workers (torch elastic's --max-restarts) replays the steps after its checkpoint: the
    # dead generation's records of them are dropped, and what the fault cost is recorded after the first step.
    replayed = metrics.replayed(launch.environment.restart, step) if launch.environment.restart else None
    batches = iter(loader)
    preemption = PreemptionWatch()  # from here on SIGTERM and SIGUSR1 stop the run after a checkpoint
    profiler = make_profiler(cfg, accelerator.process_index, accelerator.device)  # does nothing without --profile
    # A step that outlives its deadline (--step_timeout, or one measured from the steps before) dumps every rank's
    # stack to output_dir/hang/ and ends the run: a frozen rank costs minutes, and a restarting launcher resumes.
    watchdog = make_watchdog(cfg.step_timeout, cfg.output_dir, accelerator.process_index, world)
    net.train()

    def save() -> Path:  # collective: every rank saves its share
        watchdog.phase("save")  # a save's deadline is the ceiling's: its length is the disk's
        state = {"step": step, "loader": loader.state_dict(), "model_config": config.to_dict(),
                 "run_config": cfg.to_dict(), "strategy": seen}  # fmt: skip
        return engine.save(cfg.output_dir, step, state, cfg.save_total_limit)

    clock.mark("setup")
    first_step = step + 1
    # Counts the collectives of one step: the third, or the first after it that --profile does not record.
    comms = StepCommunication(first_step, cfg.max_steps, profiler.records)
    # The bar is closed however the loop ends, so that an error's line starts a line of its own; log lines are
    # written above it.
    progress = tqdm(total=cfg.max_steps, initial=step, disable=not is_main, desc="train", unit="step")
    with progress, logging_redirect_tqdm():
        while step < cfg.max_steps:
            step += 1
            watchdog.arm(step)
            t0 = time.perf_counter()
            with profiler.step(step), comms.during(step):  # --profile: records --profile_steps
                # collectives inside: gradient reduction, the loss all-reduce, clipping; a pipeline's sends
                result = engine.step(next(batches), step)
            log.add(result, time.perf_counter() - t0)  # the loss's .item() has synchronised the device
            progress.update(1)
            watchdog.phase("profile_export", timed=False)  # rank 0's table can take a while
            if profiler.write():  # after the last profiled step: every rank's trace, rank 0's table
                accelerator.wait_for_everyone()  # collective: the others wait for rank 0, with no deadline running
            if step == first_step and replayed is not None:  # rank 0 only: a restart's cost
                cost = metrics.restarted_cost(replayed, step)
                logger.info("restart %d: %d steps recomputed, %.1f s from the last record before the fault to step "
                            "%d", cost["restart"], cost["steps_recomputed"], cost["fault_s"], step)  # fmt: skip
            if step == first_step:
                check_gradients_flow(result, step, cfg.torch_compile)  # the same on every rank: norms are global
                seen |= engine.shares.read(seen["parameters"])  # gradient and optimizer-state shares, now they exist
            if step == comms.measured:
                seen["communication"] = comms.read()  # collective: every rank's bytes, gathered
            if step in (first_step, comms.measured) and is_main:  # rank 0 only: every rank holds the same shares
                (out / "strategy.json").write_text(json.dumps(seen, indent=2))

            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                record = log.record(step, scheduler.get_last_lr()[0], result.grad_norm, loader.epoch)
                metrics.write(record)  # rank 0 writes the file; accelerate's trackers are rank-0 gated
                if is_main:
                    progress.write(format_record(record))

            if (cfg.eval_steps and step % cfg.eval_steps == 0) or step == cfg.max_steps:
                watchdog.phase("evaluate")
                val = engine.evaluate(packed.validation, dp, dp_rank)  # collective: reduced sums
                if val is not None:
                    perplexity = math.exp(min(val, 50))  # capped: exp overflows for a diverged model
                    metrics.write({"step": step, "eval_loss": val, "eval_perplexity": perplexity})
                    if is_main:
                        progress.write(f"step {step:>6} | eval loss {val:.4f} | perplexity {perplexity:.2f}")
                net.train()

            saved = None
            if cfg.save_steps and step % cfg.save_steps == 0:
                t0 = time.perf_counter()
                with HostPeak() as held:  # under --save_async the step's wait: the copy, not the writes
                    saved = save()  # collective
                clock.measured("checkpoint_save", time.perf_counter() - t0, held)
            watchdog.phase("agree_on_stop")
            faults.after_step(step, accelerator.process_index, world)  # the test suite's injected faults
            stop = preemption.agreed(accelerator.device)  # collective: every rank stops after the same step
            if stop is not None and step < cfg.max_steps:
                saved = saved or save()  # collective
                engine.finish_saves()  # collective: a preempted run stops with its checkpoint complete
                raise Preempted(stop_message(stop, step, saved))
    watchdog.phase("save")
    engine.finish_saves()  # collective: the checkpoint written in the background is complete before the export
    watchdog.stop()  # the export has no step deadline
    clock.mark("train")

    # ------------------------------------------------------------------ export
    # The full weights part by part (collectives: FSDP2 gathers each parameter's shards, ZeRO-3 each module's
    # partitions), rank 0 writing each into a plain HF folder before the next is gathered: it never holds the whole
    # model. Saved as the model's own class whatever class the strategy's wrapper made of it (FSDP2 swaps it), with the
    # generation settings that the samples below, and `generate` and `pipeline` on the export, draw with.
    exported = engine.unwrapped().config  # the model's config as built (vocabulary padded, the tokenizer's ids)
    exported.use_cache = True
    gen = generation_config(cfg, tokenizer.eos_token_id)
    t0 = time.perf_counter()
    with HostPeak() as held, no_transformers_bars():
        parts = engine.export_parts()
        if is_main:  # rank 0 only: the files
            parameters = save_model_folder_streamed(out, exported, parts, safe_serialization=True,
                                                    generation_config=gen)  # fmt: skip
        for _ in parts:  # collective: the other ranks take part in every gather (rank 0 has iterated them all)
            pass
    clock.measured("export", time.perf_counter() - t0, held)
    memory = peak_memory_per_rank(accelerator, clock)  # collective: every rank's peak memory, for the summary
    if is_main:  # rank 0 only: file writes and the summary
        with no_transformers_bars():
            tokenizer.save_pretrained(out)
            write_model_card(out, cfg, exported, tokenizer, seen, parameters, step)  # README.md for the Hub
            logger.info("exported the model, tokenizer and configs to %s", out)
            if cfg.sample_max_new_tokens:
                print_samples(out, tokenizer, packed.validation, cfg)
        print(f"training curves: {plot_training_curves(metrics.path)}")
        clock.mark("export")
        # where this launch's time went (rank 0's), and every rank's host peak during its checkpoint phases
        phases = [k for k in memory[0] if k.endswith(("_peak_rss_gb", "_added_rss_gb"))]
        metrics.write(clock.record(step) | {k: [round(m[k], 3) for m in memory] for k in phases})
        summary = run_summary(step, tokens_per_step, clock, log.throughput, metrics.latest, memory, out, log.device)
        print(summary)
    accelerator.wait_for_everyone()  # collective: nobody exits (tearing down the group) before the export
    accelerator.end_training()
    return engine  # kept by run_rank until the process exits: freeing it could hang in torch's gloo teardown


if __name__ == "__main__":
    # Bad input, a stopped run and a full disk end with one line and exit status 2; a preempted run with one line
    # and exit status 75 (see `run_rank`).
    run_rank(main, (*BAD_INPUT, NonFiniteLossError, ZeroGradientError, CheckpointSpaceError, BackgroundSaveError))
