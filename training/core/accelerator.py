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
    if strategy.world_size > 1:
        gloo = not torch.cuda.is_available()
        handlers.append(InitProcessGroupKwargs(backend="gloo" if gloo else None, timeout=timedelta(minutes=30)))
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
    accelerator = Accelerator(**kwargs, **family.accelerator_kwargs(cfg, strategy, env))
    family.configure(accelerator, cfg, strategy, env)  # FSDP: accelerate's state switched to FSDP on CPU ranks
    return accelerator
