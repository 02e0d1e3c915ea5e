"""The last rank raises while the others wait in a collective: the job must end promptly."""
import torch

import shardtensor as st
from shardtensor import Shard

mesh = st.DeviceMesh((-1,))
sx = st.distribute_tensor(torch.zeros(mesh.size(), 3), mesh, (Shard(0),))
if mesh.get_rank() == mesh.size() - 1:
    raise ValueError("deliberate failure on the last rank")
sx.full_tensor()  # the other ranks wait here for the last one
sx.full_tensor()
print("unreachable: the collective completed without the failed rank", flush=True)
