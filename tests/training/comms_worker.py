"""Launched by tests/training/test_comms.py with torchrun: each collective torch.distributed offers, called on
tensors of known sizes inside its own `CommCounter`; every rank writes what each counter saw to
OUT/comms_rank{R}.json.

    torchrun --nproc_per_node N tests/training/comms_worker.py --output_dir OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from training.core.ranks import run_rank
from training.loop.comms import CommCounter

K = 1000  # elements of one rank's share
# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single, which older releases lack.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def counted(fn) -> dict:
    with CommCounter() as counter:
        fn()
    return counter.record.to_dict()


def exchange(rank: int, n: int) -> None:
    """Each rank sends K elements to the next and receives K from the previous."""
    sent, received = torch.ones(K), torch.empty(K)
    works = [dist.isend(sent, (rank + 1) % n), dist.irecv(received, (rank - 1) % n)]
    for work in works:
        work.wait()


def ddp_backward() -> tuple[dict, torch.nn.Module]:
    """DDP's reducer all-reduces the gradients from C++, inside the backward. The wrapped module is returned
    with the record: freeing DDP's reducer tears the process group down (see `run_rank`)."""
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(K, 3))
    with CommCounter() as counter:
        net(torch.randn(2, K)).sum().backward()
    return counter.record.to_dict(), net


def main(out: Path) -> torch.nn.Module:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    mesh = init_device_mesh("cpu", (n,))
    records = {
        "all_reduce": counted(lambda: dist.all_reduce(torch.ones(K))),
        "all_gather": counted(lambda: dist.all_gather_into_tensor(torch.empty(n * K), torch.ones(K))),
        "reduce_scatter": counted(lambda: reduce_scatter(torch.empty(K), torch.ones(n * K))),
        "all_to_all": counted(lambda: dist.all_to_all_single(torch.empty(n * K), torch.ones(n * K))),
        "point_to_point": counted(lambda: exchange(rank, n)),
        "broadcast": counted(lambda: dist.broadcast(torch.ones(K), src=0)),
        "reduce": counted(lambda: dist.reduce(torch.ones(K), dst=0)),
        "barrier": counted(dist.barrier),
    }
    records["ddp"], net = ddp_backward()
    # A DTensor sharded over every rank: gathered whole, and its norm (a partial sum until all-reduced).
    whole = distribute_tensor(torch.ones(n * K), mesh, [Shard(0)])
    records["dtensor_gather"] = counted(lambda: whole.full_tensor())
    records["dtensor_norm"] = counted(lambda: torch.linalg.vector_norm(whole).full_tensor())
    if rank < 2:  # a group of 2 of the n ranks
        records["pair"] = counted(lambda: dist.all_reduce(torch.ones(K), group=pair))
    (out / f"comms_rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()  # collective: nobody tears the group down while another rank still sends
    dist.destroy_process_group()
    return net  # kept alive until the process ends (see `run_rank`)


if __name__ == "__main__":
    # run_rank ends the process without finalization: a 4-rank launch that had written everything once died
    # in it with "terminate called without an active exception" (gloo's threads outlive the group after DDP).
    run_rank(lambda: main(Path(sys.argv[sys.argv.index("--output_dir") + 1])))
