"""DeviceMesh: an N-d Cartesian grid of MPI ranks (C++ shardtensor::DeviceMesh)."""

import weakref

from . import _C
from ._runtime import ensure_init

__all__ = ["DeviceMesh", "init_device_mesh"]

# Python DeviceMesh objects by their C++ mesh, so that sx.device_mesh returns
# the object the user made (meshes are few; a linear scan is fine).
_live = []


def _comm_handle(comm):
    if comm is None:
        return 0
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise TypeError("a communicator for DeviceMesh needs mpi4py") from e
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    return MPI._handleof(comm)


class DeviceMesh:
    """An N-d Cartesian grid of ranks: ``DeviceMesh((2, -1), ("data", "domain"))``.

    Collective over ``comm`` (an mpi4py communicator; default MPI_COMM_WORLD),
    which must be the same on every rank. One entry of ``mesh_shape`` may be -1
    (inferred). Initializes MPI on first use (or adopts mpi4py's). Raises
    RuntimeError on every rank, before communicating, if the shape does not fit
    the communicator size or the names are wrong. C++: DeviceMesh::create.
    """

    def __init__(self, mesh_shape=(-1,), mesh_dim_names=None, comm=None, *, _cmesh=None):
        if _cmesh is None:
            if isinstance(mesh_shape, int):
                mesh_shape = (mesh_shape,)
            if isinstance(mesh_dim_names, str):
                mesh_dim_names = (mesh_dim_names,)
            handle = _comm_handle(comm)
            ensure_init()
            _cmesh = _C.DeviceMesh.create(
                [int(s) for s in mesh_shape], list(mesh_dim_names or ()), handle
            )
        self._c = _cmesh
        _live.append(weakref.ref(self))

    @classmethod
    def _from_c(cls, cmesh):
        for ref in list(_live):
            m = ref()
            if m is None:
                _live.remove(ref)
            elif m._c.same(cmesh):
                return m
        return cls(_cmesh=cmesh)

    # --- PyTorch DeviceMesh-style accessors (local) ---
    @property
    def shape(self):
        return tuple(self._c.shape)

    @property
    def mesh_shape(self):
        return self.shape

    @property
    def ndim(self):
        return self._c.ndim

    @property
    def mesh_dim_names(self):
        names = self._c.dim_names
        return tuple(names) if names else None

    def _dim(self, mesh_dim):
        if isinstance(mesh_dim, str):
            return self._c.dim_index(mesh_dim)
        return mesh_dim

    def size(self, mesh_dim=None):
        """Number of ranks in the mesh, or along one mesh dim (index or name)."""
        if mesh_dim is None:
            return self._c.size()
        return self._c.dim_size(self._dim(mesh_dim))

    def get_coordinate(self):
        """This rank's coordinate in the grid."""
        return list(self._c.coordinate())

    def get_local_rank(self, mesh_dim=None):
        """This rank's coordinate along one mesh dim (index or name)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError("get_local_rank() needs mesh_dim on a mesh with ndim > 1")
            mesh_dim = 0
        return self._c.coordinate()[self._dim(mesh_dim)]

    def get_rank(self):
        """This rank's rank in the mesh's communicator."""
        return self._c.rank()

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._c.same(other._c)

    def __hash__(self):
        return hash((self.shape, self.mesh_dim_names))

    def __repr__(self):
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh(shape={self.shape}{names})"


def init_device_mesh(*args, mesh_shape=None, mesh_dim_names=None, comm=None):
    """``init_device_mesh(shape, names)`` or PyTorch's ``init_device_mesh("cpu", shape,
    mesh_dim_names=names)``. Collective; see DeviceMesh."""
    args = list(args)
    if args and isinstance(args[0], str):
        device_type = args.pop(0)
        if device_type not in ("cpu",):
            raise ValueError(f"shardtensor runs on cpu tensors; got device_type={device_type!r}")
    if args:
        mesh_shape = args.pop(0)
    if args:
        mesh_dim_names = args.pop(0)
    if args:
        raise TypeError("init_device_mesh: too many arguments")
    return DeviceMesh(mesh_shape if mesh_shape is not None else (-1,), mesh_dim_names, comm)
