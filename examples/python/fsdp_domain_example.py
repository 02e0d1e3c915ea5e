"""FSDP on the data dim, domain parallelism on the other: shardtensor's version of the
pattern PhysicsNeMo's tutorial builds with PyTorch FSDP over a 2-D mesh.

    PYTHONPATH=build/python mpirun -np 4 python3 examples/python/fsdp_domain_example.py

A 2-D mesh ("ddp", "domain") of shape (2, P/2) (or (1, P) when P is odd): the batch is
sharded over "ddp" and the image height over "domain". Each block of the model is its own
fully_shard unit over "ddp", then the root: every rank stores 1/D of every parameter, of its
gradient and of the Adam state (D = the "ddp" size); parameters are gathered per block just
before it runs and freed after. Plain torch.optim.Adam steps the shards. After a few steps
rank 0 compares the losses and the gathered parameters with single-process training on the
whole batch (float64) and prints MATCH or MISMATCH.
"""

import copy

import torch

import shardtensor as st
from shardtensor import DistributedManager, Shard

DistributedManager.initialize()
dm = DistributedManager()
ddp = 2 if dm.world_size % 2 == 0 else 1
mesh = dm.initialize_mesh(mesh_shape=(ddp, -1), mesh_dim_names=("ddp", "domain"))


class Block(torch.nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, cout)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(self.conv(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(3, 16), Block(16, 16), Block(16, 16)])
        self.head = torch.nn.Conv2d(16, 1, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


torch.manual_seed(0)
model = Net().double()
reference = copy.deepcopy(model)  # single-process training on the whole batch

for block in model.blocks:
    st.fully_shard(block, mesh, "ddp")
st.fully_shard(model, mesh, "ddp")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)

batch, height, width = 2 * ddp, 64, 32
ok = True
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 3, height, width, generator=g, dtype=torch.float64)
    y = torch.randn(batch, 1, height, width, generator=g, dtype=torch.float64)
    sx = st.distribute_tensor(x, mesh, (Shard(0), Shard(2)))  # batch over ddp, height over domain
    sy = st.distribute_tensor(y, mesh, (Shard(0), Shard(2)))
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(sx), sy)
    loss.backward()
    optimizer.step()
    ref_optimizer.zero_grad()
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    ref_optimizer.step()
    ok &= abs(loss.item() - ref_loss.item()) <= 1e-10 * abs(ref_loss.item())
    if dm.rank == 0:
        print(f"step {step}: loss {loss.item():.10f} (single process {ref_loss.item():.10f})")

full = st.full_state_dict(model)  # collective: every parameter's full value
worst = max(((full[n] - p).abs().max() / p.abs().max().clamp_min(1e-30)).item()
            for n, p in reference.named_parameters())
ok &= worst <= 1e-10
stored = sum(p.numel() for p in model.parameters())
total = sum(p.numel() for p in reference.parameters())
if dm.rank == 0:
    print(f"parameters stored on this rank: {stored} of {total} (D = {ddp}); "
          f"worst relative parameter difference {worst:.2e}")
    print("MATCH" if ok else "MISMATCH")
if not ok:
    raise SystemExit("fsdp_domain_example: mismatch with single-process training")
