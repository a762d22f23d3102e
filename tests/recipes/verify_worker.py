"""Launched by test_bad_launches.py: the strategy a launch prepared, checked by `verify_in_force` against what
it is and against each thing it is not, with the "not sharded" case forced by counting every parameter as held
whole on this rank. Rank 0 writes {case: the refusal, or "ok"} to refusals.json."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

from accelerate.utils import set_seed
from transformers import HfArgumentParser

from training.config import RunConfig
from training.core import wrapped
from training.core.accelerator import make_accelerator
from training.core.build import build_model
from training.core.ranks import run_rank
from training.launch import resolve_launch
from training.loop.engine import verify_in_force
from training.loop.optim import make_optimizer
from training.measure.synthetic import StandInTokenizer
from training.strategy import Strategy


def main() -> dict:
    (cfg,) = HfArgumentParser(RunConfig).parse_args_into_dataclasses()
    launch = resolve_launch(cfg)  # the flags, the launcher's environment and the JSON, read once
    cfg = launch.cfg
    config = cfg.model_config()
    strategy = launch.strategy
    accelerator = make_accelerator(cfg, strategy, launch.environment)  # collective: the process group
    set_seed(cfg.seed)
    net = build_model(config, StandInTokenizer(128))
    optimizer = make_optimizer(cfg, net, strategy.deepspeed, fused=False)
    net, optimizer = accelerator.prepare(net, optimizer)  # collective
    world = strategy.world_size
    cases = {
        "as launched": strategy,
        "asked for ZeRO-2": Strategy.of("deepspeed", world, zero_stage=2),
        "asked for ZeRO-3": Strategy.of("deepspeed", world, zero_stage=3),
        "asked for FSDP": Strategy.of("fsdp", world, fsdp_version=2),
        "asked for DDP": Strategy.of("ddp", world),
    }
    seen = {}
    for name, asked in cases.items():
        seen[name] = check(accelerator, net, asked)
    if strategy.tp_size > 1:  # DeepSpeed AutoTP: no tensor parallelism asked for, and a plan its shards do not follow
        cases_tp = {"asked for no tensor parallelism": strategy.with_degrees(tp=1)}
        for name, asked in cases_tp.items():
            seen[name] = check(accelerator, net, asked)
        model = accelerator.unwrap_model(net)
        plan = model.tp_plan
        flipped = {"colwise": "rowwise", "rowwise": "colwise"}
        model.tp_plan = {k: flipped.get(v, v) for k, v in plan.items()}  # columns where rows were split, and back
        seen["as launched, rows and columns swapped"] = check(accelerator, net, strategy)
        model.tp_plan = plan
    # Every parameter counted as whole on this rank: what a strategy that did not shard would show.
    with mock.patch.object(wrapped, "local_numel", wrapped.global_numel):
        seen["as launched, not sharded"] = check(accelerator, net, strategy)
    if accelerator.is_main_process:  # rank 0 only: the file write
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "refusals.json").write_text(json.dumps(seen, indent=2))
    accelerator.wait_for_everyone()  # collective
    accelerator.end_training()
    return locals()  # what this rank built, kept by run_rank until the process exits (training/core/ranks.py)


def check(accelerator, net, asked: Strategy) -> str:
    try:
        verify_in_force(accelerator, net, asked)
    except RuntimeError as e:
        return str(e)
    return "ok"


if __name__ == "__main__":
    run_rank(main)
