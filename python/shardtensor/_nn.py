"""distribute_module, backward and ring attention (C++ nn/ and ops/)."""

import torch

from . import _C
from ._tensor import _mesh_of, _wrap

__all__ = ["distribute_module", "backward", "grad", "scaled_dot_product_attention", "halo_exchange",
           "halo_exchange_begin", "halo_exchange_end"]


def distribute_module(module, device_mesh=None, partition_fn=None, input_fn=None, output_fn=None,
                      *, bucket_cap_mb=25, bucket_gradients=True):
    """Makes every rank's copy of ``module`` identical (parameters and buffers
    broadcast from mesh rank 0) and sums the parameters' gradients over the mesh
    in buckets during backward, so that after ``loss.backward()`` every
    ``p.grad`` equals the single-process gradient. Returns ``module``.

    Collective over the mesh. Raises on every rank if the ranks' modules differ
    (names, shapes, dtypes, requires_grad). ``partition_fn(name, submodule,
    mesh)``, ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs,
    mesh)`` behave as in PyTorch's distribute_module. C++: distribute_module.
    """
    mesh = _mesh_of(device_mesh)
    if partition_fn is not None:
        for name, sub in module.named_modules():
            partition_fn(name, sub, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    # names only feed the cross-rank fingerprint; C++ parameter names have no dots
    params = [(n.replace(".", "_"), p) for n, p in module.named_parameters()]
    buffers = [(n.replace(".", "_"), b) for n, b in module.named_buffers()]
    _C.distribute_module(params, buffers, mesh._c, int(bucket_cap_mb * (1 << 20)),
                         bool(bucket_gradients))
    return module


def backward(output, grad=None, retain_graph=None, create_graph=False):
    """Backward pass from any tensor, sharded or plain (``loss.backward()`` works
    for plain scalars; use this for non-scalar sharded outputs). ``grad`` is a
    ShardTensor with the output's layout, a plain tensor of the global shape, or
    None for a single-element output. ``retain_graph`` and ``create_graph`` as in
    torch.autograd.backward. Collective when ``output`` is sharded. Raises
    RuntimeError if ``grad`` does not match the output. C++: shardtensor::backward."""
    _C.backward(output, grad, retain_graph, bool(create_graph))


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=False):
    """torch.autograd.grad for ShardTensors and plain tensors alike: a tuple with
    d(outputs)/d(inputs), a ShardTensor laid out like each sharded input (Partial
    becomes Replicate), a plain tensor for a plain input, None for an unused one
    (with ``allow_unused``). ``grad_outputs``: None (single-element outputs) or
    one per output, each as for :func:`backward`. With ``create_graph=True`` the
    gradients are differentiable (gradient penalties, PINN residuals): second
    derivatives are exact. Collective (it runs a backward pass). Raises
    RuntimeError on every rank where double backward is not supported, naming
    the op. C++: shardtensor::grad."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if grad_outputs is None:
        grad_outputs = []
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs]
    else:
        grad_outputs = list(grad_outputs)
    if grad_outputs and len(grad_outputs) != len(outputs):
        raise ValueError(
            f"shardtensor.grad: got {len(grad_outputs)} grad_outputs for {len(outputs)} outputs"
        )
    res = _C.grad(outputs, inputs, grad_outputs, retain_graph, bool(create_graph),
                  bool(allow_unused))
    return tuple(_wrap(r) if r is not None else None for r in res)


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Attention ``softmax(q k^T * scale + mask) v`` on (..., L, E) tensors; with the
    sequence dim sharded it runs as ring attention (K/V blocks passed around the
    ring, online softmax), never gathering the sequence. Collective over the
    mesh dim that shards the sequence. Differentiable. C++:
    shardtensor::scaled_dot_product_attention."""
    return _wrap(_C.scaled_dot_product_attention(query, key, value, attn_mask, bool(is_causal),
                                                 None if scale is None else float(scale)))


def halo_exchange(tensor, dim, left, right, mode="constant", value=0.0):
    """This rank's local piece of ShardTensor ``tensor`` extended along ``dim`` by
    ``left``/``right`` elements from the neighbouring pieces (multi-hop when wider
    than a neighbour); at the global edge filled per ``mode`` ("constant",
    "reflect", "replicate", "circular"). Returns a plain local tensor connected to
    autograd. Collective over the mesh dim that shards ``dim`` (local if none).
    C++: shardtensor::halo_exchange."""
    return _C.halo_exchange(tensor, int(dim), int(left), int(right), str(mode), float(value))


def halo_exchange_begin(tensor, dim, left, right, mode="constant", value=0.0):
    """Split-phase :func:`halo_exchange` (like PETSc's DMGlobalToLocalBegin/End and
    AMReX's FillBoundary_nowait/_finish): posts the exchange and returns at once a
    pending exchange, so that the caller can compute on the interior of its piece
    while the halos travel::

        pending = st.halo_exchange_begin(u, 2, 1, 1)
        interior = stencil(u.to_local())          # overlaps the messages
        ext = st.halo_exchange_end(pending)       # == st.halo_exchange(u, 2, 1, 1)

    ``pending.test()`` drives MPI progress and says whether the halos arrived.
    Collective over the mesh dim that shards ``dim`` (every rank of it must begin,
    and then end, the same exchange); local if none. Raises RuntimeError as
    halo_exchange does, on every rank and before any message.
    C++: shardtensor::halo_exchange_begin."""
    return _C.halo_exchange_begin(tensor, int(dim), int(left), int(right), str(mode), float(value))


def halo_exchange_end(pending):
    """Waits for the exchange begun by :func:`halo_exchange_begin` and returns this
    rank's extended piece, exactly what :func:`halo_exchange` returns, with the same
    gradient (a plain local tensor connected to autograd). Raises RuntimeError if
    ``pending`` was already ended. C++: shardtensor::halo_exchange_end."""
    return pending.end()
