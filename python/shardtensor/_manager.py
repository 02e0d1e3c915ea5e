"""DistributedManager: a small PhysicsNeMo-compatible facade over the runtime."""

import os

import torch

from . import _runtime

__all__ = ["DistributedManager"]


def check_torch_distributed(rank, world_size):
    """Local. If torch.distributed is initialized, its rank and world size must be
    shardtensor's. They are when shardtensor adopted torch's default group (Note
    [adopted process group]: torch.distributed initialized first); they may differ
    when shardtensor started first and torch.distributed later from another launch.
    Raises RuntimeError if they differ."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    t_rank, t_size = dist.get_rank(), dist.get_world_size()
    if (t_rank, t_size) != (rank, world_size):
        raise RuntimeError(
            f"shardtensor.DistributedManager.initialize: torch.distributed is initialized "
            f"with rank {t_rank} of {t_size}, but shardtensor's world has rank {rank} of "
            f"{world_size}. Initialize torch.distributed first (shardtensor then adopts its "
            f"default group), or launch both from one torchrun/mpirun/srun.")


class DistributedManager:
    """``DistributedManager.initialize()`` then ``DistributedManager()`` (shared state)
    with ``.rank``, ``.world_size``, ``.local_rank``, ``.device`` and
    ``.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("domain_parallel",))``.
    Initializing is collective over the whole job: torch.distributed's default group
    when it is initialized (adopted, Note [adopted process group]), else MPI
    (shardtensor's own MPI init, or adoption of mpi4py's) under mpirun/srun, and
    shardtensor's own Gloo process group under torchrun. The launcher is detected as PhysicsNeMo's manager does
    (torchrun, Slurm, Open MPI, PMI: Note [launcher detection]) and checked against
    MPI under an MPI launcher: a launch that says N > 1 processes but gets an MPI
    world of one (srun without PMI) raises on every process. ``local_rank`` is the
    launcher's, else the rank on this node. ``device`` is cpu unless CUDA is
    available and the launcher gives a local rank (this build runs on cpu)."""

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

        rank, size = _C.world_rank(), _C.world_size()
        check_torch_distributed(rank, size)
        launch = _runtime.detect_launch()
        s["_rank"] = rank
        s["_world_size"] = size
        # init() exported LOCAL_RANK (the node's rank) where no launcher gave one.
        local = launch["local_rank"]
        s["_local_rank"] = local if local >= 0 else int(os.environ.get("LOCAL_RANK", rank))
        if launch["local_rank"] >= 0 and torch.cuda.is_available():
            s["_device"] = torch.device("cuda", launch["local_rank"] % torch.cuda.device_count())
            # As PhysicsNeMo's manager does: "cuda" then means this rank's GPU.
            torch.cuda.set_device(s["_device"])
        else:
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

        self.global_mesh = DeviceMesh(self.device.type, mesh_shape, mesh_dim_names)
        return self.global_mesh

    def _default_mesh(self):
        if self.global_mesh is None:
            self.initialize_mesh((-1,), ("domain_parallel",))
        return self.global_mesh

    @staticmethod
    def cleanup():
        """Nothing to do: MPI is finalized at exit if shardtensor started it."""
