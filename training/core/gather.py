"""The whole model's weights for the export, part by part, so that rank 0 writes each part before the next is
gathered (`model.export.save_model_folder_streamed`) and never holds the whole model: under FSDP2 each parameter's
shards gathered in turn, under ZeRO-3 each module's partitions. The other families hold the whole model on every
rank already and give it in one part (`Family.export_parts`). Every rank iterates the parts: each is a collective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def fsdp2_parts(accelerator, model: torch.nn.Module) -> Iterator[dict]:
    """FSDP2: one part a parameter, its DTensor's shards gathered (`full_tensor`: a collective on every rank), on
    rank 0 in host memory, as accelerate's full state dict holds it; the other ranks' parts are empty."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():  # the engine hands the model uncompiled
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective: the shards gathered
        yield {name: full.detach().cpu()} if accelerator.is_main_process else {}
        del full


def zero3_parts(accelerator, engine) -> Iterator[dict]:
    """ZeRO-3: one part a module, its partitioned parameters gathered (`GatheredParameters`: a collective on every
    rank) in the precision the engine trains them in, as accelerate's 16-bit consolidation gives them; on rank 0 in
    host memory, the other ranks' parts empty."""
    import deepspeed

    for prefix, module in engine.module.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):  # collective
            if accelerator.is_main_process:
                yield {f"{prefix}.{n}" if prefix else n: p.detach().cpu().clone() for n, p in params}
            else:
                yield {}
