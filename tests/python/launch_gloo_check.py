"""Under `mpirun -np N` (issue 24): shardtensor's init exports torch's launch
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so that torch.distributed.init_process_group("gloo") works beside
it; then an all_reduce over Gloo must equal the sum over ranks, and
DistributedManager agrees with torch.distributed."""

import os
import sys

import torch
import torch.distributed as dist

from shardtensor import DistributedManager


def main():
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        assert name not in os.environ, f"{name} set before init: the test would prove nothing"
    DistributedManager.initialize()
    m = DistributedManager()
    n = m.world_size
    assert os.environ["RANK"] == str(m.rank), os.environ["RANK"]
    assert os.environ["WORLD_SIZE"] == str(n), os.environ["WORLD_SIZE"]
    assert os.environ["LOCAL_RANK"] == str(m.local_rank)
    assert m.device == torch.device("cpu")
    dist.init_process_group("gloo")
    assert dist.get_rank() == m.rank and dist.get_world_size() == n
    x = torch.tensor([m.rank + 1.0, 2.0 * m.rank], dtype=torch.float64)
    dist.all_reduce(x)
    want = torch.tensor([n * (n + 1) / 2, float(n * (n - 1))], dtype=torch.float64)
    ok = torch.equal(x, want)
    # With torch.distributed initialized and agreeing, the check passes quietly.
    from shardtensor._manager import check_torch_distributed

    check_torch_distributed(m.rank, n)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {m.rank}: all_reduce {x.tolist()} want {want.tolist()} "
          f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}")
    print("gloo check: " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
