// Sorting and selection: sort, argsort.stable, kthvalue, median, nanmedian,
// mode, quantile, nanquantile (Notes [select layout], [distributed
// selection], [selection ties], [sort gather]).
//
// Note [select layout]
// ~~~~~~~~~~~~~~~~~~~~
// Along a dim that no mesh dim of size > 1 shards (every other dim may be
// sharded, unevenly, with empty pieces), every op of this family is the plain
// libtorch call on the local piece: no communication, values and indices
// exactly libtorch's, gradients through libtorch's own backward on the piece.
// sort/argsort keep the input's layout; the reducing ops (kthvalue,
// median.dim, nanmedian.dim, mode, quantile with a dim) remove the dim (size 1
// with keepdim), renumber the remaining Shard dims (quantile with a 1-d q puts
// q's dim first) and make any mesh dim of size 1 that sharded the dim
// Replicate. Along a sharded dim, see Note [distributed selection] (kthvalue,
// median, nanmedian, quantile, nanquantile) and Note [sort gather] (sort,
// argsort, mode).
//
// Note [distributed selection]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// kthvalue, median.dim, nanmedian.dim, whole-tensor median()/nanmedian() and
// quantile/nanquantile along a sharded dim (mesh dim m; for the whole-tensor
// forms every mesh dim that shards the tensor) never gather that dim. Every
// element gets an order-preserving integer key: the IEEE bits of the value with
// the magnitude bits of negatives flipped (float16/bfloat16 are widened to
// float32 first, exactly; integers are their own key), -0.0 folded into +0.0
// and every NaN mapped to one key above +inf (libtorch orders NaN last). The
// key of rank r (0-based, per output position) is then found digit by digit
// from the top, as in a radix select: each round histograms, per output
// position, the w-bit digit of the local keys that match the digits decided so
// far, sums the histograms over the mesh dims (one all-reduce of 2^w int64
// counts per output position and rank asked for), and moves into the bin that
// holds rank r. w = 8 while the positions are few (at most 16: 4 rounds for
// 32-bit keys, 8 for 64-bit ones), else w = 4 (8 or 16 rounds, 16 counts per
// position and round), trading latency against bandwidth. All positions (and,
// for quantile, all requested ranks) share the rounds, so a call costs a
// fixed number of all-reduces of a few cross-sections, whatever the length of
// the dim, and O(local piece) memory (one key per element, int32 for 4-byte
// and narrower types). What is left of r at the end is the rank of the
// selected element among the elements equal to it (Note [selection ties]);
// an all-gather of the per-coordinate counts of equal keys (P cross-sections)
// tells the owning coordinate, which finds the element and contributes its
// global index and its raw bits to one all-reduce (every other coordinate
// contributes zeros), so the value is the element itself, bit for bit.
// NaN as libtorch: median.dim returns the first NaN of a position that has
// one (found with one all-reduce min of the first local NaN index);
// nanmedian.dim and nanmedian() select rank (n - nan_count - 1) / 2 among the
// non-NaN values (rank 0, a NaN, when all are NaN); kthvalue orders NaN last;
// median() is NaN when any element is. The rank of quantile is libtorch's
// (q * (n - 1), or the last index where a NaN is present; nanquantile:
// q * (count - 1) clamped at 0), rounded as `interpolation` says, and the
// result is libtorch's lerp of the values at floor and ceil of the rank.
// Gradients (Note [gradient carriers]): the value is computed outside autograd
// and replicated on the mesh dims it reduces, so every rank receives the full
// gradient and routes it locally: for the .dim forms and quantile to the
// selected element (a one-hot carrier on the owning rank; libtorch's backward
// scatters to the index too), for median()/nanmedian() evenly to every
// element equal to the result (libtorch's evenly_distribute_backward), with
// the tie count summed over the mesh. No communication in backward; the
// carriers are linear with constant weights, so second derivatives are zero,
// as libtorch's.
//
// Note [selection ties]
// ~~~~~~~~~~~~~~~~~~~~~
// Among equal values the selection takes them in global index order (the
// order of a stable sort). For median.dim and nanmedian.dim this is exactly
// libtorch's CPU rule (1.13 and 2.13: its nth_element compares (value,
// index); on 2.13 rechecked against the stable-sort position over 300 random
// rows of few distinct values, NaN and -0.0 included), so indices match
// libtorch. libtorch's kthvalue uses a quickselect whose choice
// among equal values is unspecified; ours returns the (k - 1 - #smaller)-th
// equal element in index order, always an element equal to the value, and the
// gradient goes to that element. -0.0 and +0.0 are equal, as in libtorch.
//
// Note [sort gather]
// ~~~~~~~~~~~~~~~~~~
// sort, argsort.stable and mode along a sharded dim gather that dim over its
// mesh dim (an all-gather of the piece: every rank then holds the whole
// extent of the dim, P times its piece, for the length of the call) and run
// libtorch's op on it; sort/argsort results are sliced back to the input's
// layout (the gather's adjoint), mode's result is Replicate on that mesh dim.
// Memory: the gathered slab (n along the dim times the local cross-section)
// plus libtorch's sort buffers; when that does not fit, shard another dim
// instead. The gather is visible (Note [visible gathers]): counted in
// CommStats::gathered_bytes, warned about once, refused in strict mode.
// A distributed sample sort would avoid it; it is not implemented.
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ops/carry_grad.h"
#include "ops/common.h"

namespace shardtensor::ops {
namespace {

constexpr int64_t kNoIndex = std::numeric_limits<int64_t>::max();

// ------------------------------------------------------------------ layout

// The parsed self/dim of a call.
struct Call {
  std::vector<c10::IValue> args;
  ShardSpec in;     // input layout, Partial summed
  at::Tensor self;  // the ShardTensor argument
  int64_t d = 0;    // wrapped dim (0 for a 0-d tensor)
  int64_t m = -1;   // mesh dim of size > 1 that shards d, or -1
  int64_t n = 1;    // global extent of d
};

Call parse(const c10::OperatorHandle& op, std::vector<c10::IValue> args, int64_t dim) {
  const ShardSpec& s = self_spec(op, args);
  Call c{std::move(args), without_partial(s), at::Tensor()};
  c.self = c.args[0].toTensor();
  c.d = wrap_dim(op, c.args, c.in.ndim(), dim);
  if (c.in.ndim() > 0) {
    c.n = c.in.global_shape()[c.d];
    const int64_t m = c.in.mesh_dim_of(c.d);
    if (m >= 0 && c.in.mesh().size(m) > 1) c.m = m;
  }
  return c;
}

// The layout of a result that reduces dim d of `in` (kept with size 1 when
// `keepdim`), with `lead` new leading dims of extents `lead_shape` (quantile's q).
SpecPtr reduced_spec(const ShardSpec& in, int64_t d, bool keepdim,
                     const std::vector<int64_t>& lead_shape = {}) {
  const DeviceMesh& mesh = in.mesh();
  const int64_t lead = static_cast<int64_t>(lead_shape.size());
  std::vector<int64_t> shape = lead_shape;
  for (int64_t e = 0; e < in.ndim(); ++e) {
    if (e != d) {
      shape.push_back(in.global_shape()[e]);
    } else if (keepdim) {
      shape.push_back(1);
    }
  }
  Placements p;
  ShardSizes sizes;
  for (int64_t mm = 0; mm < mesh.ndim(); ++mm) {
    const Placement& q = in.placements()[mm];
    if (is_shard(q) && shard_dim(q) != d) {
      const int64_t e = shard_dim(q);
      p.push_back(Shard{lead + ((e > d && !keepdim) ? e - 1 : e)});
      sizes.push_back(in.shard_sizes(mm));
    } else {
      p.push_back(is_shard(q) ? Placement(Replicate{}) : q);
      sizes.push_back({});
    }
  }
  return make_spec(mesh, std::move(p), std::move(shape), std::move(sizes));
}

// The input's local piece with Partial summed (collective on those mesh dims
// only when the input is Partial somewhere).
at::Tensor local_piece(const Call& c) { return to_layout(c.self, c.in, c.in); }

// Runs the op itself on the local piece and pushes every tensor result wrapped with `out`.
void run_local(const c10::OperatorHandle& op, const Call& c, const SpecPtr& out, Stack* stack) {
  Stack s = c.args;
  s[0] = local_piece(c);
  op.callBoxed(&s);
  for (auto& r : s) stack->push_back(r.isTensor() ? c10::IValue(wrap(r.toTensor(), out)) : r);
}

// ------------------------------------------------------------------ keys

// Note [distributed selection]: order-preserving integer keys, int64 for
// 8-byte element types, int32 (half the memory) for the others.
bool wide_keys(at::ScalarType t) { return c10::elementSize(t) == 8; }

at::Tensor order_keys(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  if (!at::isFloatingType(t)) return x.to(wide_keys(t) ? at::kLong : at::kInt);
  at::Tensor k;
  if (t == at::kDouble) {
    at::Tensor b = (x + 0.0).contiguous().view(at::kLong);  // + 0.0 folds -0.0 into +0.0
    k = at::where(b < 0, at::bitwise_xor(b, std::numeric_limits<int64_t>::max()), b);
    return k.masked_fill(x.isnan(), std::numeric_limits<int64_t>::max());
  }
  at::Tensor b = (x.to(at::kFloat) + 0.0).contiguous().view(at::kInt);
  k = at::where(b < 0, at::bitwise_xor(b, std::numeric_limits<int32_t>::max()), b);
  return k.masked_fill(x.isnan(), std::numeric_limits<int32_t>::max());
}

// The element values of `keys` (inverse of order_keys, NaN canonical).
at::Tensor from_keys(const at::Tensor& k, at::ScalarType t) {
  if (!at::isFloatingType(t)) return k.to(t);
  if (t == at::kDouble) {
    at::Tensor b = at::where(k < 0, at::bitwise_xor(k, std::numeric_limits<int64_t>::max()), k);
    return b.contiguous().view(at::kDouble).clone();
  }
  at::Tensor ki = k.to(at::kInt);
  at::Tensor b = at::where(ki < 0, at::bitwise_xor(ki, std::numeric_limits<int32_t>::max()), ki);
  return b.contiguous().view(at::kFloat).to(t);
}

// Raw bits of values as int64 (so that a sum with zeros moves them exactly), and back.
at::Tensor to_bits(const at::Tensor& v) {
  switch (v.element_size()) {
    case 8:
      return v.contiguous().view(at::kLong);
    case 4:
      return v.contiguous().view(at::kInt).to(at::kLong);
    case 2:
      return v.contiguous().view(at::kShort).to(at::kLong);
    default:
      return v.to(at::kLong);  // 1-byte integers: the value itself
  }
}
at::Tensor from_bits(const at::Tensor& b, at::ScalarType t) {
  switch (c10::elementSize(t)) {
    case 8:
      return b.contiguous().view(t).clone();
    case 4:
      return b.to(at::kInt).contiguous().view(t).clone();
    case 2:
      return b.to(at::kShort).contiguous().view(t).clone();
    default:
      return b.to(t);
  }
}

// ------------------------------------------------------------------ selection

// The rows of a selection: the local piece with the selected dim last, as
// (R, n_local); `mdims` the mesh dims over which the dim is split.
struct Rows {
  at::Tensor x;     // (R, n_local), detached, contiguous
  at::Tensor keys;  // (R, n_local) int64
  int64_t offset = 0;
  const DeviceMesh* mesh = nullptr;
  std::vector<int64_t> mdims;
  int64_t m = -1;  // the single mesh dim (index resolution), -1 for whole-tensor
};

at::Tensor counts_over(const at::Tensor& c, const Rows& r) {
  return comm::all_reduce_nograd(c.contiguous(), *r.mesh, r.mdims, ReduceOp::Sum);
}

// Note [distributed selection]: digit width of the radix select. Wide digits
// mean fewer rounds (latency) but 2^w counts per position and round
// (bandwidth): 8 bits while the positions are few, 4 bits otherwise. J and R
// are the same on every rank of the reducing communicator, so all agree.
int digit_bits(int64_t J, int64_t R) { return J * R <= 16 ? 8 : 4; }

// Note [distributed selection]. rank: (J, R) int64, 0-based, within [0, n).
// Returns the selected keys (J, R, key dtype) and what is left of the rank
// (the rank among equal keys). One all-reduce of (J, R, 2^w) counts per
// digit, from the top; the top digit has its sign bit flipped so that digits
// order like the signed keys.
std::pair<at::Tensor, at::Tensor> radix_select(const Rows& r, at::Tensor rank, int bits) {
  const int64_t J = rank.size(0), R = r.keys.size(0);
  const int w = digit_bits(J, R);
  const int64_t bins = int64_t{1} << w;
  const at::ScalarType st =
      R * bins < std::numeric_limits<int32_t>::max() ? r.keys.scalar_type() : at::kLong;
  const at::Tensor row_base = at::arange(R, r.keys.options().dtype(st)).unsqueeze(1) * bins;
  at::Tensor prefix = at::zeros_like(rank);  // decided bits, as a signed int64 value
  for (int shift = bits - w; shift >= 0; shift -= w) {
    const bool top = shift == bits - w;
    // (R, n): the bin of every key, row by row.
    at::Tensor slot = at::bitwise_and(at::bitwise_right_shift(r.keys, shift), bins - 1).to(st);
    if (top) slot.bitwise_xor_(bins / 2);
    slot.add_(row_base);
    std::vector<at::Tensor> hs;
    for (int64_t j = 0; j < J; ++j) {
      at::Tensor sel = slot;
      if (!top) {
        at::Tensor high = at::bitwise_right_shift(prefix[j], shift + w).to(r.keys.scalar_type());
        sel = slot.masked_select(at::bitwise_right_shift(r.keys, shift + w) == high.unsqueeze(1));
      }
      hs.push_back(at::bincount(sel.reshape({-1}), {}, R * bins).view({R, bins}));
    }
    at::Tensor hist = counts_over(at::stack(hs), r);  // (J, R, bins)
    at::Tensor cum = hist.cumsum(2);
    at::Tensor d = (cum <= rank.unsqueeze(2)).sum(2);  // the digit of the rank's key
    at::Tensor before = at::where(
        d > 0, cum.gather(2, (d - 1).clamp_min(0).unsqueeze(2)).squeeze(2), at::zeros_like(d));
    rank = rank - before;
    // The top digit is signed: d - bins/2 after the flip.
    prefix = prefix + (top ? d - bins / 2 : d) * (int64_t{1} << shift);
  }
  return {prefix.to(r.keys.scalar_type()), rank};
}

struct Selected {
  at::Tensor value;  // (J, R), the element's own bits
  at::Tensor index;  // (J, R), global index along the dim
  at::Tensor hit;    // (J, R, n_local) bool: the selected element, on its owner
};

// The element of key `key` (J, R) that has `rem` equal keys before it in
// global index order: its owner, global index and value (one all-gather of
// per-coordinate counts and one all-reduce). Without a single mesh dim
// (r.m < 0, whole-tensor quantile) any equal element: the first one of the
// lowest mesh rank that holds one, and no index.
Selected resolve(const Rows& r, const at::Tensor& key, const at::Tensor& rem) {
  const int64_t J = key.size(0), R = r.x.size(0), n = r.x.size(1);
  at::Tensor eq = r.keys.unsqueeze(0) == key.unsqueeze(2);  // (J, R, n)
  at::Tensor c = eq.sum(2);                                 // (J, R)
  at::Tensor q, owner;
  if (r.m >= 0) {
    const int64_t P = r.mesh->size(r.m);
    const int64_t me = r.mesh->coordinate()[r.m];
    at::Tensor all_c = comm::all_gather(c.unsqueeze(0).contiguous(), *r.mesh, r.m, 0,
                                        std::vector<int64_t>(static_cast<size_t>(P), 1));
    q = rem - all_c.narrow(0, 0, me).sum(0);  // occurrence on this coordinate
    owner = at::logical_and(q >= 0, q < c);
  } else {
    // Whole-tensor (several mesh dims, no index): the first equal element of
    // the lowest mesh rank that holds one.
    const int64_t me = r.mesh->rank();
    at::Tensor cand =
        at::where(c > 0, at::full({}, me, c.options()), at::full({}, kNoIndex, c.options()));
    cand = comm::all_reduce_nograd(cand.contiguous(), *r.mesh, r.mdims, ReduceOp::Min);
    owner = cand == me;
    q = at::zeros_like(c);
  }
  Selected s;
  s.hit = at::logical_and(
      eq, at::logical_and(at::cumsum(eq, 2, at::kInt) == (q + 1).unsqueeze(2), owner.unsqueeze(2)));
  at::Tensor li = n > 0 ? s.hit.to(at::kInt).argmax(2) : at::zeros({J, R}, c.options());
  at::Tensor bits =
      n > 0 ? to_bits(r.x.unsqueeze(0).expand({J, R, n}).gather(2, li.unsqueeze(2))).squeeze(2)
            : at::zeros({J, R}, c.options());
  at::Tensor zero = at::zeros({}, c.options());
  at::Tensor packed =
      at::stack({at::where(owner, li + r.offset, zero), at::where(owner, bits, zero)});
  packed = counts_over(packed, r);
  s.index = packed[0];
  s.value = from_bits(packed[1], r.x.scalar_type());
  return s;
}

// The rows of `local` (detached) along d, reduced over mesh dim m.
Rows rows_along(const at::Tensor& local, int64_t d, const ShardSpec& in, int64_t m) {
  Rows r;
  at::Tensor xt = local.detach().movedim(d, -1).contiguous();
  const int64_t n = xt.size(-1);
  const int64_t R =
      n > 0 ? xt.numel() / n : c10::multiply_integers(xt.sizes().slice(0, xt.dim() - 1));
  r.x = xt.reshape({R, n});
  r.keys = order_keys(r.x);
  r.offset = in.local_offsets()[d];
  r.mesh = &in.mesh();
  r.mdims = {m};
  r.m = m;
  return r;
}

// A (J, R) result of the rows back to the local layout with keepdim: (J, ..., 1 at d, ...).
at::Tensor unrows(const at::Tensor& v, const at::Tensor& local, int64_t d) {
  std::vector<int64_t> shape = local.sizes().vec();
  shape.erase(shape.begin() + d);
  shape.insert(shape.begin(), v.size(0));
  shape.push_back(1);
  return v.reshape(shape).movedim(-1, d + 1);
}

// The gradient carrier of selected elements (Note [gradient carriers]): the
// selected element on its owner, 0 elsewhere; shape (J, R).
at::Tensor one_hot_carrier(const at::Tensor& local, int64_t d, const at::Tensor& hit) {
  at::Tensor xt = local.movedim(d, -1);
  const int64_t n = xt.size(-1);
  const int64_t R = hit.size(1);
  at::Tensor rows = xt.reshape({1, R, n});
  return at::where(hit, rows, at::zeros({}, rows.options())).sum(2);
}

int key_bits(at::ScalarType t) { return wide_keys(t) ? 64 : 32; }

void check_select_dtype(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                        const char* family, const at::Tensor& self,
                        const std::function<at::Tensor(const at::Tensor&)>& call) {
  const at::ScalarType t = self.scalar_type();
  if (t == at::kBool || at::isComplexType(t)) {
    fail(op, args, std::string("no sharding rule for dtype ") + c10::toString(t));
  }
  check_dtype_support(op, args, family, {t}, false, [&](c10::ArrayRef<at::ScalarType> d, bool rg) {
    return call(probe_ones({3}, d[0], rg));
  });
}

// kthvalue / median.dim / nanmedian.dim along a sharded dim.
enum class Pick { Kth, Median, NanMedian };

void select_dim(const c10::OperatorHandle& op, const Call& c, Pick pick, int64_t k, bool keepdim,
                Stack* stack) {
  const char* family =
      pick == Pick::Kth ? "kthvalue" : (pick == Pick::Median ? "median" : "nanmedian");
  check_select_dtype(op, c.args, family, c.self, [&](const at::Tensor& t) {
    return pick == Pick::Kth ? std::get<0>(at::kthvalue(t, 1, 0))
                             : (pick == Pick::Median ? std::get<0>(at::median(t, 0))
                                                     : std::get<0>(at::nanmedian(t, 0)));
  });
  SpecPtr out = reduced_spec(c.in, c.d, keepdim);
  // Communication starts here.
  at::Tensor local = local_piece(c);
  Rows r = rows_along(local, c.d, c.in, c.m);
  const bool grad_mode = at::GradMode::is_enabled();
  at::NoGradGuard no_grad;
  const int64_t R = r.x.size(0);
  auto lopt = r.keys.options().dtype(at::kLong);
  at::Tensor rank;
  at::Tensor first_nan;
  if (pick == Pick::Kth) {
    rank = at::full({1, R}, k - 1, lopt);
  } else if (pick == Pick::Median) {
    rank = at::full({1, R}, (c.n - 1) / 2, lopt);
    if (at::isFloatingType(r.x.scalar_type())) {  // the same on every rank
      at::Tensor first = at::full({1, R}, kNoIndex, lopt);
      if (r.x.size(1) > 0) {
        at::Tensor pos = at::arange(r.x.size(1), lopt) + r.offset;
        first = at::where(r.x.isnan(), pos, at::full({}, kNoIndex, lopt)).amin(1).unsqueeze(0);
      }
      first_nan = comm::all_reduce_nograd(first.contiguous(), *r.mesh, r.mdims, ReduceOp::Min);
    }
  } else {
    at::Tensor nans = counts_over(r.x.isnan().sum(1).unsqueeze(0), r);
    // (n - nan - 1) / 2 with C++ division (rank 0 when every value is NaN).
    rank = at::div(c.n - nans - 1, 2, "trunc");
  }
  auto [key, rem] = radix_select(r, rank, key_bits(r.x.scalar_type()));
  Selected s = resolve(r, key, rem);
  at::Tensor value = s.value, index = s.index, hit = s.hit;
  if (first_nan.defined()) {
    // A position with a NaN: its first NaN (libtorch's median.dim).
    at::Tensor has = first_nan != kNoIndex;
    value = at::where(has, at::full({}, std::numeric_limits<double>::quiet_NaN(), value.options()),
                      value);
    index = at::where(has, first_nan, index);
    at::Tensor pos = at::arange(r.x.size(1), lopt) + r.offset;
    at::Tensor nan_hit =
        at::logical_and(pos.view({1, 1, -1}) == first_nan.unsqueeze(2), has.unsqueeze(2));
    hit = at::where(has.unsqueeze(2), nan_hit, hit);
  }
  at::Tensor v = unrows(value, local, c.d).squeeze(0);
  at::Tensor i = unrows(index, local, c.d).squeeze(0);
  {
    at::AutoGradMode grad(grad_mode);
    v = carry_grad(v, local,
                   [&] { return unrows(one_hot_carrier(local, c.d, hit), local, c.d).squeeze(0); });
    if (!keepdim && local.dim() > 0) {
      v = v.squeeze(c.d);
      i = i.squeeze(c.d);
    }
  }
  stack->push_back(wrap(v, out));
  stack->push_back(wrap(i, out));
}

// median() / nanmedian() of a tensor sharded over some mesh dims: a plain
// result, identical on every rank.
void median_all(const c10::OperatorHandle& op, Stack* stack, bool ignore_nan) {
  auto args = pop_args(op, stack);
  const ShardSpec in = without_partial(self_spec(op, args));
  const at::Tensor self = args[0].toTensor();
  const DeviceMesh& mesh = in.mesh();
  std::vector<int64_t> mdims;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (is_shard(in.placements()[m]) && mesh.size(m) > 1) mdims.push_back(m);
  }
  if (mdims.empty() || in.numel() == 0) {
    // Every rank holds the whole tensor (or there is none: NaN, as libtorch).
    Stack s{to_layout(self, in, in)};
    op.callBoxed(&s);
    stack->push_back(std::move(s[0]));
    return;
  }
  const char* family = ignore_nan ? "nanmedian" : "median";
  check_select_dtype(op, args, family, self, [&](const at::Tensor& t) {
    return ignore_nan ? at::nanmedian(t) : at::median(t);
  });
  // Communication starts here.
  at::Tensor local = to_layout(self, in, in);
  Rows r;
  r.x = local.detach().reshape({1, -1});
  r.keys = order_keys(r.x);
  r.mesh = &mesh;
  r.mdims = mdims;
  const bool grad_mode = at::GradMode::is_enabled();
  at::NoGradGuard no_grad;
  const at::ScalarType t = r.x.scalar_type();
  at::Tensor nans = counts_over(r.x.isnan().sum(1).unsqueeze(0), r);  // (1, 1)
  const int64_t n = in.numel();
  at::Tensor rank = ignore_nan ? at::div(n - nans - 1, 2, "trunc")
                               : at::full({1, 1}, (n - 1) / 2, r.keys.options().dtype(at::kLong));
  at::Tensor key = radix_select(r, rank, key_bits(t)).first;
  if (!ignore_nan && at::isFloatingType(t)) {
    // libtorch: NaN when any element is NaN.
    const int64_t nan_key =
        order_keys(at::full({1}, std::numeric_limits<double>::quiet_NaN(), r.x.options()))
            .item<int64_t>();
    key = at::where(nans > 0, at::full({}, nan_key, key.options()), key);
  }
  at::Tensor value = from_keys(key, t).reshape({});
  {
    at::AutoGradMode grad(grad_mode);
    // libtorch's evenly_distribute_backward: the gradient is shared by every
    // element equal to the result (every NaN when it is NaN).
    value = carry_grad(value, local, [&] {
      at::Tensor mask = (r.keys == key).reshape(local.sizes());
      at::Tensor count = counts_over(mask.sum().reshape({1, 1}), r).reshape({});
      return at::where(mask, local, at::zeros({}, local.options())).sum() / count.to(t);
    });
  }
  stack->push_back(value);
}

// sort / argsort.stable / mode along a sharded dim (Note [sort gather]).
void gather_dim(const c10::OperatorHandle& op, const Call& c, const char* name, bool reduces,
                bool keepdim, Stack* stack) {
  const DeviceMesh& mesh = c.in.mesh();
  Placements p = c.in.placements();
  ShardSizes sizes = c.in.all_shard_sizes();
  p[c.m] = Replicate{};
  sizes[c.m] = {};
  const ShardSpec full(mesh, p, c.in.global_shape(), sizes);
  note_gather(op, c.args, mesh, gathered_bytes(c.in, full, c.self.element_size()),
              std::string(name) + " along a sharded dim gathers that dim (Note [sort gather])");
  // Communication starts here.
  Stack s = c.args;
  s[0] = to_layout(c.self, full, full);
  op.callBoxed(&s);
  const SpecPtr out =
      reduces ? reduced_spec(c.in, c.d, keepdim) : std::make_shared<const ShardSpec>(c.in);
  for (auto& r : s) {
    if (!r.isTensor()) {
      stack->push_back(r);
      continue;
    }
    at::Tensor t = r.toTensor();
    if (!reduces) t = comm::shard_slice(t, mesh, c.m, c.d, c.in.shard_sizes(c.m));
    stack->push_back(wrap(t, out));
  }
}

void check_nonempty_dim(const c10::OperatorHandle& op, const Call& c, const char* name) {
  if (c.in.ndim() > 0 && c.n == 0) {
    fail(op, c.args,
         std::string(name) + "(): Expected reduction dim " + std::to_string(c.d) +
             " to have non-zero size");
  }
}

// sort(self, dim, descending) / sort.stable(self, *, stable, dim, descending)
// / argsort.stable(self, *, stable, dim, descending).
void sort_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const bool named = !op.operator_name().overload_name.empty();  // .stable: dim after `stable`
  const int64_t dim = args[named ? 2 : 1].toInt();
  Call c = parse(op, std::move(args), dim);
  if (c.m < 0) return run_local(op, c, std::make_shared<const ShardSpec>(c.in), stack);
  gather_dim(op, c, op.operator_name().name == "aten::argsort" ? "argsort" : "sort", false, false,
             stack);
}

// kthvalue(self, k, dim, keepdim).
void kthvalue_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const int64_t k = int_arg(args[1]);
  const int64_t dim = args[2].toInt();
  const bool keepdim = args[3].toBool();
  Call c = parse(op, std::move(args), dim);
  if (k < 1 || k > c.n) {
    fail(op, c.args,
         "kthvalue(): selected number k (" + std::to_string(k) + ") out of range for dim " +
             std::to_string(c.d) + " of size " + std::to_string(c.n));
  }
  if (c.m < 0) return run_local(op, c, reduced_spec(c.in, c.d, keepdim), stack);
  select_dim(op, c, Pick::Kth, k, keepdim, stack);
}

// median.dim / nanmedian.dim(self, dim, keepdim).
void median_dim_rule(const c10::OperatorHandle& op, Stack* stack, bool ignore_nan) {
  auto args = pop_args(op, stack);
  const int64_t dim = args[1].toInt();
  const bool keepdim = args[2].toBool();
  Call c = parse(op, std::move(args), dim);
  check_nonempty_dim(op, c, ignore_nan ? "nanmedian" : "median");
  if (c.m < 0) return run_local(op, c, reduced_spec(c.in, c.d, keepdim), stack);
  select_dim(op, c, ignore_nan ? Pick::NanMedian : Pick::Median, 0, keepdim, stack);
}

// mode(self, dim, keepdim).
void mode_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const int64_t dim = args[1].toInt();
  const bool keepdim = args[2].toBool();
  Call c = parse(op, std::move(args), dim);
  check_nonempty_dim(op, c, "mode");
  if (c.m < 0) return run_local(op, c, reduced_spec(c.in, c.d, keepdim), stack);
  gather_dim(op, c, "mode", true, keepdim, stack);
}

// quantile / nanquantile (self, q, dim?, keepdim, *, interpolation), q a
// plain tensor (0-d or 1-d) or a float (.scalar).
enum class Interp { Linear, Lower, Higher, Midpoint, Nearest };

void quantile_rule(const c10::OperatorHandle& op, Stack* stack, bool ignore_nan) {
  auto args = pop_args(op, stack);
  const ShardSpec in = without_partial(self_spec(op, args));
  const at::Tensor self = args[0].toTensor();
  const char* name = ignore_nan ? "nanquantile" : "quantile";
  const std::string pre = std::string(name) + "(): ";
  const at::ScalarType t = self.scalar_type();
  if (in.numel() == 0) fail(op, args, pre + "input tensor must be non-empty");
  if (t != at::kFloat && t != at::kDouble) {
    fail(op, args, pre + "input tensor must be either float or double dtype");
  }
  at::Tensor q;
  if (args[1].isTensor()) {
    q = args[1].toTensor();
    if (spec_of(q)) fail(op, args, pre + "q must be a plain tensor (identical on every rank)");
    if (q.dim() > 1) fail(op, args, pre + "q must be a scalar or 1D tensor");
    if (q.scalar_type() != t)
      fail(op, args, pre + "q tensor must be same dtype as the input tensor");
    if (!at::logical_and(q >= 0, q <= 1).all().item<bool>()) {
      fail(op, args, pre + "q values must be in the range [0, 1]");
    }
  } else {
    const double qs = args[1].toDouble();
    if (!(qs >= 0 && qs <= 1)) {
      fail(op, args, pre + "q must be in the range [0, 1] but got " + std::to_string(qs));
    }
    q = at::scalar_tensor(qs, at::TensorOptions().dtype(t));
  }
  const std::string how = args[4].toStringRef();
  Interp interp;
  if (how == "linear") {
    interp = Interp::Linear;
  } else if (how == "lower") {
    interp = Interp::Lower;
  } else if (how == "higher") {
    interp = Interp::Higher;
  } else if (how == "midpoint") {
    interp = Interp::Midpoint;
  } else if (how == "nearest") {
    interp = Interp::Nearest;
  } else {
    fail(op, args,
         pre + "interpolation must be one of linear, lower, higher, midpoint or nearest. Got " +
             how);
  }
  const bool keepdim = args[3].toBool();
  const bool has_dim = !args[2].isNone();
  const int64_t nq = q.numel();
  const std::vector<int64_t> lead = q.dim() > 0 ? std::vector<int64_t>{nq} : std::vector<int64_t>{};
  const DeviceMesh& mesh = in.mesh();
  int64_t d = 0, m = -1;
  std::vector<int64_t> mdims;
  if (has_dim) {
    d = wrap_dim(op, args, in.ndim(), args[2].toInt());
    const int64_t mm = in.ndim() > 0 ? in.mesh_dim_of(d) : -1;
    if (mm >= 0 && mesh.size(mm) > 1) {
      m = mm;
      mdims = {m};
    }
  } else {
    for (int64_t mm = 0; mm < mesh.ndim(); ++mm) {
      if (is_shard(in.placements()[mm]) && mesh.size(mm) > 1) mdims.push_back(mm);
    }
  }
  // Communication starts here.
  at::Tensor local = to_layout(self, in, in);
  if (mdims.empty()) {
    // Note [select layout]: libtorch's op on the piece. A piece with no
    // element (another dim's shard is empty) gives an empty result.
    SpecPtr out = has_dim ? reduced_spec(in, d, keepdim, lead) : nullptr;
    at::Tensor r;
    if (local.numel() > 0) {
      Stack s = args;
      s[0] = local;
      op.callBoxed(&s);
      r = s[0].toTensor();
    } else {
      TORCH_INTERNAL_ASSERT(out, "an empty piece of an unsharded tensor");
      r = at::zeros(out->local_shape(), local.options()) + local.sum() * 0;
    }
    stack->push_back(out ? wrap(r, out) : r);
    return;
  }
  Rows rows;
  int64_t n = 0;
  if (has_dim) {
    rows = rows_along(local, d, in, m);
    n = in.global_shape()[d];
  } else {
    rows.x = local.detach().reshape({1, -1});
    rows.keys = order_keys(rows.x);
    rows.mesh = &mesh;
    rows.mdims = mdims;
    n = in.numel();
  }
  const bool grad_mode = at::GradMode::is_enabled();
  at::Tensor value, hit, weights;
  {
    at::NoGradGuard no_grad;
    // libtorch's ranks (quantile_compute, 1.13 and 2.13: on 2.13 these ranks,
    // gathered from the sorted rows and lerped, reproduce quantile and
    // nanquantile bit for bit for every interpolation), element by element.
    at::Tensor nans = counts_over(rows.x.isnan().sum(1).unsqueeze(0), rows);  // (1, R)
    at::Tensor qv = q.reshape({-1, 1});
    at::Tensor ranks;
    if (ignore_nan) {
      ranks = qv * (n - nans - 1);
      ranks = ranks.masked_fill(ranks < 0, 0);
    } else {
      ranks = at::masked_fill(qv * (n - 1), nans > 0, n - 1);
    }
    if (interp == Interp::Lower) ranks = ranks.floor();
    if (interp == Interp::Higher) ranks = ranks.ceil();
    if (interp == Interp::Nearest) ranks = ranks.round();
    at::Tensor below = ranks.to(at::kLong);
    at::Tensor want = below;
    if (interp == Interp::Linear || interp == Interp::Midpoint) {
      weights = interp == Interp::Midpoint ? at::full_like(ranks, 0.5) : ranks - below;
      want = at::cat({below, ranks.ceil().to(at::kLong)});
    }
    auto [key, rem] = radix_select(rows, want.contiguous(), key_bits(t));
    Selected sel = resolve(rows, key, rem);
    value = sel.value;
    hit = sel.hit;
  }
  at::Tensor out;
  {
    at::AutoGradMode grad(grad_mode);
    at::Tensor flat = has_dim ? local : local.reshape({-1});
    at::Tensor v =
        carry_grad(value, local, [&] { return one_hot_carrier(flat, has_dim ? d : 0, hit); });
    out = weights.defined() ? at::lerp(v.narrow(0, 0, nq), v.narrow(0, nq, nq), weights) : v;
    if (has_dim) {
      out = unrows(out, local, d);  // (nq, ..., 1 at d + 1, ...)
      if (!keepdim) out = out.squeeze(d + 1);
      if (q.dim() == 0) out = out.squeeze(0);
    } else {
      std::vector<int64_t> shape = lead;
      if (keepdim) shape.resize(shape.size() + in.ndim(), 1);
      out = out.reshape(shape);
    }
  }
  stack->push_back(has_dim ? wrap(out, reduced_spec(in, d, keepdim, lead)) : out);
}

// "name." is the overload without a name only (ops/registry.h); the out= and
// Dimname overloads keep their handling.
const RuleRegistrar r_sort({"sort.", "sort.stable", "argsort.stable"}, sort_rule);
const RuleRegistrar r_kthvalue({"kthvalue."}, kthvalue_rule);
const RuleRegistrar r_median_dim({"median.dim"}, [](const c10::OperatorHandle& op, Stack* s) {
  median_dim_rule(op, s, false);
});
const RuleRegistrar r_nanmedian_dim({"nanmedian.dim"}, [](const c10::OperatorHandle& op, Stack* s) {
  median_dim_rule(op, s, true);
});
const RuleRegistrar r_median({"median."}, [](const c10::OperatorHandle& op, Stack* s) {
  median_all(op, s, false);
});
const RuleRegistrar r_nanmedian({"nanmedian."}, [](const c10::OperatorHandle& op, Stack* s) {
  median_all(op, s, true);
});
const RuleRegistrar r_mode({"mode."}, mode_rule);
const RuleRegistrar r_quantile({"quantile.", "quantile.scalar"},
                               [](const c10::OperatorHandle& op, Stack* s) {
                                 quantile_rule(op, s, false);
                               });
const RuleRegistrar r_nanquantile({"nanquantile.", "nanquantile.scalar"},
                                  [](const c10::OperatorHandle& op, Stack* s) {
                                    quantile_rule(op, s, true);
                                  });

}  // namespace
}  // namespace shardtensor::ops
