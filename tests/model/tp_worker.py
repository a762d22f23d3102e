"""Loads an exported shardgpt folder with `from_pretrained(..., tp_plan="auto")` on every rank of a torchrun
launch, as a user of plain transformers would, in a process where this project cannot be imported (the folder's
own copy of the modeling code runs), and compares it with the whole model in the same process.

    torchrun --nproc_per_node 2 tp_worker.py FOLDER RESULTS_JSON

Rank 0 writes {"logits_max_abs_diff": float, "shards": {module: [local shape, placements]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if p and Path(p).resolve() not in (ROOT, Path(__file__).resolve().parent)]
for name in ("model", "data", "recipes"):  # unimportable, even if pip-installed
    sys.modules[name] = None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

SHARDED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")


def main(folder: str, results: str) -> None:
    whole = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    # transformers starts the process group (gloo on CPU) and shards by the config's base_model_tp_plan.
    split = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, tp_plan="auto").eval()
    ids = torch.randint(0, whole.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (whole(ids).logits - split(ids).logits).abs().max().item()
    layer = split.model.layers[0]
    shards = {}
    for name in SHARDED:
        weight = layer.get_submodule(name).weight
        shards[name] = [list(weight.to_local().shape), [str(p) for p in weight.placements]]
    if dist.get_rank() == 0:  # rank 0 only: the file write
        Path(results).write_text(json.dumps({"logits_max_abs_diff": diff, "shards": shards}))
    dist.barrier()  # collective: nobody tears the group down before rank 0 has written
    # Torn down before exit: a rank leaving with gloo's threads alive once died in std::terminate (SIGABRT).
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
