"""Peak resident host memory of each rank while the model is built and while `accelerator.prepare` shards it.

Launched like `recipes/train.py`, with its flags; the launcher's config picks the strategy:

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 \\
        recipes/measure/measure_startup.py --preset llama-1b --per_device_train_batch_size 1 --block_size 128

The start of `recipes/train.py` (strategy, Accelerator, `build_model`, AdamW with its groups, schedule,
`prepare`) without data: the vocabulary is the preset's. No step is taken, so Adam's moments do not exist yet.
Each rank prints its peak resident set (getrusage's ru_maxrss) as soon as the model is built; at the end rank 0
prints one line per rank: the peak after the model is built and after `prepare`, and the resident set after
`prepare`, in GiB.
"""

from __future__ import annotations

import resource

import psutil
import torch

from training.core.build import build_model
from training.core.ranks import run_rank
from training.loop.optim import make_optimizer, make_scheduler
from training.measure.synthetic import StandInTokenizer, set_up

GiB = 2**30


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> dict:
    cfg, world, config, strategy, accelerator = set_up(argv)  # collective: the process group
    before = peak_rss()

    # FSDP2: built on the meta device, sharded and initialised shard by shard (collective: the device mesh)
    net = build_model(config, StandInTokenizer(config.vocab_size), cfg.gradient_checkpointing, None, accelerator)
    built = peak_rss()
    # Every rank, now: a launch whose `prepare` then runs out of memory still reports its build.
    print(f"rank {accelerator.process_index}: model built {built / GiB:.2f} GiB (peak resident set)", flush=True)
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused=False)
    scheduler = make_scheduler(cfg, optimizer, strategy.deepspeed)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)  # collective
    prepared = peak_rss()

    mine = torch.tensor([before, built, prepared, psutil.Process().memory_info().rss], dtype=torch.float64)
    every = accelerator.gather(mine.to(accelerator.device)).view(-1, 4).cpu()  # collective: (world, 4)
    if accelerator.is_main_process:  # rank 0 only: the table
        print(f"{strategy.name} on {world} rank(s), {cfg.preset}: GiB per rank (peak resident set)")
        for rank, (start, b, p, now) in enumerate(every.tolist()):
            print(f"rank {rank}: at start {start / GiB:.2f} | model built {b / GiB:.2f} | prepared {p / GiB:.2f} "
                  f"| resident after prepare {now / GiB:.2f}")  # fmt: skip
    accelerator.wait_for_everyone()  # collective
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


if __name__ == "__main__":
    run_rank(main)
