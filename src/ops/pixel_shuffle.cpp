// pixel_shuffle / pixel_unshuffle on ShardTensors (Note [pixel shuffle blocks]).
//
// Note [pixel shuffle blocks]: pixel_shuffle(r) maps input element
// (c r^2 + i r + j, h, w) of the last three dims [C r^2, H, W] to output
// element (c, h r + i, w r + j); pixel_unshuffle(r) is its inverse. A piece
// whose channel range starts and ends on multiples of r^2 (shuffle), or whose
// H and W ranges start and end on multiples of r (unshuffle), therefore maps to
// one block of the output, and the plain libtorch op on the piece is exactly
// that block: no communication, output shard sizes scaled by r^2 or r. Leading
// (batch) dims are untouched, and a Partial input stays Partial (the op only
// moves elements). When a piece is not aligned, the input is first moved to
// the nearest aligned split (balanced blocks of whole r^2-channel groups or
// r-row groups, comm::repartition: point-to-point, at most one piece) and the
// op runs on that (no gather: every rank keeps about its share). An empty
// piece is reshaped instead (libtorch's backward, 1.13 and 2.13, mis-shapes
// the gradient of an empty pixel_shuffle). Backward is libtorch's backward of
// the local op, then the inverse of that move.
#include <ATen/ATen.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

void shuffle_rule(bool unshuffle, const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.operator_name().overload_name.empty()) {
    fail(op, args, "no sharding rule for this overload (use the functional form)");
  }
  const at::Tensor& self = args[0].toTensor();
  const ShardSpec* sp = spec_of(self);
  if (!sp) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  const ShardSpec& s = *sp;
  const int64_t r = int_arg(args[1]);
  const int64_t nd = s.ndim();
  if (nd < 3) fail(op, args, "the input must have at least 3 dims ([*, C, H, W])");
  if (r <= 0) fail(op, args, "the factor must be positive");
  const auto& g = s.global_shape();
  const int64_t c = nd - 3, h = nd - 2, w = nd - 1;
  if (!unshuffle && g[c] % (r * r) != 0) {
    fail(op, args, "the channel extent must be divisible by the factor squared");
  }
  if (unshuffle && (g[h] % r != 0 || g[w] % r != 0)) {
    fail(op, args, "the H and W extents must be divisible by the factor");
  }
  // The alignment unit of every tensor dim in the input.
  auto unit = [&](int64_t d) -> int64_t {
    if (unshuffle) return d == h || d == w ? r : 1;
    return d == c ? r * r : 1;
  };

  // The aligned input layout (metadata only: every rank computes the same).
  const DeviceMesh& mesh = s.mesh();
  Placements pl = s.placements();
  ShardSizes sizes(pl.size());
  for (size_t m = 0; m < pl.size(); ++m) {
    const auto* sh = std::get_if<Shard>(&pl[m]);
    if (!sh) continue;
    const int64_t d = sh->dim, u = unit(d);
    sizes[m] = s.shard_sizes(static_cast<int64_t>(m));
    const bool aligned =
        std::all_of(sizes[m].begin(), sizes[m].end(), [u](int64_t n) { return n % u == 0; });
    if (!aligned) {
      sizes[m] = balanced_sizes(g[d] / u, static_cast<int64_t>(sizes[m].size()));
      for (auto& n : sizes[m]) n *= u;
    }
  }
  SpecPtr in_spec = make_spec(mesh, pl, g, sizes);
  at::Tensor x = local_of(self);
  if (!(*in_spec == s)) x = detail::redistribute_local(x, s, *in_spec);

  // The output layout: the same placements, extents and sizes scaled.
  std::vector<int64_t> out_shape = g;
  auto scale = [&](int64_t d, int64_t n) -> int64_t {
    if (d == c) return unshuffle ? n * r * r : n / (r * r);
    if (d == h || d == w) return unshuffle ? n / r : n * r;
    return n;
  };
  for (int64_t d = 0; d < nd; ++d) out_shape[d] = scale(d, g[d]);
  for (size_t m = 0; m < pl.size(); ++m) {
    const auto* sh = std::get_if<Shard>(&pl[m]);
    if (!sh) continue;
    for (auto& n : sizes[m]) n = scale(sh->dim, n);
  }
  at::Tensor out;
  if (x.numel() == 0) {
    // An empty piece: libtorch's PixelShuffleBackward0 and
    // PixelUnshuffleBackward0 return a wrongly shaped gradient for empty
    // inputs (1.13 and 2.13: in 2.13 backward of pixel_shuffle([0, 8, 3, 3], 2)
    // raises "returned an invalid gradient at index 0 - got [0, 2, 6, 6] but
    // expected shape compatible with [0, 8, 3, 3]", and alike for an empty
    // channel or spatial dim and for pixel_unshuffle), so reshape instead (the
    // same empty result, with a backward that keeps the piece's shape).
    std::vector<int64_t> local_shape = x.sizes().vec();
    for (int64_t d = 0; d < nd; ++d) local_shape[d] = scale(d, local_shape[d]);
    out = x.reshape(local_shape);
  } else {
    out = unshuffle ? at::pixel_unshuffle(x, r) : at::pixel_shuffle(x, r);
  }
  stack->push_back(wrap(out, make_spec(mesh, pl, out_shape, sizes)));
}

const RuleRegistrar pixel_shuffle_ops({"pixel_shuffle"},
                                      [](const c10::OperatorHandle& op, Stack* st) {
                                        shuffle_rule(false, op, st);
                                      });
const RuleRegistrar pixel_unshuffle_ops({"pixel_unshuffle"},
                                        [](const c10::OperatorHandle& op, Stack* st) {
                                          shuffle_rule(true, op, st);
                                        });

}  // namespace
}  // namespace shardtensor::ops
