"""FSDP1's YAMLs (`fsdp_version: 1`): torch's FullyShardedDataParallel, whose wrapped modules' parameters are
flattened into one flat parameter each, sharded over the ranks. It runs as FSDP2's family (training/core/fsdp.py)
but for what its flat parameters change: the options that cannot run on CPU ranks or that break weight decay,
refused before the process group; its sharding strategy by torch's names; each rank's share counted from its flat
parameters; its gradient norm summed over its process group; the export gathered on every rank on CPU ranks; and
its checkpoints, which are not converted to other strategies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

import torch

from training.config import RunConfig
from training.core.family import Family
from training.core.fsdp import FullyShardedDataParallel, check_fsdp_wrap, offload_device
from training.deepspeed_config import DeepSpeedJSON
from training.environment import Environment
from training.strategy import Sharding, Strategy

# torch's ShardingStrategy, by the name or number accelerate accepts in fsdp_sharding_strategy.
FSDP1_SHARDING = {
    "1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2",
}  # fmt: skip


class FSDP1(FullyShardedDataParallel):
    """torch's FullyShardedDataParallel, through accelerate's FSDP1 path."""

    def strategy(self, cfg: RunConfig, env: Environment, degrees: dict, ds: DeepSpeedJSON | None) -> Strategy:
        check_fsdp1_checkpoints(cfg, env.fsdp_env)
        check_fsdp1(env.fsdp_env)
        return super().strategy(cfg, env, degrees, ds)

    def read_strategy(self, fsdp_env: Mapping[str, str], world: int, replicas: int, **degrees) -> Strategy:
        return fsdp1_strategy(fsdp_env, world, offload_device(fsdp_env), **degrees)

    def check_wrap(self, strategy: Strategy, model: torch.nn.Module) -> None:
        policy = strategy.fsdp_env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
        if policy == "SIZE_BASED_WRAP":
            check_fsdp1_size_wrap(int(strategy.fsdp_env.get("FSDP_MIN_NUM_PARAMS", "0")), model)
        check_fsdp_wrap(strategy, model)

    def after_prepare(self, net: torch.nn.Module, cfg: RunConfig) -> None:
        """FSDP1's mixed precision casts each wrapped module's inputs itself."""

    def norm_group(self, net: torch.nn.Module, strategy: Strategy):
        """Each original parameter's `.grad` is a slice of this rank's flat shard: summed over FSDP1's process group
        (none under NO_SHARD: whole copies)."""
        return net.process_group if strategy.fsdp_sharding != "NO_SHARD" else None

    def parameter_counts(self, model: torch.nn.Module, unwrapped: torch.nn.Module) -> tuple[int, int]:
        """(this rank's, the whole model's) elements of the flat parameters, read right after wrapping, when each
        holds this rank's shard (padding included) and knows its unsharded size."""
        handles = flat_handles(model)
        if not handles:
            return super().parameter_counts(model, unwrapped)
        return (sum(h.flat_param.numel() for h in handles),
                sum(h.flat_param._unpadded_unsharded_size.numel() for h in handles))  # fmt: skip

    def observe(self, model: torch.nn.Module, optimizer) -> dict:
        handles = flat_handles(model)  # one flat parameter per wrapped module
        return {"fsdp_sharding_strategy": sorted({h._sharding_strategy.name for h in handles}),
                "fsdp_flat_parameters": len(handles)}  # fmt: skip

    def full_state_dict(self, accelerator, model: torch.nn.Module) -> dict:
        """The full weights gathered (collective). On CPU ranks accelerate gathers with
        `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`, and torch 2.13 then crashed rank 0 with a
        segmentation fault while cloning the gathered tensors (in `_full_post_state_dict_hook`,
        torch/distributed/fsdp/_state_dict_utils.py:332). Offloading is pointless where the weights already live in
        host memory; gathered on every rank without it, the export is whole."""
        handles = flat_handles(model)
        if handles and handles[0].device.type == "cpu":
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            whole = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, whole):
                return model.state_dict()  # collective: every rank gathers
        return accelerator.get_state_dict(model)  # collective: the shards gathered

    def muon_refusal(self, strategy: Strategy) -> str | None:
        return (
            "--optim muon with fsdp_version: 1: FSDP1 hands the optimizer flat parameters, whose matrices Muon "
            "cannot orthogonalize whole; set fsdp_version: 2 (accelerate_configs/fsdp.yaml), or --optim adamw_torch"
        )

    def async_refusal(self, strategy: Strategy) -> str | None:
        return (
            "--save_async with fsdp_version: 1: FSDP1's state dicts are written by its own calls, which do not save "
            "in the background; set fsdp_version: 2, or drop --save_async"
        )

    export_parts = Family.export_parts  # FSDP1's flat parameters: its own full state dict, whole

    def checkpoint_format(self, strategy: Strategy) -> str:
        return "fsdp1"

    def converts(self, strategy: Strategy) -> bool:
        return False  # the flat parameters are not converted


FAMILY = FSDP1()


def fsdp1_strategy(fsdp_env: Mapping[str, str], world: int, offload: str, **degrees) -> Strategy:
    """FSDP1's strategy on `world` ranks, its sharding by torch's name."""
    sharding = fsdp1_sharding(fsdp_env)
    if sharding not in get_args(Sharding):
        raise ValueError(
            f"fsdp_sharding_strategy: {sharding} is not one of torch's: set FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD or HYBRID_SHARD_ZERO2"
        )
    return Strategy.of("fsdp", world, offload_param=offload, offload_optimizer=offload, fsdp_version=1,
                       fsdp_sharding=sharding, fsdp_env=fsdp_env, **degrees)  # fmt: skip


def fsdp1_sharding(fsdp_env: Mapping[str, str]) -> str:
    """FSDP1's sharding strategy, by torch's name."""
    sharding = fsdp_env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    return FSDP1_SHARDING.get(sharding, sharding)


def check_fsdp1(fsdp_env: Mapping[str, str]) -> None:
    """FSDP1 (torch's FullyShardedDataParallel, flat parameters): on CPU ranks two of its options cannot run, and one
    breaks weight decay everywhere; refused here rather than inside `prepare`."""
    sharding = fsdp1_sharding(fsdp_env)
    if not torch.cuda.is_available():
        if fsdp_env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            # torch 2.13 torch/distributed/fsdp/_flat_param.py:1260, FlatParamHandle.init_flat_param_attributes:
            # `flat_param._local_shard = flat_param._local_shard.pin_memory()`, unconditionally under CPU offload;
            # pinning needs an accelerator ("Cannot access accelerator device when none is available").
            raise ValueError(
                "fsdp_offload_params: true with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 pins the "
                "offloaded shards in page-locked memory, which needs a GPU): set fsdp_offload_params: false, or use "
                "fsdp_version: 2 (its CPUOffloadPolicy runs on CPU)"
            )
        if sharding.startswith("HYBRID"):
            raise ValueError(
                f"fsdp_sharding_strategy: {sharding} with fsdp_version: 1 cannot run on CPU ranks (torch's FSDP1 "
                "builds its intra-node groups from the GPU count): use fsdp_version: 2 with a parallelism_config "
                "(dp_replicate_size x dp_shard_size), which runs hybrid sharding on CPU"
            )
    if fsdp_env.get("FSDP_USE_ORIG_PARAMS", "true").lower() != "true":
        raise ValueError(
            "fsdp_use_orig_params: false with fsdp_version: 1 flattens each wrapped module's parameters into one, so "
            "AdamW's weight decay could not skip norms and biases, and accelerate would leave the optimizer holding "
            "the replaced parameters (nothing trains): set fsdp_use_orig_params: true"
        )


def check_fsdp1_checkpoints(cfg: RunConfig, fsdp_env: dict) -> None:
    """FSDP1 trains on CPU ranks, but two of its checkpoint paths fail there (torch 2.13, accelerate 1.15, measured
    on the `debug` preset): saving a FULL_STATE_DICT checkpoint ended the run at its first save, and a run resumed
    from a SHARDED_STATE_DICT checkpoint at step 2 logged the straight run's loss at step 3 but not at step 4
    (5.3806 against 5.3906: Adam's restored state differs). FSDP2's checkpoints resume exactly
    (tests/recipes/test_resume.py)."""
    if torch.cuda.is_available():
        return
    if cfg.resume_from_checkpoint:
        raise ValueError(
            f"--resume_from_checkpoint {cfg.resume_from_checkpoint} with fsdp_version: 1 on CPU ranks: FSDP1 does not "
            "restore Adam's state exactly here; start afresh without it, or train with fsdp_version: 2, whose "
            "checkpoints resume exactly"
        )
    if cfg.save_steps and fsdp_env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT").upper() == "FULL_STATE_DICT":
        raise ValueError(
            f"--save_steps {cfg.save_steps} with fsdp_version: 1 and fsdp_state_dict_type: FULL_STATE_DICT on CPU "
            "ranks: the first save ends the run here; set fsdp_state_dict_type: SHARDED_STATE_DICT, or pass "
            "--save_steps 0 (the trained model is still exported at the end)"
        )


def check_fsdp1_size_wrap(min_num_params: int, model: torch.nn.Module) -> None:
    """torch's size-based policy wraps the embedding and the output layer each on its own once the threshold is
    at most their size; with tied embeddings FSDP1 then flattens the one shared matrix into two flat parameters,
    and the tie is gone (seen: a parameter count larger by one embedding)."""
    embedding = model.get_input_embeddings().weight.numel()
    if getattr(model.config, "tie_word_embeddings", False) and 0 < min_num_params <= embedding:
        raise ValueError(
            f"fsdp_auto_wrap_policy: SIZE_BASED_WRAP with fsdp_version: 1 and fsdp_min_num_params: {min_num_params} "
            f"would wrap the tied input and output embeddings ({embedding} parameters) apart, untying them: set "
            f"fsdp_min_num_params above {embedding}, or use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"
        )


def flat_handles(model: torch.nn.Module) -> list:
    """The flat-parameter handles of a model wrapped by torch's FSDP1 (none for anything else)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        return []
    return [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle is not None]
