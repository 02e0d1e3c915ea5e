// topk along any dim (Note [distributed topk]).
//
// Note [distributed topk]: along a dim that no mesh dim shards, topk is local
// and the result keeps the input's layout (with extent k along that dim).
// Along a dim sharded by mesh dim m, every coordinate takes its local top
// min(k, n_c) candidates (values and global indices), the candidates are
// all-gathered over m (at most k per coordinate: k * P cross-sections, not the
// whole dim), and every rank selects the top k of the candidates. The result
// is Replicate on m (identical on every rank) and keeps the input's layout on
// the other mesh dims. Every rank computes the same function of the gathered
// candidates, so their gradient is the full gradient on every rank and
// all-gather's adjoint (a slice) hands each coordinate its candidates' part,
// which the local topk's backward scatters into the piece. Equal values may
// be returned in another order than libtorch's (ties are implementation
// defined there too).
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

void topk_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.operator_name().overload_name.empty()) {
    fail(op, args, "no sharding rule for this overload (use the functional form)");
  }
  const ShardSpec* sp = spec_of(args[0].toTensor());
  if (!sp) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  const ShardSpec s = without_partial(*sp);
  const int64_t k = int_arg(args[1]);
  const int64_t d = at::maybe_wrap_dim(args[2].toInt(), std::max<int64_t>(s.ndim(), 1));
  const bool largest = args[3].toBool();
  const bool sorted = args[4].toBool();
  const int64_t n = s.ndim() == 0 ? 1 : s.global_shape()[d];
  if (k < 0 || k > n) {
    fail(op, args,
         "k (" + std::to_string(k) + ") is out of range for dim " + std::to_string(d) +
             " of size " + std::to_string(n));
  }
  const int64_t m = s.ndim() == 0 ? -1 : s.mesh_dim_of(d);
  std::vector<int64_t> shape = s.global_shape();
  if (!shape.empty()) shape[d] = k;
  Placements p = s.placements();
  ShardSizes sizes = s.all_shard_sizes();
  if (m >= 0) {
    p[m] = Replicate{};
    sizes[m] = {};
  }
  SpecPtr out = make_spec(s.mesh(), p, shape, sizes);
  // Communication starts here.
  at::Tensor x = to_layout(args[0].toTensor(), s, s);
  if (m < 0) {
    auto [v, i] = at::topk(x, k, d, largest, sorted);
    stack->push_back(wrap(v, out));
    stack->push_back(wrap(i, out));
    return;
  }
  const auto& sz = s.shard_sizes(m);
  std::vector<int64_t> kk(sz.size());
  for (size_t c = 0; c < sz.size(); ++c) kk[c] = std::min(k, sz[c]);
  const int64_t me = s.mesh().coordinate()[m];
  auto [lv, li] = at::topk(x, kk[me], d, largest, /*sorted=*/true);
  li = li + s.local_offsets()[d];
  at::Tensor gv = comm::all_gather(lv, s.mesh(), m, d, kk);
  at::Tensor gi = comm::all_gather(li, s.mesh(), m, d, kk);
  auto [v, sel] = at::topk(gv, k, d, largest, sorted);
  stack->push_back(wrap(v, out));
  stack->push_back(wrap(gi.gather(d, sel), out));
}

const RuleRegistrar topk_ops({"topk"}, topk_rule);

}  // namespace
}  // namespace shardtensor::ops
