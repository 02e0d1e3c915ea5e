"""Parallel HDF5 reads and writes, and sharded checkpoints (C++ shardtensor::io).

Every rank reads only its own hyperslab of a global dataset, straight into its
local piece; writes are collective, each rank writing its hyperslab; the files
are ordinary HDF5 (h5py, h5dump and NetCDF-4 readers see them). See
docs/io.md for the file layout and docs/python.md for the Python API.

    import shardtensor as st
    mesh = st.DeviceMesh(mesh_shape=(-1,))
    u = st.io.read_hdf5("run.h5", "fields/u", mesh, [st.Shard(1)])   # a ShardTensor
    st.io.write_hdf5("out.h5", "fields/u2", u * 2, units="K")
    st.io.save_checkpoint("ckpt", mesh, {"u": u}, model=model, optimizer=opt, step=10)
    ck = st.io.load_checkpoint("ckpt", mesh, {"u": [st.Shard(2)]}, model=model, optimizer=opt)

Every function here is collective over the mesh's ranks unless it says local,
and raises (RuntimeError / ValueError from C++) on every rank, naming the file
and the dataset, when it fails on one (Note [io errors] in C++).
"""

import collections
import json

import torch

from . import _C
from ._mesh import DeviceMesh
from ._tensor import ShardTensor, _mesh_of, _placements_tuple, _shard_sizes, _wrap
from .placement import _from_codes, _to_codes

__all__ = [
    "read_hdf5", "read_hdf5_with_halo", "write_hdf5", "read_hdf5_info", "save_checkpoint",
    "load_checkpoint", "checkpoint_exists", "io_stats", "reset_io_stats", "HaloRead",
    "DatasetInfo", "Checkpoint",
]

HaloRead = collections.namedtuple("HaloRead", "tensor with_halo halo_left halo_right")
HaloRead.__doc__ = """read_hdf5_with_halo's result (C++ io::HaloRead, Note [halo read layout]):
``tensor`` the ShardTensor without halo; ``with_halo`` a plain local tensor, this
rank's piece extended by ``halo_left[d]`` / ``halo_right[d]`` along each dim d,
exactly as halo_exchange would give it."""

DatasetInfo = collections.namedtuple(
    "DatasetInfo", "shape dtype placements mesh_shape torch_dtype units")
DatasetInfo.__doc__ = "read_hdf5_info's result: the dataset's shape, default dtype and attributes."

Checkpoint = collections.namedtuple("Checkpoint", "tensors step saved_mesh_shape")
Checkpoint.__doc__ = """load_checkpoint's result: ``tensors`` (dict name -> tensor: a
ShardTensor where a layout was given, plain otherwise), ``step``, and the shape
of the mesh that saved it."""


def _selection(select):
    """``select``: None, or a sequence with one entry per dataset dim, each a
    ``slice(start, stop)`` (step 1) or a ``(start, count)`` pair (count -1: to the end)."""
    if select is None:
        return None, None
    start, count = [], []
    for s in select:
        if isinstance(s, slice):
            if s.step not in (None, 1):
                raise ValueError(f"shardtensor.io: a selection slice must have step 1, got {s}")
            b = 0 if s.start is None else int(s.start)
            if b < 0:
                raise ValueError(f"shardtensor.io: a selection slice must start at >= 0, got {s}")
            start.append(b)
            count.append(-1 if s.stop is None else int(s.stop) - b)
        else:
            b, c = s
            start.append(int(b))
            count.append(int(c))
    return start, count


def _dtype_like(dtype):
    return None if dtype is None else torch.empty(0, dtype=dtype)


def _codes_sizes(placements, sharding_shapes):
    placements = _placements_tuple(placements)
    return _to_codes(placements), _shard_sizes(sharding_shapes, placements)


def read_hdf5(path, dataset, device_mesh=None, placements=None, *, sharding_shapes=None,
              dtype=None, select=None, transfer="collective"):
    """Reads dataset ``dataset`` of the HDF5 file ``path`` as a ShardTensor on
    ``device_mesh`` with ``placements`` (Shard/Replicate, one per mesh dim;
    default all Replicate): each rank reads exactly its hyperslab.
    ``sharding_shapes`` gives uneven or empty pieces (as ShardTensor.from_local),
    ``dtype`` converts (floating-point datasets only to floating-point dtypes),
    ``select`` reads a box (one ``slice`` or ``(start, count)`` per dataset dim;
    the box's shape becomes the global shape), ``transfer`` is ``"collective"``
    or ``"independent"`` MPI-IO. Collective over the mesh. C++: io::read_hdf5."""
    mesh = _mesh_of(device_mesh)
    if placements is None:
        placements = (_from_codes([(1, 0)])[0],) * mesh.ndim
    codes, sizes = _codes_sizes(placements, sharding_shapes)
    start, count = _selection(select)
    return _wrap(_C.io_read_hdf5(str(path), dataset, mesh._c, codes, sizes, _dtype_like(dtype),
                                 start, count, transfer))


def read_hdf5_with_halo(path, dataset, device_mesh, placements, halo, *, halo_mode="zeros",
                        sharding_shapes=None, dtype=None, select=None, transfer="collective"):
    """Like read_hdf5, and each rank also reads its ghost cells from the file:
    ``halo[d]`` elements on both sides along every dataset dim d. Past the edge of
    the (selected) domain they follow ``halo_mode``: ``"none"`` (shorter there),
    ``"zeros"``, ``"replicate"`` or ``"circular"``. Returns a HaloRead. Collective
    over the mesh. C++: io::read_hdf5_with_halo."""
    mesh = _mesh_of(device_mesh)
    codes, sizes = _codes_sizes(placements, sharding_shapes)
    start, count = _selection(select)
    t, with_halo, left, right = _C.io_read_hdf5_with_halo(
        str(path), dataset, mesh._c, codes, [int(h) for h in halo], halo_mode, sizes,
        _dtype_like(dtype), start, count, transfer)
    return HaloRead(_wrap(t), with_halo, tuple(left), tuple(right))


def write_hdf5(path, dataset, tensor, *, mesh=None, chunks=None, units="", overwrite=True,
               truncate=False, transfer="collective"):
    """Creates (or replaces) ``dataset`` in ``path`` with the global value of
    ``tensor``: a ShardTensor (each rank writes its hyperslab; Partial is summed
    first), or a plain tensor with the same value on every rank of ``mesh`` (mesh
    rank 0 writes; without a mesh the calling process writes alone, local).
    ``chunks``: chunk shape (None: contiguous). Attributes written: units (when
    given), global_shape, placements, mesh_shape, torch_dtype. Collective over
    the tensor's mesh (or ``mesh``). C++: io::write_hdf5."""
    m = None if mesh is None else _mesh_of(mesh)._c
    _C.io_write_hdf5(str(path), dataset, tensor, m, [int(c) for c in (chunks or [])], units,
                     bool(overwrite), bool(truncate), transfer)


def read_hdf5_info(path, dataset, device_mesh=None):
    """Shape, default dtype and attributes of a dataset; reads no data. Collective
    over the mesh. C++: io::read_hdf5_info."""
    d = _C.io_read_hdf5_info(str(path), dataset, _mesh_of(device_mesh)._c)
    return DatasetInfo(tuple(d["shape"]), d["dtype_like"].dtype, d["placements"],
                       tuple(d["mesh_shape"]), d["torch_dtype"], d["units"])


def checkpoint_exists(path):
    """True if ``path`` holds a complete checkpoint. Local."""
    return _C.io_checkpoint_exists(str(path))


def io_stats():
    """This rank's I/O counters since the last reset: dict with bytes_read,
    bytes_written, reads, writes. Local."""
    return _C.io_stats()


def reset_io_stats():
    """Local."""
    _C.reset_io_stats()


# ---- checkpoints ---------------------------------------------------------------------
#
# Note [python checkpoint names]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Python checkpoint is a C++ checkpoint (Note [checkpoint layout]) whose named
# tensors are: the user's tensors under their own names; a model's parameters
# and buffers under "model/<state_dict key>" (ShardTensors as one global dataset
# each, plain ones written once); an optimizer's tensor state under
# "optimizer/state/<param index>/<key>"; and "optimizer/meta", a uint8 tensor
# holding JSON: the param_groups (hyper-parameters; "params" are indices) and
# each state entry's non-tensor values, shapes and whether it was sharded. On
# load, a sharded model or optimizer tensor takes the layout of the parameter it
# belongs to in the *loading* model, so each rank reads only what it will own,
# whatever the saving layout was.

_MODEL = "model/"
_OPT = "optimizer/state/"
_OPT_META = "optimizer/meta"


def _layout_of(t):
    return (_C.placements(t), _C.shard_sizes(t))


def _model_tensors(model):
    out = []
    for name, p in model.named_parameters():
        out.append((name, p))
    for name, b in model.named_buffers():
        if b is not None:
            out.append((name, b))
    return out


def _opt_params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def save_checkpoint(path, device_mesh, tensors=None, *, model=None, optimizer=None, step=0):
    """Writes a checkpoint directory ``path``: the named ``tensors`` (dict name ->
    ShardTensor on ``device_mesh`` or plain tensor with the same value on every
    rank), ``model``'s parameters and buffers, ``optimizer``'s state and
    ``step`` (Note [python checkpoint names]). Crash-safe: a checkpoint already
    in ``path`` is replaced only when the new one is complete. Collective over
    the mesh. C++: io::save_checkpoint."""
    mesh = _mesh_of(device_mesh)
    named = []
    for name, t in (tensors or {}).items():
        if name.startswith(_MODEL) or name.startswith("optimizer/"):
            raise ValueError(f"shardtensor.io.save_checkpoint: tensor name '{name}' is reserved "
                             "(model/..., optimizer/...)")
        named.append((name, t))
    if model is not None:
        named += [(_MODEL + n, t) for n, t in _model_tensors(model)]
    if optimizer is not None:
        sd = optimizer.state_dict()
        meta = {"param_groups": sd["param_groups"], "state": {}}
        for idx, entry in sd["state"].items():
            m = {"tensors": {}, "values": {}}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    named.append((f"{_OPT}{idx}/{k}", v))
                    m["tensors"][k] = {"shape": list(v.shape),
                                       "sharded": isinstance(v, ShardTensor)}
                else:
                    m["values"][k] = v
            meta["state"][str(idx)] = m
        try:
            blob = json.dumps(meta).encode()
        except TypeError as e:
            raise TypeError(f"shardtensor.io.save_checkpoint: the optimizer's state_dict has a "
                            f"value JSON cannot hold: {e}") from None
        named.append((_OPT_META, torch.tensor(list(blob), dtype=torch.uint8)))
    _C.io_save_checkpoint(str(path), mesh._c, named, int(step))


def load_checkpoint(path, device_mesh, layouts=None, *, model=None, optimizer=None):
    """Loads the checkpoint in ``path`` onto ``device_mesh`` (any shape or rank
    count). ``layouts``: dict name -> placements, or name -> (placements,
    sharding_shapes); a named tensor without a layout comes back whole on every
    rank. With ``model``, its parameters and buffers are overwritten in place
    (a ShardTensor parameter keeps its own layout and reads only its piece);
    with ``optimizer``, its state is loaded (built over the model's parameters,
    in the order it was saved). Returns a Checkpoint (tensors, step,
    saved_mesh_shape). Collective over the mesh. C++: io::load_checkpoint."""
    mesh = _mesh_of(device_mesh)
    lay = {}
    for name, spec in (layouts or {}).items():
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (list, tuple)):
            placements, shapes = spec
        else:
            placements, shapes = spec, None
        lay[name] = _codes_sizes(placements, shapes)
    model_params = _model_tensors(model) if model is not None else []
    for name, t in model_params:
        if isinstance(t, ShardTensor):
            lay[_MODEL + name] = _layout_of(t)
    meta = None
    if optimizer is not None:
        # The small meta record first (Note [checkpoint layout]: tensors/<name> in
        # <path>/checkpoint.h5), to know the state's layouts before the big read.
        meta = _read_meta(path, mesh)
        params = _opt_params(optimizer)
        for idx, m in meta["state"].items():
            p = params[int(idx)] if int(idx) < len(params) else None
            for k, info in m["tensors"].items():
                if info["sharded"] and isinstance(p, ShardTensor) and \
                        list(p.shape) == info["shape"]:
                    lay[f"{_OPT}{idx}/{k}"] = _layout_of(p)
    tensors, step, saved_mesh = _C.io_load_checkpoint(str(path), mesh._c, lay)
    tensors = {k: _wrap(v) for k, v in tensors.items()}
    if model is not None:
        _load_model(path, model_params, tensors)
    if optimizer is not None:
        state = {}
        for idx, m in meta["state"].items():
            entry = dict(m["values"])
            for k in m["tensors"]:
                entry[k] = tensors[f"{_OPT}{idx}/{k}"]
            state[int(idx)] = entry
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    user = {k: v for k, v in tensors.items()
            if not (k.startswith(_MODEL) or k.startswith("optimizer/"))}
    return Checkpoint(user, int(step), tuple(saved_mesh))


def _read_meta(path, mesh):
    # read_hdf5 agrees on failure (a missing file on one rank raises on all).
    f = f"{path}/checkpoint.h5"
    rep = [(1, 0)] * mesh.ndim
    try:
        raw = _C.io_read_hdf5(f, "tensors/" + _OPT_META, mesh._c, rep, None, None, None, None,
                              "collective")
    except RuntimeError as e:
        raise RuntimeError(f"shardtensor.io.load_checkpoint: '{path}' holds no optimizer state "
                           f"(saved without optimizer=?): {e}") from None
    return json.loads(bytes(_C.local(raw).tolist()).decode())


def _load_model(path, model_params, tensors):
    missing = [n for n, _ in model_params if _MODEL + n not in tensors]
    if missing:
        raise RuntimeError(f"shardtensor.io.load_checkpoint: '{path}' has no saved value for "
                           f"the model's {', '.join(missing)}")
    with torch.no_grad():
        for name, t in model_params:
            v = tensors[_MODEL + name]
            if tuple(v.shape) != tuple(t.shape):
                raise RuntimeError(f"shardtensor.io.load_checkpoint: the model's '{name}' has "
                                   f"shape {tuple(t.shape)}, the checkpoint's {tuple(v.shape)}")
            if isinstance(t, ShardTensor):
                t.to_local().copy_(v.to_local())
            else:
                t.copy_(v.to(t.dtype))
