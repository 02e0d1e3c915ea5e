"""shardtensor adopts a torch.distributed process group (Note [adopted process group]).

    torchrun --standalone --nproc-per-node P python3 tests/python/adopt_group_check.py MODE

torch.distributed is initialized first, through a file rendezvous; then torch's
rendezvous variables (MASTER_ADDR, MASTER_PORT, the agent store) are removed from
the environment, so shardtensor could not start a world of its own ("needs
MASTER_ADDR and MASTER_PORT"): it works only by adopting the group.

MODE default: DistributedManager.initialize() adopts the initialized default group.
MODE new_group: ``shardtensor.init(process_group=dist.new_group(...))``; at P >= 3 the
group leaves rank 1 out, so shardtensor's world is the other ranks, renumbered.

Each member checks: world rank and size are the group's; a conv on a tensor sharded
unevenly on dim 2 equals plain torch (output, input gradient, weight gradient); the
traffic went over the group (comm_stats counts bytes); init with another group raises.
Every rank prints "adopt check: PASSED" or raises.
"""

import os
import sys

import torch
import torch.distributed as dist


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "default"
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    path = f"/tmp/shardtensor_adopt_{os.environ['MASTER_PORT']}_{mode}"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=size)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)  # unsetenv too: shardtensor's C++ reads the C environment

    import shardtensor as st
    from shardtensor import Shard

    if mode == "default":
        st.DistributedManager.initialize()
        members = list(range(size))
    else:
        members = [r for r in range(size) if not (size >= 3 and r == 1)]
        # Collective over every rank of the default group, members or not.
        group, other = dist.new_group(members), dist.new_group(members)
        if rank not in members:
            print(f"rank {rank}: adopt check: PASSED (not a member of {members})", flush=True)
            dist.destroy_process_group()
            return
        st.init(process_group=group)
    me, n = members.index(rank), len(members)
    assert st._C.transport() == "gloo", st._C.transport()
    assert (st.world_rank(), st.world_size()) == (me, n), (st.world_rank(), st.world_size(), me, n)

    mesh = st.DeviceMesh((-1,), ("domain",))
    torch.manual_seed(0)
    full = torch.randn(2, 3, 2 * n + 1, 6, dtype=torch.float64)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ref_conv = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ref_conv.load_state_dict(conv.state_dict())
    ref_in = full.clone().requires_grad_(True)
    ref_conv(ref_in).pow(2).sum().backward()
    st.reset_comm_stats()
    sx = st.distribute_tensor(full, mesh, (Shard(2),), requires_grad=True)
    conv = st.distribute_module(conv, mesh)
    out = conv(sx)
    out.pow(2).sum().backward()
    got, grad = out.full_tensor(), sx.grad.full_tensor()
    sent = st.comm_stats()["bytes_sent"]
    ref_out = ref_conv(full)
    assert torch.allclose(got, ref_out, rtol=1e-12, atol=1e-12), "output differs"
    assert torch.allclose(grad, ref_in.grad, rtol=1e-12, atol=1e-12), "input gradient differs"
    assert torch.allclose(conv.weight.grad, ref_conv.weight.grad, rtol=1e-10, atol=1e-12), \
        "weight gradient differs"
    assert n == 1 or sent > 0, "no bytes moved"
    st.init(process_group=dist.group.WORLD if mode == "default" else group)  # same group: no-op
    if mode == "new_group":
        try:
            st.init(process_group=other)
        except RuntimeError as e:
            assert "already runs" in str(e), str(e)
        else:
            raise AssertionError("init with another group did not raise")
    print(f"rank {rank}: adopt check: PASSED ({mode}; shardtensor rank {me} of {n}, "
          f"{sent} bytes sent)", flush=True)


if __name__ == "__main__":
    main()
