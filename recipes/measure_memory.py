"""Count the bytes each rank really holds for parameters, gradients and optimizer states.

Launched exactly like `recipes/train.py`, with the same flags; the launcher's config picks the strategy:

    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/measure_memory.py \\
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
only per-rank action; the training steps are collectives on every rank). `recipes/memory_table.py` launches
this for every strategy and prints the table against the ZeRO paper and `recipes/plan_memory.py`.
"""

from __future__ import annotations

import gc
import json
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import HfArgumentParser

from data import ShardedLoader
from model import ShardGPTConfig
from recipes.config import RunConfig
from recipes.distributed import (
    Strategy,
    launched_world_size,
    make_accelerator,
    requested_strategy,
    run_rank,
    verify_strategy,
)
from recipes.modeling import build_model
from recipes.optim import make_optimizer, make_scheduler
from recipes.step import train_step

CATEGORIES = ("params", "master_params", "grads", "optimizer_states", "buffers")
MODEL_STATES = ("params", "master_params", "grads", "optimizer_states")
MEASURED_STEP = 2  # Adam's moments exist from the first step's update on


class Ledger:
    """Bytes by category, each storage counted once (the first category that claims it keeps it)."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.detail: dict[str, int] = defaultdict(int)

    def add(self, category: str, label: str, tensor) -> None:
        if tensor is None:
            return
        if isinstance(tensor, (list, tuple)):
            for t in tensor:
                self.add(category, label, t)
            return
        if hasattr(tensor, "flat_partition"):  # DeepSpeed's GradPartitionBufferGroup
            self.add(category, label, tensor.flat_partition)
            return
        if not isinstance(tensor, torch.Tensor):
            return
        if hasattr(tensor, "to_local"):  # a DTensor: this rank's shard
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[category] += storage.nbytes()
        self.detail[f"{category}.{label}"] += storage.nbytes()

    def add_bytes(self, category: str, label: str, nbytes: int) -> None:
        """Memory with no Python tensor to dedupe by (DDP's C++ reducer buckets)."""
        self.bytes[category] += nbytes
        self.detail[f"{category}.{label}"] += nbytes

    def report(self) -> dict:
        out = {"bytes": dict(self.bytes), "detail": dict(sorted(self.detail.items()))}
        out["model_states"] = sum(self.bytes[c] for c in MODEL_STATES)
        return out


def optimizer_states(ledger: Ledger, optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            ledger.add("optimizer_states", f"adam.{key}", value)


def walk_ddp(ledger: Ledger, net, optimizer) -> None:
    params = list(net.module.parameters())
    ledger.add("params", "weights", [p.data for p in params])
    ledger.add("grads", "param.grad", [p.grad for p in params])
    if not net.gradient_as_bucket_view:
        # The reducer keeps its own flat gradient buckets (copies, not views of .grad): their sizes
        # come from zero-filled twins, as the reducer's tensors are not reachable from Python.
        twins = net.reducer._get_zeros_like_grad_buckets()
        ledger.add_bytes("grads", "ddp_buckets", sum(b.buffer().nbytes for b in twins))
    optimizer_states(ledger, optimizer)


def walk_fsdp(ledger: Ledger, net, optimizer) -> None:
    params = list(net.parameters())
    ledger.add("params", "local_shards", [p.data for p in params])
    ledger.add("grads", "local_shards", [p.grad for p in params])
    optimizer_states(ledger, optimizer)
    for module in net.modules():  # unsharded parameters still allocated (freed after use when resharding)
        group = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            ledger.add("buffers", "fsdp_unsharded_params", unsharded)


def walk_zero12(ledger: Ledger, engine) -> None:
    opt = engine.optimizer
    params = list(engine.module.parameters())
    ledger.add("params", "bit16_flat", opt.bit16_groups_flat)
    ledger.add("params", "weights", [p.data for p in params])
    if getattr(opt, "cpu_offload", False):
        ledger.add("params", "bit16_offload_buffer", opt.param_buffer_of_bit16_for_cpu_offload_groups)
    ledger.add("master_params", "fp32_partitions", opt.single_partition_of_fp32_groups)
    ledger.add("grads", "grads_in_partition", getattr(opt, "grads_in_partition", None))
    ledger.add("grads", "averaged_gradients", [g for g in opt.averaged_gradients.values() if g is not None])
    ledger.add("grads", "fp32_partition.grad", [p.grad for p in opt.single_partition_of_fp32_groups])
    optimizer_states(ledger, opt.optimizer)
    for bucket in opt.ipg_buckets.values():
        ledger.add("buffers", "reduce_buckets", bucket.buffer)
    if getattr(opt, "cpu_offload", False):
        staging = [opt.temp_grad_buffer_for_cpu_offload, opt.temp_grad_buffer_for_gpu_offload]
        ledger.add("buffers", "offload_grad_staging", staging)
    # ZeRO-1 keeps every whole gradient until the engine reduces them at the end of the backward: model
    # state. ZeRO-2 reduces bucket by bucket during the backward: a gradient not yet in its partition is
    # in flight (the last bucket, or a parameter larger than a bucket), a temporary.
    if opt.partition_gradients:
        ledger.add("buffers", "grads_in_flight", [p.grad for p in params])
    else:
        ledger.add("grads", "param.grad", [p.grad for p in params])


def walk_zero3(ledger: Ledger, engine) -> None:
    opt = engine.optimizer
    params = list(engine.module.parameters())
    ledger.add("params", "partitions", getattr(opt, "lp_param_buffer", None))
    ledger.add("params", "partitions", [p.ds_tensor for p in params])
    ledger.add("params", "persistent_whole", [p.data for p in params if p.ds_persist])
    ledger.add("master_params", "fp32_partitions", opt.fp32_partitioned_groups_flat)
    ledger.add("grads", "grad_partitions", opt.grad_partitions_flat_buffer)
    ledger.add("grads", "averaged_gradients", [g for g in opt.averaged_gradients.values() if g is not None])
    ledger.add("grads", "fp32_partition.grad", [p.grad for p in opt.fp32_partitioned_groups_flat])
    optimizer_states(ledger, opt.optimizer)
    for bucket in opt.ipg_buckets.values():
        ledger.add("buffers", "reduce_buckets", bucket.buffer)
    # Whole parameters gathered for a module's forward/backward, and whole gradients not yet reduced
    # into their partitions: temporaries of the backward (empty between steps).
    ledger.add("buffers", "gathered_params", [p.data for p in params if not p.ds_persist])
    ledger.add("buffers", "grads_in_flight", [p.grad for p in params])


def unattributed(ledger: Ledger, exclude: set[int]) -> dict:
    """Tensors the garbage collector sees that the walk did not count: the proof that it missed nothing."""
    seen = set(ledger.seen)
    total, largest = 0, []
    with warnings.catch_warnings():  # isinstance() on some deprecated module objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and id(obj) not in exclude]
    for obj in tensors:
        try:
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functional wrappers)
            continue
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
        largest.append((storage.nbytes(), f"{tuple(t.shape)} {t.dtype}"))
    largest.sort(reverse=True)
    return {"bytes": total, "largest": [f"{n} B {what}" for n, what in largest[:5]]}


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
            walk = walk_fsdp if self.strategy.name.startswith("fsdp") else walk_ddp
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


class StandInTokenizer:
    """What `build_model` reads from a tokenizer: the size the default BPE of --tokenizer_vocab_size has."""

    eos_token_id = bos_token_id = 0

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


def set_up(argv: list[str] | None):
    """The start of `recipes/train.py`: flags parsed and checked, the strategy read, the Accelerator made
    (collective: initialises the process group), the seed set. Returns (cfg, world, config, strategy, accelerator)."""
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses(args=argv)
    world = launched_world_size()
    cfg.validate(world)
    config = cfg.model_config()
    strategy = requested_strategy(cfg, config.hidden_size)
    accelerator = make_accelerator(cfg, strategy)  # collective: initialises the process group
    set_seed(cfg.seed)
    return cfg, world, config, strategy, accelerator


@dataclass
class SyntheticRun:
    """The training setup of `recipes/train.py` on random tokens: what `synthetic_run` returns."""

    cfg: RunConfig
    config: ShardGPTConfig
    strategy: Strategy
    accelerator: Accelerator
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    seen: dict
    blocks: torch.Tensor
    loader: Iterator
    psi: int
    tensors: int

    def step(self, step: int) -> None:
        """One `train_step` on this rank's next micro batches (collectives on every rank)."""
        loss_scale = self.strategy.data_parallel_size * self.cfg.gradient_accumulation_steps
        batch = next(self.loader)
        train_step(self.accelerator, self.net, self.optimizer, self.scheduler, batch, loss_scale,
                   self.cfg.max_grad_norm, step, self.strategy.tp_size)  # fmt: skip


def synthetic_run(argv: list[str] | None = None) -> SyntheticRun:
    """Parse train.py's flags, check them, pick the strategy, build and `prepare` model, AdamW and schedule,
    and feed a synthetic global batch (random tokens, the same on every rank) through the real loader."""
    cfg, world, config, strategy, accelerator = set_up(argv)
    net = build_model(config, StandInTokenizer(cfg.tokenizer_vocab_size), cfg.gradient_checkpointing)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())  # ds_numel: a zero.Init partition
    tensors = sum(1 for _ in net.parameters())
    fused = accelerator.device.type == "cuda" and "offload" not in strategy.name
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    seen = verify_strategy(accelerator, net, strategy)

    # Random tokens, the same on every rank, through the real loader (this rank's micro batches; the ranks of a
    # tensor-parallel group share theirs).
    dp, dp_rank = strategy.data_parallel_size, strategy.data_parallel_rank(accelerator.process_index)
    global_batch = cfg.global_batch(dp)
    generator = torch.Generator().manual_seed(cfg.seed)
    blocks = torch.randint(0, config.vocab_size, (global_batch, cfg.block_size + 1), generator=generator)
    loader = iter(ShardedLoader(blocks, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, dp,
                                dp_rank, cfg.seed))  # fmt: skip
    net.train()
    return SyntheticRun(cfg, config, strategy, accelerator, net, optimizer, scheduler, seen, blocks, loader, psi,
                        tensors)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
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


if __name__ == "__main__":
    run_rank(main)
