// Agreement collectives (Note [collective discipline], comm/agree.h): built on
// the transport's all-reduce, all-gatherv and broadcast of small int64 buffers.
#include "comm/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "comm/transport.h"

namespace shardtensor::comm {

namespace {

at::Tensor as_tensor(const std::vector<int64_t>& v) {
  return at::tensor(c10::ArrayRef<int64_t>(v), at::kLong).contiguous();
}

std::vector<int64_t> as_vector(const at::Tensor& t) {
  const auto* p = t.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + t.numel());
}

void all_reduce(const DeviceMesh& mesh, std::vector<int64_t>& values, ReduceOp op) {
  if (values.empty()) return;
  auto t = as_tensor(values);
  transport::all_reduce_(t, op, mesh.comm());
  values = as_vector(t);
}

}  // namespace

bool all_ok(const DeviceMesh& mesh, bool ok) {
  std::vector<int64_t> bad{ok ? 0 : 1};
  all_reduce(mesh, bad, ReduceOp::Max);
  return bad[0] == 0;
}

void check_all(const DeviceMesh& mesh, bool ok, const std::string& what,
               const std::string& message) {
  // The lowest failing rank (or size() when none failed) in one all-reduce.
  const int64_t none = mesh.size();
  std::vector<int64_t> first{ok ? none : static_cast<int64_t>(mesh.rank())};
  all_reduce(mesh, first, ReduceOp::Min);
  if (first[0] == none) return;
  const int root = static_cast<int>(first[0]);
  std::vector<int64_t> bytes;
  if (mesh.rank() == root) bytes.assign(message.begin(), message.end());
  bytes = broadcast_record(mesh, bytes, root);
  std::string text(bytes.begin(), bytes.end());
  TORCH_CHECK(false, what, ": ", text, " (reported by mesh rank ", root, ")");
}

std::vector<std::vector<int64_t>> all_gather_records(const DeviceMesh& mesh,
                                                     const std::vector<int64_t>& record) {
  const int64_t p = mesh.size();
  // Lengths first, then the records concatenated in rank order.
  auto len_all = at::empty({p}, at::kLong);
  transport::all_gatherv(at::tensor({static_cast<int64_t>(record.size())}, at::kLong), len_all,
                         std::vector<int64_t>(p, sizeof(int64_t)), mesh.comm());
  std::vector<int64_t> lens = as_vector(len_all);
  int64_t total = 0;
  std::vector<int64_t> bytes(p);
  for (int64_t c = 0; c < p; ++c) {
    total += lens[c];
    bytes[c] = lens[c] * static_cast<int64_t>(sizeof(int64_t));
  }
  auto all = at::empty({total}, at::kLong);
  transport::all_gatherv(record.empty() ? at::empty({0}, at::kLong) : as_tensor(record), all, bytes,
                         mesh.comm());
  std::vector<std::vector<int64_t>> out(p);
  const auto* a = all.data_ptr<int64_t>();
  int64_t off = 0;
  for (int64_t c = 0; c < p; ++c) {
    out[c].assign(a + off, a + off + lens[c]);
    off += lens[c];
  }
  return out;
}

std::vector<int64_t> broadcast_record(const DeviceMesh& mesh, const std::vector<int64_t>& record,
                                      int root) {
  const bool me = mesh.rank() == root;
  auto len = at::tensor({me ? static_cast<int64_t>(record.size()) : int64_t{0}}, at::kLong);
  transport::broadcast_(len, root, mesh.comm());
  const int64_t n = len.item<int64_t>();
  auto data = me ? as_tensor(record) : at::empty({n}, at::kLong);
  if (n > 0) transport::broadcast_(data, root, mesh.comm());
  return as_vector(data);
}

void all_reduce_max(const DeviceMesh& mesh, std::vector<int64_t>& values) {
  all_reduce(mesh, values, ReduceOp::Max);
}

void all_reduce_sum(const DeviceMesh& mesh, std::vector<int64_t>& values) {
  all_reduce(mesh, values, ReduceOp::Sum);
}

void barrier(const DeviceMesh& mesh) {
  std::vector<int64_t> token{0};
  all_reduce(mesh, token, ReduceOp::Max);
}

CacheAgreement agree_cache_reuse(const DeviceMesh& mesh, bool ok, std::optional<int64_t> hit_stamp,
                                 int64_t next_stamp) {
  const bool hit = hit_stamp.has_value();
  std::vector<int64_t> v = {ok ? 0 : 1, hit ? 0 : 1, hit ? *hit_stamp : -1, hit ? -*hit_stamp : 1,
                            next_stamp};
  all_reduce_max(mesh, v);
  CacheAgreement a;
  a.all_ok = v[0] == 0;
  a.reuse = v[1] == 0 && v[2] == -v[3];
  a.stamp = v[4];
  return a;
}

}  // namespace shardtensor::comm
