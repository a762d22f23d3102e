"""Count the bytes each rank really holds for parameters, gradients and optimizer states.

Launched exactly like `recipes/train.py`, with the same flags; the launcher's config picks the strategy:

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/measure/measure_memory.py \\
        --preset tiny --per_device_train_batch_size 1 --block_size 64 --output_dir runs/memory/zero2

The run is the training setup of `recipes/train.py` (strategy, Accelerator, model, AdamW with its parameter
groups, schedule, `accelerator.prepare`, `train_step`), fed with a synthetic global batch of random tokens
through the real `ShardedLoader` instead of a corpus; the vocabulary is what the default tokenizer of
--tokenizer_vocab_size gives (`build_model` pads it to a multiple of 128). It trains two steps
whatever --max_steps says (the data flags are not read either): the first creates Adam's moments, the second
is measured. Snapshots of what each rank holds are taken:

- `backward_end`: all gradients of the step exist, before DeepSpeed reduces them (DeepSpeed only: ZeRO-1
  keeps whole gradients until here; the snapshot is taken when the engine calls the reduction);
- `pre_step`: the optimizer is about to update: gradients reduced (and partitioned), optimizer states live.

Every snapshot walks the tensors the engine, FSDP or DDP and the optimizer really hold, by category, and
counts each storage once (`untyped_storage().data_ptr()`: views of one flat buffer are one allocation):

- `params`: the model's weights as held between steps (whole, a flat buffer, or this rank's shard);
- `master_params`: fp32 copies of weights kept apart from `params` (DeepSpeed's optimizer partitions);
- `grads`: gradients, whole or partitioned, with DDP's bucket copies and DeepSpeed's gradient partitions;
- `optimizer_states`: Adam's exp_avg, exp_avg_sq and step counters;
- `buffers`: communication buckets (DeepSpeed's reduce buckets) and other non-state scratch;
- `model_states` = params + master_params + grads + optimizer_states.

A sweep of every tensor the garbage collector can see reports what the walk did not attribute
(`unattributed`), so nothing large is missed. Each rank writes `memory_rank{R}.json` into --output_dir (the
only per-rank action; the training steps are collectives on every rank). `recipes/measure/memory_table.py` launches
this for every strategy and prints the table against the ZeRO paper and `recipes/plan_memory.py`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from training.core.ranks import run_rank
from training.measure.ledger import Ledger, unattributed, walk_ddp, walk_fsdp, walk_zero3, walk_zero12
from training.measure.synthetic import synthetic_run

MEASURED_STEP = 2  # Adam's moments exist from the first step's update on


class Probe:
    """Takes the snapshots at the measured step, from hooks placed where the engine does its work."""

    def __init__(self, net, optimizer, strategy):
        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        self.step = 0
        self.snapshots: dict[str, dict] = {}
        self.exclude: set[int] = set()

    def snapshot(self, name: str) -> None:
        if self.step != MEASURED_STEP or name in self.snapshots:
            return
        gc.collect()  # cyclic garbage (dropped frames of the engine's hooks) is not memory the run holds
        ledger = Ledger()
        if self.strategy.deepspeed is None:
            inner = self.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch AdamW
            walk = walk_fsdp if self.strategy.family == "fsdp" else walk_ddp
            walk(ledger, self.net, inner)
        elif self.strategy.zero_stage == 3:
            walk_zero3(ledger, self.net)
        else:
            walk_zero12(ledger, self.net)
        report = ledger.report()
        report["unattributed"] = unattributed(ledger, self.exclude)
        self.snapshots[name] = report

    def install(self) -> None:
        if self.strategy.deepspeed is None:
            # Fires inside optimizer.step(), after the backward, the gradient sync and the clipping.
            self.optimizer.optimizer.register_step_pre_hook(lambda *_: self.snapshot("pre_step"))
            return
        zero = self.net.optimizer  # the ZeRO optimizer the engine steps
        for method, name in (
            ("reduce_gradients", "backward_end"),  # ZeRO-1: the engine reduces whole gradients here
            ("overlapping_partition_gradients_reduce_epilogue", "backward_end"),  # ZeRO-2/3: the last bucket
            ("step", "pre_step"),
        ):
            if hasattr(zero, method):
                setattr(zero, method, self._before(getattr(zero, method), name))

    def _before(self, fn, name: str):
        def wrapped(*args, **kwargs):
            self.snapshot(name)
            return fn(*args, **kwargs)

        return wrapped


def main(argv: list[str] | None = None) -> dict:
    run = synthetic_run(argv)
    cfg, strategy, accelerator = run.cfg, run.strategy, run.accelerator
    probe = Probe(run.net, run.optimizer, strategy)
    probe.exclude = {id(run.blocks)}
    probe.install()
    for step in range(1, MEASURED_STEP + 1):
        probe.step = step
        run.step(step)

    if not probe.snapshots:
        raise RuntimeError("no snapshot was taken: the optimizer step was never reached")
    # The model-state peak; on a tie, the optimizer step's start (where the paper's figures apply).
    peak = max(probe.snapshots, key=lambda k: (probe.snapshots[k]["model_states"], k == "pre_step"))
    record = {
        "rank": accelerator.process_index,
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        "precision": "fp32" if cfg.mixed_precision == "no" else cfg.mixed_precision,
        "preset": cfg.preset,
        "vocab_size": run.config.vocab_size,
        "psi": run.psi,
        "param_tensors": run.tensors,
        "local_parameter_fraction": run.seen["local_parameter_fraction"],
        "ds_config": strategy.deepspeed,
        "micro_batch": cfg.per_device_train_batch_size,
        "block_size": cfg.block_size,
        "peak_snapshot": peak,
        "model_states": probe.snapshots[peak]["model_states"],
        "bytes": probe.snapshots[peak]["bytes"],
        "snapshots": probe.snapshots,
    }
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Every rank writes its own file (the only per-rank action).
    (out / f"memory_rank{accelerator.process_index}.json").write_text(json.dumps(record, indent=2))
    accelerator.wait_for_everyone()  # collective: nobody tears the group down while another still steps
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
