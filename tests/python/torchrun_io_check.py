"""Under torchrun (the c10d transport, Note [c10d handles]) parallel HDF5 has no
MPI communicator: write_hdf5 and read_hdf5 of a sharded tensor must raise a clear
error on every rank (no hang, no missing symbol), and the job must go on."""

import os
import sys
import tempfile

import torch

import shardtensor as st
from shardtensor import DistributedManager, Shard, scatter_tensor


def expect_refusal(fn, what):
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        ok = "parallel HDF5 (MPI-IO) needs the MPI transport" in msg and "torchrun" in msg
        print(f"rank {DistributedManager().rank}: {what} raised: {msg.splitlines()[0][:160]}")
        return ok
    print(f"rank {DistributedManager().rank}: {what} did not raise")
    return False


def main():
    DistributedManager.initialize()
    dm = DistributedManager()
    mesh = dm.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("domain",))
    x = scatter_tensor(torch.arange(24.0).reshape(6, 4), 0, mesh, (Shard(0),))
    path = os.path.join(tempfile.gettempdir(), f"st_torchrun_io_{os.getppid()}.h5")
    ok = expect_refusal(lambda: st.io.write_hdf5(path, "u", x), "write_hdf5")
    ok = expect_refusal(lambda: st.io.read_hdf5(path, "u", mesh, (Shard(0),)), "read_hdf5") and ok
    # The job is still usable afterwards.
    total = x.full_tensor().sum().item()
    ok = ok and total == sum(range(24))
    print(f"rank {dm.rank}: io check: " + ("PASSED" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
