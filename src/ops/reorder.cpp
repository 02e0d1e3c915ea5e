// flip, roll (Note [reorder by repartition]) and tril/triu (Note [triangular
// with offsets]) on ShardTensors.
//
// Note [reorder by repartition]: along a dim that no mesh dim shards, flip and
// roll are local. Along a dim sharded by mesh dim m, every element keeps its
// owner's piece but moves to a new global index: flip maps the piece
// [off, off + n_c) (flipped locally) to the run [n - off - n_c, n - off); roll
// by s maps it to the runs starting at (off + s) mod n, split in two where it
// wraps. comm::repartition then moves the runs so that every coordinate again
// holds its original block (the input's shard sizes): point-to-point traffic
// of at most the piece, no gather. Its backward is the inverse repartition.
//
// Note [triangular with offsets]: tril/triu(k) keep element (i, j) of the last
// two dims when j - i <= k (tril) or >= k (triu). A piece whose first row and
// column sit at global (r0, c0) keeps local (i, j) when
// (j + c0) - (i + r0) compares with k, i.e. it applies tril/triu with
// k + r0 - c0 locally. No communication; a Partial input stays Partial (linear).
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

// Local piece `x` (layout `s`) whose element runs now belong at `runs[c]` on
// coordinate c along `d`: repartitioned back to s's sizes.
at::Tensor move_runs(const at::Tensor& x, const ShardSpec& s, int64_t d,
                     const std::vector<std::vector<comm::Segment>>& runs) {
  const int64_t m = s.mesh_dim_of(d);
  return comm::repartition(x, s.mesh(), m, d, runs, s.shard_sizes(m));
}

// The functional overload's `self` spec: out= and other overloads have no rule here.
const ShardSpec& functional_self_spec(const c10::OperatorHandle& op,
                                      const std::vector<c10::IValue>& args) {
  if (!op.operator_name().overload_name.empty()) {
    fail(op, args, "no sharding rule for this overload (use the functional form)");
  }
  return self_spec(op, args);
}

void flip_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = functional_self_spec(op, args);
  std::vector<int64_t> dims;
  for (int64_t d : int_list(args[1]))
    dims.push_back(at::maybe_wrap_dim(d, std::max<int64_t>(s.ndim(), 1)));
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end()) {
    fail(op, args, "dims has duplicates");
  }
  at::Tensor x = local_of(args[0].toTensor());
  if (!dims.empty()) x = at::flip(x, dims);
  for (int64_t d : dims) {
    const int64_t m = s.mesh_dim_of(d);
    if (m < 0) continue;
    const auto& sz = s.shard_sizes(m);
    const auto off = offsets_of(sz);
    const int64_t n = s.global_shape()[d];
    std::vector<std::vector<comm::Segment>> runs(sz.size());
    for (size_t c = 0; c < sz.size(); ++c) runs[c] = {{n - off[c] - sz[c], sz[c]}};
    x = move_runs(x, s, d, runs);
  }
  stack->push_back(wrap(x, spec_ptr_of(args[0].toTensor())));
}

void roll_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = functional_self_spec(op, args);
  const auto shifts = int_list(args[1]);
  const auto dims_in = int_list(args[2]);
  if (dims_in.empty()) {
    fail(op, args, "roll without dims (over the flattened tensor) is not supported; give dims");
  }
  if (shifts.size() != dims_in.size()) {
    fail(op, args, "shifts and dims must have the same length");
  }
  at::Tensor x = local_of(args[0].toTensor());
  for (size_t k = 0; k < dims_in.size(); ++k) {
    const int64_t d = at::maybe_wrap_dim(dims_in[k], s.ndim());
    const int64_t n = s.global_shape()[d];
    const int64_t m = s.mesh_dim_of(d);
    if (m < 0) {
      x = at::roll(x, {shifts[k]}, {d});
      continue;
    }
    if (n == 0) continue;
    const int64_t sh = ((shifts[k] % n) + n) % n;
    const auto& sz = s.shard_sizes(m);
    const auto off = offsets_of(sz);
    std::vector<std::vector<comm::Segment>> runs(sz.size());
    for (size_t c = 0; c < sz.size(); ++c) {
      if (sz[c] == 0) continue;
      const int64_t start = (off[c] + sh) % n;
      const int64_t first = std::min(sz[c], n - start);
      runs[c].push_back({start, first});
      if (first < sz[c]) runs[c].push_back({0, sz[c] - first});
    }
    x = move_runs(x, s, d, runs);
  }
  stack->push_back(wrap(x, spec_ptr_of(args[0].toTensor())));
}

void triangular_rule(bool upper, const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const ShardSpec& s = functional_self_spec(op, args);
  if (s.ndim() < 2) fail(op, args, "the input must have at least 2 dims");
  const int64_t k = args[1].toInt();
  const auto offs = s.local_offsets();
  const int64_t shifted = k + offs[s.ndim() - 2] - offs[s.ndim() - 1];
  at::Tensor x = local_of(args[0].toTensor());
  stack->push_back(
      wrap(upper ? at::triu(x, shifted) : at::tril(x, shifted), spec_ptr_of(args[0].toTensor())));
}

const RuleRegistrar flip_ops({"flip"}, flip_rule);
const RuleRegistrar roll_ops({"roll"}, roll_rule);
const RuleRegistrar triu_ops({"triu"}, [](const c10::OperatorHandle& op, Stack* s) {
  triangular_rule(true, op, s);
});
const RuleRegistrar tril_ops({"tril"}, [](const c10::OperatorHandle& op, Stack* s) {
  triangular_rule(false, op, s);
});

}  // namespace
}  // namespace shardtensor::ops
