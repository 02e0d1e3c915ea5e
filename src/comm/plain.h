#pragma once
/// \file Plain collectives (private): non-differentiable moves of whole
/// tensors over every rank of a mesh, for the layers above comm/ that need
/// data but no gradient: the factories (tensor/: metadata records,
/// scatter_tensor) and distribute_module (nn/: one broadcast per dtype).
/// Counted in CommStats like the transport calls they wrap (Note [traffic
/// accounting]). Agreement on small records and errors is in comm/agree.h.

#include <ATen/core/Tensor.h>
#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>
#include <vector>

namespace shardtensor::comm {

/// Collective over every rank of `mesh`. Overwrites `t` (contiguous CPU, the
/// same number of bytes on every rank) with mesh rank `root`'s bytes. Throws
/// c10::Error on MPI failure.
void broadcast_(const at::Tensor& t, int root, const DeviceMesh& mesh);

/// Collective over every rank of `mesh`. Every rank contributes `mine`
/// (contiguous CPU, the same number of bytes on every rank); `all` (at least
/// size() * mine.nbytes() bytes) receives the pieces in mesh-rank order.
void all_gather_same(const at::Tensor& mine, const at::Tensor& all, const DeviceMesh& mesh);

/// Collective over every rank of `mesh`. Mesh rank `root` sends send_bytes[r]
/// consecutive bytes of `send` to mesh rank r, which receives them into
/// `recv` (recv.nbytes() bytes). `send` and `send_bytes` are read on the
/// root only.
void scatter_(const at::Tensor& send, const std::vector<int64_t>& send_bytes,
              const at::Tensor& recv, int root, const DeviceMesh& mesh);

}  // namespace shardtensor::comm
