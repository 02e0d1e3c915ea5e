"""mpi4py initializes MPI first; shardtensor adopts it and takes an mpi4py communicator."""
from mpi4py import MPI  # initializes MPI

import torch

import shardtensor as st
from shardtensor import Shard

comm = MPI.COMM_WORLD.Dup()
mesh = st.DeviceMesh((-1,), ("domain",), comm=comm)
x = torch.arange(24.0).reshape(6, 4)
sx = st.distribute_tensor(x, mesh, (Shard(0),))
assert torch.equal(sx.full_tensor(), x)
assert st.world_size() == comm.Get_size()
comm.Barrier()
if comm.Get_rank() == 0:
    print("mpi4py_first: OK", flush=True)
# exit: mpi4py finalizes MPI (it started it); shardtensor only frees its communicators
