"""Launcher detection through the Python door (Note [launcher detection], issue 24):
shardtensor._runtime.detect_launch over synthetic environments, the
SHARDTENSOR_BACKEND override, and DistributedManager's check against an already
initialized torch.distributed. Local: every rank runs the same checks."""

import pytest
import torch.distributed as dist

from shardtensor import _C, _runtime
from shardtensor._manager import check_torch_distributed

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
PMI = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}


@pytest.mark.parametrize("env,launcher,rank,size,local", [
    ({}, "none", 0, 1, -1),
    (TORCHRUN, "torchrun", 1, 4, 1),
    (SLURM, "slurm", 3, 8, 3),
    (OPENMPI, "openmpi", 2, 3, 2),
    (PMI, "pmi", 0, 2, 0),
    ({**PMI, **OPENMPI, **SLURM, **TORCHRUN}, "torchrun", 1, 4, 1),
    ({**PMI, **SLURM}, "slurm", 3, 8, 3),
    ({**PMI, **OPENMPI}, "openmpi", 2, 3, 2),
])
def test_detect_launch(env, launcher, rank, size, local):
    info = _runtime.detect_launch(env)
    assert (info["launcher"], info["rank"], info["world_size"], info["local_rank"]) == (
        launcher, rank, size, local)


def test_detect_launch_of_this_process_agrees_with_mpi():
    info = _runtime.detect_launch()
    assert info["world_size"] == _runtime.world_size()
    assert info["rank"] == _runtime.world_rank()


@pytest.mark.parametrize("env,message", [
    ({**TORCHRUN, "WORLD_SIZE": "4.0"}, "WORLD_SIZE='4.0' is not an integer"),
    ({**SLURM, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is outside [0, 8)"),
    ({"PMI_SIZE": "0", "PMI_RANK": "0"}, "PMI_SIZE=0 is not a positive number"),
    ({"RANK": "0"}, "torchrun's WORLD_SIZE is unset but RANK is set"),
])
def test_detect_launch_malformed(env, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace(")", r"\)")
                       .replace(".", r"\.")):
        _runtime.detect_launch(env)


def test_transport():
    if not _C.with_mpi:
        # A c10d-only build (Note [c10d-only build]): every launch is Gloo, and asking
        # for MPI is a clear error.
        assert _C.resolve_transport({}) == "gloo"
        assert _C.resolve_transport(OPENMPI) == "gloo"
        with pytest.raises(RuntimeError, match="SHARDTENSOR_BACKEND=mpi asks for MPI, but this "
                           "shardtensor was built without MPI"):
            _C.resolve_transport({**OPENMPI, "SHARDTENSOR_BACKEND": "mpi"})
    else:
        assert _C.resolve_transport({}) == "mpi"
        assert _C.resolve_transport({**OPENMPI, "SHARDTENSOR_BACKEND": "mpi"}) == "mpi"
    # torchrun without an MPI launcher: the c10d transport (Gloo), never a world of one.
    assert _C.resolve_transport(TORCHRUN) == "gloo"
    assert _C.resolve_transport({**OPENMPI, "SHARDTENSOR_BACKEND": "gloo"}) == "gloo"
    with pytest.raises(RuntimeError, match="SHARDTENSOR_BACKEND=nccl asks for NCCL, which this "
                       "build does not have yet"):
        _C.resolve_transport({**OPENMPI, "SHARDTENSOR_BACKEND": "nccl"})
    with pytest.raises(RuntimeError, match="SHARDTENSOR_BACKEND='ucx' is not one of the "
                       "accepted values mpi, gloo, nccl"):
        _C.resolve_transport({"SHARDTENSOR_BACKEND": "ucx"})


def test_torch_distributed_must_agree_with_mpi(monkeypatch):
    rank, size = _runtime.world_rank(), _runtime.world_size()
    check_torch_distributed(rank, size)  # not initialized: nothing to check
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
    check_torch_distributed(rank, size)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size + 1)
    with pytest.raises(RuntimeError, match=f"torch.distributed is initialized with rank {rank} "
                       f"of {size + 1}, but shardtensor's world has rank {rank} of {size}.*adopts its "
                       "default group"):
        check_torch_distributed(rank, size)
