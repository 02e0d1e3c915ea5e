"""DistributedManager: a small PhysicsNeMo-compatible facade over the runtime."""

import os

import torch

from . import _runtime

__all__ = ["DistributedManager"]


class DistributedManager:
    """``DistributedManager.initialize()`` then ``DistributedManager()`` (shared state)
    with ``.rank``, ``.world_size``, ``.local_rank``, ``.device`` (cpu) and
    ``.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("domain_parallel",))``.
    Initializing is collective over MPI_COMM_WORLD (shardtensor's own MPI init,
    or adoption of mpi4py's)."""

    _shared_state = {}

    def __init__(self):
        self.__dict__ = self._shared_state
        if not self._shared_state.get("_initialized"):
            DistributedManager.initialize()

    @classmethod
    def initialize(cls):
        s = cls._shared_state
        if s.get("_initialized"):
            return
        _runtime.ensure_init()
        from . import _C

        s["_rank"] = _C.world_rank()
        s["_world_size"] = _C.world_size()
        local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                               os.environ.get("MPI_LOCALRANKID", os.environ.get("SLURM_LOCALID")))
        s["_local_rank"] = int(local) if local is not None else s["_rank"]
        s["_device"] = torch.device("cpu")
        s["global_mesh"] = None
        s["_initialized"] = True

    @classmethod
    def is_initialized(cls):
        return bool(cls._shared_state.get("_initialized"))

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size

    @property
    def local_rank(self):
        return self._local_rank

    @property
    def device(self):
        return self._device

    @property
    def distributed(self):
        return self._world_size > 1

    def initialize_mesh(self, mesh_shape=(-1,), mesh_dim_names=("domain_parallel",)):
        """Creates (collective) and remembers the global mesh."""
        from ._mesh import DeviceMesh

        self.global_mesh = DeviceMesh(mesh_shape, mesh_dim_names)
        return self.global_mesh

    def _default_mesh(self):
        if self.global_mesh is None:
            self.initialize_mesh((-1,), ("domain_parallel",))
        return self.global_mesh

    @staticmethod
    def cleanup():
        """Nothing to do: MPI is finalized at exit if shardtensor started it."""
