"""Domain-parallel convolution: shardtensor's version of PhysicsNeMo's tutorial.

    PYTHONPATH=build/python mpirun -np 4 python3 examples/python/conv_example.py

A conv on a 1x8x1024x1024 tensor sharded on dim 2 (the image height), the
module's weights made identical and their gradients summed with
distribute_module, ``mean().backward()``, then the full output and the full
input gradient compared on rank 0 with the single-process computation.
SHARDTENSOR_CONV_SIZE=N runs an NxN image instead (default 1024);
SHARDTENSOR_CONV_DEVICE=cuda puts the input, the conv and the reference on the GPU
(tools/gpu_check.sh).
"""

import os

import torch

import shardtensor as st
from shardtensor import DistributedManager, Shard, ShardTensor, scatter_tensor

DistributedManager.initialize()
dm = DistributedManager()
mesh = dm.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("domain_parallel",))

size = int(os.environ.get("SHARDTENSOR_CONV_SIZE", "1024"))
device = torch.device(os.environ.get("SHARDTENSOR_CONV_DEVICE", "cpu"))
torch.manual_seed(0)
full_input = torch.randn(1, 8, size, size).to(device)
conv = torch.nn.Conv2d(8, 8, 3, stride=1, padding=1).to(device)

# Single-process reference on rank 0 (a copy of the same conv, same input).
if dm.rank == 0:
    ref_conv = torch.nn.Conv2d(8, 8, 3, stride=1, padding=1).to(device)
    ref_conv.load_state_dict(conv.state_dict())
    ref_input = full_input.clone().requires_grad_(True)
    ref_output = ref_conv(ref_input)
    ref_output.mean().backward()

# Sharded: the input scattered from rank 0 along dim 2.
sharded_tensor = scatter_tensor(full_input, 0, mesh, (Shard(2),), requires_grad=True,
                                device=device)
conv = st.distribute_module(conv, mesh)
sharded_output = conv(sharded_tensor)
sharded_output.mean().backward()

full_output = sharded_output.full_tensor()
full_grad = sharded_tensor.grad.full_tensor()
assert isinstance(sharded_output, ShardTensor) and isinstance(sharded_tensor.grad, ShardTensor)

if dm.rank == 0:
    out_ok = torch.allclose(full_output, ref_output, atol=1e-5, rtol=1e-5)
    grad_ok = torch.allclose(full_grad, ref_input.grad, atol=1e-8, rtol=1e-5)
    print(f"Output check: {'PASSED' if out_ok else 'FAILED'} "
          f"(max diff {(full_output - ref_output).abs().max().item():.3g})")
    print(f"Gradient check: {'PASSED' if grad_ok else 'FAILED'} "
          f"(max diff {(full_grad - ref_input.grad).abs().max().item():.3g})")
    if not (out_ok and grad_ok):
        raise SystemExit("conv_example: mismatch with the single-process run")
    wgrad_ok = torch.allclose(conv.weight.grad, ref_conv.weight.grad, atol=1e-6, rtol=1e-4)
    print(f"Weight gradient check: {'PASSED' if wgrad_ok else 'FAILED'}")
    if not wgrad_ok:
        raise SystemExit("conv_example: weight gradient mismatch")

print(sharded_tensor.grad.placements, sharded_tensor.grad.to_local().shape) if dm.rank == 0 else None
