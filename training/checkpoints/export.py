"""The full weights of a prepared model, gathered from whatever shards the strategy made."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from training.core.inspection import _fsdp1_handles, unwrap


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """The whole model's weights for the export (a collective: ZeRO-3 and FSDP gather their shards).

    FSDP1 on CPU ranks: accelerate gathers with `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`, and
    torch 2.13 then crashed rank 0 with a segmentation fault while cloning the gathered tensors (in
    `_full_post_state_dict_hook`, torch/distributed/fsdp/_state_dict_utils.py:332). Offloading is pointless where
    the weights already live in host memory; gathered on every rank without it, the export is whole."""
    handles = _fsdp1_handles(model)
    if handles and handles[0].device.type == "cpu":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        whole = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, whole):
            return model.state_dict()  # collective: every rank gathers
    if accelerator.distributed_type.name in ("DEEPSPEED", "FSDP"):
        return accelerator.get_state_dict(model)  # collective: ZeRO-3 and FSDP gather
    # DDP or one process: the model inside DDP, unwrapped without importing DeepSpeed (`unwrap`)
    return accelerator.get_state_dict(unwrap(accelerator, model), unwrap=False)
