"""The `Accelerator` for a launch: the run's settings, and the family's (training/core/family.py), which lets
accelerate run every GPU strategy on CPU ranks too (FSDP and HSDP on gloo, FSDP2's precision policy, ZeRO-3's
parameter dtype).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from training.config import RunConfig
from training.core.family import family_of
from training.environment import Environment
from training.strategy import Strategy


def make_accelerator(cfg: RunConfig, strategy: Strategy, env: Environment) -> Accelerator:
    """The Accelerator for `strategy`, launched under `env`. Creating it initialises the process group (a
    collective)."""
    family = family_of(strategy)
    handlers = []
    backend, timeout = ("gloo" if not torch.cuda.is_available() else None), timedelta(minutes=30)
    if strategy.world_size > 1:
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    kwargs = dict(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=None if cfg.report_to == "none" else cfg.report_to.split(","),
        project_dir=cfg.output_dir,
        # --torch_compile compiles each decoder layer before `prepare` (training/core/build.py); whole-model
        # compilation by accelerate is left to an accelerate config that asks for it (dynamo_backend).
        kwargs_handlers=handlers,
        # The loop steps the scheduler once per optimizer step; accelerate's default would step it once per
        # process, assuming a data loader that it sharded itself.
        step_scheduler_with_optimizer=False,
    )
    if strategy.world_size > 1 and env.restart:
        join_this_generation(env.restart, backend, timeout)  # collective: the process group, of this generation
    accelerator = Accelerator(**kwargs, **family.accelerator_kwargs(cfg, strategy, env))
    family.configure(accelerator, cfg, strategy, env)  # FSDP: accelerate's state switched to FSDP on CPU ranks
    return accelerator


def join_this_generation(restart: int, backend: str | None, timeout: timedelta) -> None:
    """The default process group of a restarted generation of torch elastic's workers, on a store of its own.

    The workers of every generation meet in the agent's store (the same MASTER_ADDR:MASTER_PORT), which still holds
    the keys the dead generation wrote: each rank's gloo address among them. A rank that reads its peer's key before
    the peer has rewritten it connects to a process that no longer exists, and the process group never forms (a
    rank that reaches `init_process_group` while its peer is still starting up, as rank 1 does while rank 0 prepares
    the data, always does). torch's own env:// rendezvous gives the store; its keys are then kept apart per
    generation. accelerate and DeepSpeed find the group initialised and use it. `backend`: gloo on CPU ranks; None
    on GPUs (NCCL, and gloo for CPU tensors), as accelerate's own initialisation is asked for."""
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    if dist.is_initialized():
        return
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"shardgpt/restart_{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)  # fmt: skip
