// Repartition, all-to-all and box exchange (shardtensor/comm/primitives.h):
// the plans (comm/repartition.h: RepartitionPlan, AllToAllPlan,
// BoxExchangePlan, built once from metadata, run many times, inverted for the
// adjoint) and the differentiable primitives comm::repartition,
// comm::all_to_all and comm::box_exchange on them. Data moves through the
// transport's all-to-allv.
#include "comm/repartition.h"
#include "comm/function_output.h"
#include "comm/plan_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "comm/transport.h"

namespace shardtensor::comm {

using namespace internal;

namespace {

/// Intersections of `src` and `dst` runs, in increasing global order (so that
/// the sender and the receiver, computing this independently, agree).
std::vector<Piece> intersect(const std::vector<Segment>& src, const std::vector<Segment>& dst) {
  std::vector<Piece> out;
  int64_t s_loc = 0;
  for (const auto& s : src) {
    int64_t d_loc = 0;
    for (const auto& d : dst) {
      const int64_t a = std::max(s.start, d.start);
      const int64_t b = std::min(s.start + s.length, d.start + d.length);
      if (a < b) {
        out.push_back({a, b - a, s_loc + a - s.start, d_loc + a - d.start});
      }
      d_loc += d.length;
    }
    s_loc += s.length;
  }
  std::sort(out.begin(), out.end(),
            [](const Piece& x, const Piece& y) { return x.global < y.global; });
  return out;
}

int64_t layout_extent(const std::vector<Segment>& runs) {
  int64_t n = 0;
  for (const auto& s : runs) {
    n += s.length;
  }
  return n;
}

/// The transport's all-to-allv with counts and displacements in units of
/// `unit` bytes (rows or elements).
void all_to_all_units(const at::Tensor& send, const std::vector<int64_t>& send_n,
                      const std::vector<int64_t>& send_displ, const at::Tensor& recv,
                      const std::vector<int64_t>& recv_n, const std::vector<int64_t>& recv_displ,
                      int64_t unit, Comm comm) {
  auto bytes = [unit](const std::vector<int64_t>& v) {
    std::vector<int64_t> out(v.size());
    for (size_t c = 0; c < v.size(); ++c) out[c] = v[c] * unit;
    return out;
  };
  transport::all_to_allv(send, bytes(send_n), bytes(send_displ), recv, bytes(recv_n),
                         bytes(recv_displ), comm);
}

}  // namespace

// ---- RepartitionPlan ------------------------------------------------------------

RepartitionPlan::RepartitionPlan(Axis axis, int64_t dim, Layout src, Layout dst)
    : axis_(std::move(axis)), dim_(dim), src_(std::move(src)), dst_(std::move(dst)) {
  axis_.mesh = DeviceMesh();  // a cached plan must not keep a mesh alive (only its comm is used)
  const int64_t P = axis_.size, me = axis_.me;
  sends_.resize(P);
  recvs_.resize(P);
  send_rows_.assign(P, 0);
  recv_rows_.assign(P, 0);
  for (int64_t c = 0; c < P; ++c) {
    sends_[c] = intersect(src_[me], dst_[c]);
    recvs_[c] = intersect(src_[c], dst_[me]);
    if (c == me) {
      continue;  // local copies
    }
    for (const auto& p : sends_[c]) {
      send_rows_[c] += p.len;
    }
    for (const auto& p : recvs_[c]) {
      recv_rows_[c] += p.len;
    }
  }
  send_displ_ = exclusive_offsets(send_rows_);
  recv_displ_ = exclusive_offsets(recv_rows_);
  out_rows_ = layout_extent(dst_[me]);
}

at::Tensor RepartitionPlan::run(const at::Tensor& local) const {
  const int64_t P = axis_.size, me = axis_.me, dim = dim_;
  const auto& sends = sends_;
  const auto& recvs = recvs_;
  const auto& send_rows = send_rows_;
  const auto& recv_rows = recv_rows_;
  const auto& send_displ = send_displ_;
  const auto& recv_displ = recv_displ_;
  const int64_t row_bytes = row_numel(local.sizes(), dim) * local.element_size();
  at::Tensor in_rows = local.movedim(dim, 0);
  at::Tensor out = at::empty(shape_with(local.sizes(), dim, out_rows_), local.options());
  at::Tensor out_rows = out.movedim(dim, 0);
  at::Tensor send = at::empty(rows_shape(local.sizes(), dim, sum_of(send_rows)), local.options());
  at::Tensor recv = at::empty(rows_shape(local.sizes(), dim, sum_of(recv_rows)), local.options());
  for (int64_t c = 0; c < P; ++c) {
    if (c == me) {
      continue;
    }
    int64_t at_row = send_displ[c];
    for (const auto& p : sends[c]) {
      send.narrow(0, at_row, p.len).copy_(in_rows.narrow(0, p.src_local, p.len));
      at_row += p.len;
    }
  }
  for (const auto& p : sends[me]) {
    out_rows.narrow(0, p.dst_local, p.len).copy_(in_rows.narrow(0, p.src_local, p.len));
  }
  all_to_all_units(send, send_rows, send_displ, recv, recv_rows, recv_displ, row_bytes, axis_.comm);
  for (int64_t c = 0; c < P; ++c) {
    if (c == me) {
      continue;
    }
    int64_t at_row = recv_displ[c];
    for (const auto& p : recvs[c]) {
      out_rows.narrow(0, p.dst_local, p.len).copy_(recv.narrow(0, at_row, p.len));
      at_row += p.len;
    }
  }
  return out;
}

// ---- AllToAllPlan -----------------------------------------------------------------

AllToAllPlan::AllToAllPlan(Axis axis, int64_t src_dim, std::vector<int64_t> src_sizes,
                           int64_t dst_dim, std::vector<int64_t> dst_sizes)
    : axis_(std::move(axis)),
      src_dim_(src_dim),
      dst_dim_(dst_dim),
      src_sizes_(std::move(src_sizes)),
      dst_sizes_(std::move(dst_sizes)) {
  axis_.mesh = DeviceMesh();  // a cached plan must not keep a mesh alive (only its comm is used)
  src_off_ = exclusive_offsets(src_sizes_);
  dst_off_ = exclusive_offsets(dst_sizes_);
}

at::Tensor AllToAllPlan::run(const at::Tensor& input) const {
  const at::Tensor local = transport::send_buffer(input);
  const int64_t P = axis_.size, me = axis_.me;
  const int64_t src_dim = src_dim_, dst_dim = dst_dim_;
  const auto& src_sizes = src_sizes_;
  const auto& dst_sizes = dst_sizes_;
  const auto& src_off = src_off_;
  const auto& dst_off = dst_off_;
  const int64_t elem = local.element_size();
  // Piece for/from coordinate c: (src extent, dst extent) = (src_sizes[me], dst_sizes[c]) out,
  // (src_sizes[c], dst_sizes[me]) in; the other dims are shared.
  int64_t common = 1;
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (d != src_dim && d != dst_dim) {
      common *= local.size(d);
    }
  }
  std::vector<int64_t> send_numel(P), recv_numel(P);
  for (int64_t c = 0; c < P; ++c) {
    send_numel[c] = c == me ? 0 : common * src_sizes[me] * dst_sizes[c];
    recv_numel[c] = c == me ? 0 : common * src_sizes[c] * dst_sizes[me];
  }
  const auto send_displ = exclusive_offsets(send_numel);
  const auto recv_displ = exclusive_offsets(recv_numel);
  at::Tensor send = at::empty({sum_of(send_numel)}, local.options());
  at::Tensor recv = at::empty({sum_of(recv_numel)}, local.options());
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || send_numel[c] == 0) {
      continue;
    }
    at::Tensor piece = local.narrow(dst_dim, dst_off[c], dst_sizes[c]);
    send.narrow(0, send_displ[c], send_numel[c]).view(piece.sizes()).copy_(piece);
  }
  at::Tensor out = at::empty(
      shape_with(shape_with(local.sizes(), src_dim, sum_of(src_sizes)), dst_dim, dst_sizes[me]),
      local.options());
  // Own piece: a local copy.
  out.narrow(src_dim, src_off[me], src_sizes[me])
      .copy_(local.narrow(dst_dim, dst_off[me], dst_sizes[me]));
  all_to_all_units(send, send_numel, send_displ, recv, recv_numel, recv_displ, elem, axis_.comm);
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || recv_numel[c] == 0) {
      continue;
    }
    at::Tensor dst = out.narrow(src_dim, src_off[c], src_sizes[c]);
    dst.copy_(recv.narrow(0, recv_displ[c], recv_numel[c]).view(dst.sizes()));
  }
  return out;
}

// Note [repartition plan cache]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// RepartitionPlan and AllToAllPlan depend only on metadata: the mesh dim's
// communicator, its size, this coordinate, the tensor dim(s) and the layouts
// (runs per coordinate, or the src/dst sizes). Building one intersects this
// coordinate's runs with every other coordinate's (O(P) or more), so they are
// cached by that key like halo and box plans (Notes [halo plan cache], [box
// exchange plan cache]; comm/plan_cache.h: at most 512 plans each, cleared
// when full). The key starts with the Comm handle's bits, so a plan is
// never reused on another communicator. The element type and the extents of
// the other tensor dims are not in the key: run() derives the row and element
// sizes from the tensor it is given. The adjoint's plan (inverse(): the same
// layouts swapped) comes from the same cache, so a training step builds no
// plan in steady state, forward or backward. A cached plan keeps only the
// communicator handle, not the DeviceMesh (a plan must not keep a mesh's
// communicators alive). comm::repartition looks its plan up before
// validating: a plan found was made from these very arguments, which passed
// the O(P log P) tiling check then, so only the local tensor is checked.
//
// Measured (bench/comm_plans.cpp, `shardtensor_bench_comm_plans plan`: the
// plan step alone, fastest of 20 interleaved rounds; 2 shared cores, load
// 10-22): [64, 64] with rows dealt round-robin in blocks of 2 (32 runs) to
// balanced blocks, P = 4: building a RepartitionPlan 0.8-6.0 us, finding it
// 0.36-0.45 us; P = 16: 1.3 vs 0.6 us; [1024, 1024] (512 runs), P = 16:
// 114 vs 84 us (the key holds every run, so it is linear in the runs as the
// plan is). AllToAllPlan is two prefix sums: 0.10 us built, 0.12-0.19 us
// found (a wash). End to end (`... repartition`, 1000 calls on [64, 64],
// P = 4 oversubscribed, load 15) a call costs 0.5-0.8 ms before and after:
// the all-to-allv and the agreement among descheduled ranks dominate, and
// the few microseconds saved are below the noise.
namespace {

PlanCache<RepartitionPlan>& repartition_plans() {
  static auto* c = new PlanCache<RepartitionPlan>();  // never destroyed (plans may be used at exit)
  return *c;
}

PlanCache<AllToAllPlan>& all_to_all_plans() {
  static auto* c = new PlanCache<AllToAllPlan>();  // never destroyed (plans may be used at exit)
  return *c;
}

std::vector<int64_t> axis_key(const Axis& a) { return {comm_key_bits(a.comm), a.size, a.me}; }

void add_layout(std::vector<int64_t>& key, const Layout& layout) {
  key.push_back(static_cast<int64_t>(layout.size()));
  for (const auto& runs : layout) {
    key.push_back(static_cast<int64_t>(runs.size()));
    for (const auto& s : runs) {
      key.push_back(s.start);
      key.push_back(s.length);
    }
  }
}

void add_sizes(std::vector<int64_t>& key, const std::vector<int64_t>& sizes) {
  key.push_back(static_cast<int64_t>(sizes.size()));
  key.insert(key.end(), sizes.begin(), sizes.end());
}

}  // namespace

namespace {

std::vector<int64_t> repartition_plan_key(const Axis& axis, int64_t dim, const Layout& src,
                                          const Layout& dst) {
  std::vector<int64_t> key = axis_key(axis);
  key.push_back(dim);
  add_layout(key, src);
  add_layout(key, dst);
  return key;
}

}  // namespace

std::shared_ptr<const RepartitionPlan> cached_repartition_plan(const Axis& axis, int64_t dim,
                                                               const Layout& src,
                                                               const Layout& dst) {
  auto key = repartition_plan_key(axis, dim, src, dst);
  if (auto plan = repartition_plans().find(key)) return plan;
  auto plan = std::make_shared<const RepartitionPlan>(axis, dim, src, dst);
  repartition_plans().insert(std::move(key), plan);
  return plan;
}

std::shared_ptr<const AllToAllPlan> cached_all_to_all_plan(const Axis& axis, int64_t src_dim,
                                                           const std::vector<int64_t>& src_sizes,
                                                           int64_t dst_dim,
                                                           const std::vector<int64_t>& dst_sizes) {
  std::vector<int64_t> key = axis_key(axis);
  key.push_back(src_dim);
  add_sizes(key, src_sizes);
  key.push_back(dst_dim);
  add_sizes(key, dst_sizes);
  if (auto plan = all_to_all_plans().find(key)) return plan;
  auto plan = std::make_shared<const AllToAllPlan>(axis, src_dim, src_sizes, dst_dim, dst_sizes);
  all_to_all_plans().insert(std::move(key), plan);
  return plan;
}

std::shared_ptr<const RepartitionPlan> RepartitionPlan::inverse() const {
  return cached_repartition_plan(axis_, dim_, dst_, src_);
}

std::shared_ptr<const AllToAllPlan> AllToAllPlan::inverse() const {
  return cached_all_to_all_plan(axis_, dst_dim_, dst_sizes_, src_dim_, src_sizes_);
}

size_t repartition_plan_cache_size() { return repartition_plans().size(); }

size_t all_to_all_plan_cache_size() { return all_to_all_plans().size(); }

// ---- BoxExchangePlan ----------------------------------------------------------------

// Note [box exchange]
// ~~~~~~~~~~~~~~~~~~~
// comm::box_exchange moves N-d boxes among the ranks that share this rank's
// coordinates on the mesh dims that are not involved (the sub-communicator of
// the involved mesh dims). Coordinate c holds the box src[c] and wants dst[c]
// (per tensor dim a global run [start, start + length)). The message from c
// to k is the box src[c] & dst[k] (the per-dim intersection of the runs), so
// every element moves once, straight from where it is to where it goes: the
// rank sends sum_{k != me} |src[me] & dst[k]| <= |src[me]| elements (its
// piece, less what stays) and receives at most |dst[me]|. Both sides compute
// the same intersection box and copy it in the same (row-major) order, so
// the payload needs no headers; the part that stays (src[me] & dst[me]) is a
// local copy. One all-to-allv over the group carries all messages. The
// adjoint is the same exchange with src and dst swapped (the inverse plan),
// run as the same Function under create_graph (Note [differentiable
// adjoints]). A one-mesh-dim exchange whose boxes shard src_dim and dst_dim
// is all_to_all(); several mesh dims at once is what a cycle of Shard ->
// Shard transitions needs (Note [shard-dim swap] in tensor/shard_tensor.cpp).

namespace {

int64_t box_volume(const Box& b) {
  int64_t n = 1;
  for (const auto& r : b) {
    n *= r.length;
  }
  return n;
}

/// The per-dim intersection of two boxes of the same rank (a run of length 0
/// where they do not meet).
Box box_and(const Box& a, const Box& b) {
  Box out(a.size());
  for (size_t d = 0; d < a.size(); ++d) {
    const int64_t lo = std::max(a[d].start, b[d].start);
    const int64_t hi = std::min(a[d].start + a[d].length, b[d].start + b[d].length);
    out[d] = Segment{lo, std::max<int64_t>(hi - lo, 0)};
  }
  return out;
}

/// The view of `t` (which holds the box `own`) at the global box `part` (inside `own`).
at::Tensor box_view(const at::Tensor& t, const Box& own, const Box& part) {
  at::Tensor v = t;
  for (size_t d = 0; d < part.size(); ++d) {
    v = v.narrow(static_cast<int64_t>(d), part[d].start - own[d].start, part[d].length);
  }
  return v;
}

std::vector<int64_t> box_shape(const Box& b) {
  std::vector<int64_t> out;
  for (const auto& r : b) {
    out.push_back(r.length);
  }
  return out;
}

}  // namespace

BoxExchangePlan::BoxExchangePlan(BoxGroup group, std::vector<Box> src, std::vector<Box> dst)
    : group_(group), src_(std::move(src)), dst_(std::move(dst)) {
  const int64_t P = group_.size, me = group_.me;
  sends_.resize(P);
  recvs_.resize(P);
  send_numel_.assign(P, 0);
  recv_numel_.assign(P, 0);
  for (int64_t c = 0; c < P; ++c) {
    sends_[c] = box_and(src_[me], dst_[c]);
    recvs_[c] = box_and(src_[c], dst_[me]);
    if (c != me) {
      send_numel_[c] = box_volume(sends_[c]);
      recv_numel_[c] = box_volume(recvs_[c]);
    }
  }
  send_displ_ = exclusive_offsets(send_numel_);
  recv_displ_ = exclusive_offsets(recv_numel_);
}

at::Tensor BoxExchangePlan::run(const at::Tensor& local) const {
  const int64_t P = group_.size, me = group_.me;
  const Box& mine = src_[me];
  const Box& want = dst_[me];
  at::Tensor out = at::empty(box_shape(want), local.options());
  at::Tensor send = at::empty({sum_of(send_numel_)}, local.options());
  at::Tensor recv = at::empty({sum_of(recv_numel_)}, local.options());
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || send_numel_[c] == 0) {
      continue;
    }
    send.narrow(0, send_displ_[c], send_numel_[c])
        .view(box_shape(sends_[c]))
        .copy_(box_view(local, mine, sends_[c]));
  }
  if (box_volume(sends_[me]) > 0) {
    box_view(out, want, sends_[me]).copy_(box_view(local, mine, sends_[me]));
  }
  all_to_all_units(send, send_numel_, send_displ_, recv, recv_numel_, recv_displ_,
                   local.element_size(), group_.comm);
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || recv_numel_[c] == 0) {
      continue;
    }
    box_view(out, want, recvs_[c])
        .copy_(recv.narrow(0, recv_displ_[c], recv_numel_[c]).view(box_shape(recvs_[c])));
  }
  return out;
}

// Note [box exchange plan cache]: a BoxExchangePlan depends only on metadata
// (the group's communicator, this coordinate and the boxes), and validating
// the boxes is O(P^2) in the number of coordinates. Plans are cached by that
// key as halo plans are (Note [halo plan cache] in halo.cpp): a call that
// finds its plan skips the box validation (it passed when the plan was made,
// for the same boxes) and checks only the local tensor. At most
// 512 plans (comm/plan_cache.h); the cache is cleared when full. The key holds the
// Comm handle's bits, so a plan is never reused on another communicator.
namespace {

PlanCache<BoxExchangePlan>& box_plans() {
  static auto* c = new PlanCache<BoxExchangePlan>();  // never destroyed (plans may be used at exit)
  return *c;
}

std::vector<int64_t> box_plan_key(const BoxGroup& g, const std::vector<Box>& src,
                                  const std::vector<Box>& dst) {
  std::vector<int64_t> key;
  key.push_back(comm_key_bits(g.comm));
  key.push_back(g.size);
  key.push_back(g.me);
  for (const auto* boxes : {&src, &dst}) {
    key.push_back(static_cast<int64_t>(boxes->size()));
    for (const Box& b : *boxes) {
      key.push_back(static_cast<int64_t>(b.size()));
      for (const auto& r : b) {
        key.push_back(r.start);
        key.push_back(r.length);
      }
    }
  }
  return key;
}

}  // namespace

std::shared_ptr<const BoxExchangePlan> BoxExchangePlan::inverse() const {
  auto key = box_plan_key(group_, dst_, src_);
  if (auto plan = box_plans().find(key)) return plan;
  auto plan = std::make_shared<const BoxExchangePlan>(group_, dst_, src_);
  box_plans().insert(std::move(key), plan);
  return plan;
}

size_t box_plan_cache_size() { return box_plans().size(); }

namespace {

// ---- autograd functions ------------------------------------------------------------

/// A plan run forward, its inverse backward (the adjoint exchange, a cached
/// plan). For RepartitionPlan, AllToAllPlan and BoxExchangePlan. Under create_graph the backward
/// runs the inverse plan as a PlanFn itself, so it is differentiable to any order (Note
/// [differentiable adjoints], collectives.cpp).
template <class Plan>
struct PlanFn : torch::autograd::Function<PlanFn<Plan>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local,
                            std::shared_ptr<const Plan> plan) {
    at::Tensor out = plan->run(local);
    save_args(ctx, std::move(plan));
    return function_output(out, {local});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& plan = saved_args<std::shared_ptr<const Plan>>(ctx);
    if (at::GradMode::is_enabled()) {
      return {PlanFn<Plan>::apply(grads[0], plan->inverse()), Variable()};
    }
    return {plan->inverse()->run(grads[0]), Variable()};
  }
};
using RemapFn = PlanFn<RepartitionPlan>;
using AllToAllFn = PlanFn<AllToAllPlan>;
using BoxExchangeFn = PlanFn<BoxExchangePlan>;

/// Records an error unless the runs of all coordinates tile [0, n) exactly.
bool check_tiling(Checks& checks, const Layout& layout, int64_t n, const char* what) {
  std::vector<Segment> all;
  for (size_t c = 0; c < layout.size(); ++c) {
    for (const auto& s : layout[c]) {
      if (!checks.require(s.start >= 0 && s.length >= 0, what, " of coordinate ", c, " has a run [",
                          s.start, ", +", s.length, ") with a negative start or length")) {
        return false;
      }
      if (s.length > 0) {
        all.push_back(s);
      }
    }
  }
  std::sort(all.begin(), all.end(),
            [](const Segment& x, const Segment& y) { return x.start < y.start; });
  int64_t next = 0;
  for (const auto& s : all) {
    if (!checks.require(s.start == next, what, " do not tile [0, ", n,
                        ") exactly: ", s.start < next ? "overlap" : "gap", " at global index ",
                        std::min(s.start, next))) {
      return false;
    }
    next = s.start + s.length;
  }
  return checks.require(next == n, what, " cover [0, ", next, ") but the destination sizes sum to ",
                        n);
}

/// Records an error unless `boxes` has one box of `ndim` non-negative runs per
/// coordinate and the boxes are pairwise disjoint.
bool check_boxes(Checks& checks, const std::vector<Box>& boxes, int64_t P, int64_t ndim,
                 const char* what) {
  if (!checks.require(static_cast<int64_t>(boxes.size()) == P, what, " has ", boxes.size(),
                      " boxes but the mesh dims have ", P, " coordinates")) {
    return false;
  }
  for (int64_t c = 0; c < P; ++c) {
    if (!checks.require(static_cast<int64_t>(boxes[c].size()) == ndim, what, "[", c, "] has ",
                        boxes[c].size(), " runs but the local tensor has ", ndim, " dims")) {
      return false;
    }
    for (int64_t d = 0; d < ndim; ++d) {
      if (!checks.require(boxes[c][d].start >= 0 && boxes[c][d].length >= 0, what, "[", c,
                          "] has the run [", boxes[c][d].start, ", +", boxes[c][d].length,
                          ") with a negative start or length along dim ", d)) {
        return false;
      }
    }
  }
  for (int64_t c = 0; c < P; ++c) {
    for (int64_t k = c + 1; k < P; ++k) {
      if (!checks.require(box_volume(box_and(boxes[c], boxes[k])) == 0, what, "[", c, "] and ",
                          what, "[", k, "] overlap")) {
        return false;
      }
    }
  }
  return true;
}

/// Records an error unless every box of `a` is covered by the boxes of `b`
/// (with disjoint boxes: |a[c]| = sum_k |a[c] & b[k]|).
bool check_covered(Checks& checks, const std::vector<Box>& a, const std::vector<Box>& b,
                   const char* a_what, const char* b_what) {
  for (size_t c = 0; c < a.size(); ++c) {
    int64_t covered = 0;
    for (const Box& other : b) {
      covered += box_volume(box_and(a[c], other));
    }
    if (!checks.require(covered == box_volume(a[c]), a_what, "[", c, "] is not covered by the ",
                        b_what, " (", covered, " of its ", box_volume(a[c]),
                        " elements are): the boxes do not cover the same indices")) {
      return false;
    }
  }
  return true;
}

}  // namespace

// ---- public API ---------------------------------------------------------------------

at::Tensor repartition(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<std::vector<Segment>>& segments,
                       const std::vector<int64_t>& dst_sizes) {
  const Prim p = Prim::Repartition;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(local.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  const int64_t d = wrap_dim(checks, dim, local, "dim");
  Layout dst;
  const auto off = exclusive_offsets(dst_sizes);
  for (size_t c = 0; c < dst_sizes.size(); ++c) {
    dst.push_back({Segment{off[c], dst_sizes[c]}});
  }
  // A cached plan was made from these very arguments, which passed the O(P)
  // validation then (Note [repartition plan cache]): only the local tensor
  // is checked again.
  std::vector<int64_t> key;
  std::shared_ptr<const RepartitionPlan> plan;
  if (checks.ok()) {
    key = repartition_plan_key(a, d, segments, dst);
    plan = repartition_plans().find(key);
  }
  if (plan != nullptr ||
      (check_sizes(checks, dst_sizes, a, "dst_sizes") &&
       checks.require(static_cast<int64_t>(segments.size()) == a.size, "segments has ",
                      segments.size(), " entries but mesh dim ", a.mesh_dim, " has ", a.size,
                      " coordinates") &&
       check_tiling(checks, segments, sum_of(dst_sizes), "the segments") && checks.ok())) {
    checks.require(local.size(d) == layout_extent(segments[a.me]), "the local tensor has extent ",
                   local.size(d), " along dim ", d, " but the segments of coordinate ", a.me,
                   " hold ", layout_extent(segments[a.me]), " elements");
  }
  Fingerprint fp;
  fp.add(a.mesh_dim).add(dim).add(dst_sizes).add_shape(local, {d});
  for (const auto& runs : segments) {
    fp.add(static_cast<int64_t>(runs.size()));
    for (const auto& s : runs) {
      fp.add(s.start).add(s.length);
    }
  }
  agree_or_throw(p, a.comm, fp, checks);
  if (plan == nullptr) {
    plan = std::make_shared<const RepartitionPlan>(a, d, segments, dst);
    repartition_plans().insert(std::move(key), plan);
  }
  return RemapFn::apply(local, plan);
}

at::Tensor all_to_all(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t src_dim, const std::vector<int64_t>& src_sizes, int64_t dst_dim,
                      const std::vector<int64_t>& dst_sizes) {
  const Prim p = Prim::AllToAll;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(local.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  const int64_t sd = wrap_dim(checks, src_dim, local, "src_dim");
  const int64_t dd = wrap_dim(checks, dst_dim, local, "dst_dim");
  if (check_sizes(checks, src_sizes, a, "src_sizes") &&
      check_sizes(checks, dst_sizes, a, "dst_sizes") && checks.ok()) {
    if (sd == dd) {
      checks.require(sum_of(src_sizes) == sum_of(dst_sizes),
                     "rebalancing (src_dim == dst_dim) needs sum(src_sizes) = ", sum_of(src_sizes),
                     " to equal sum(dst_sizes) = ", sum_of(dst_sizes));
    }
    if (checks.ok()) {
      checks.require(local.size(sd) == src_sizes[a.me], "the local tensor has extent ",
                     local.size(sd), " along src_dim ", sd, " but src_sizes[", a.me,
                     "] = ", src_sizes[a.me]);
    }
    if (checks.ok() && sd != dd) {
      checks.require(local.size(dd) == sum_of(dst_sizes), "the local tensor has extent ",
                     local.size(dd), " along dst_dim ", dd,
                     " but sum(dst_sizes) = ", sum_of(dst_sizes));
    }
  }
  Fingerprint fp;
  fp.add(a.mesh_dim).add(src_dim).add(src_sizes).add(dst_dim).add(dst_sizes);
  fp.add_shape(local, {sd, dd});
  agree_or_throw(p, a.comm, fp, checks);
  if (sd == dd) {
    // Rebalancing is the repartition of contiguous blocks to contiguous blocks.
    Layout src, dst;
    const auto off = exclusive_offsets(src_sizes);
    for (size_t c = 0; c < src_sizes.size(); ++c) {
      src.push_back({Segment{off[c], src_sizes[c]}});
    }
    const auto doff = exclusive_offsets(dst_sizes);
    for (size_t c = 0; c < dst_sizes.size(); ++c) {
      dst.push_back({Segment{doff[c], dst_sizes[c]}});
    }
    return RemapFn::apply(local, cached_repartition_plan(a, sd, src, dst));
  }
  return AllToAllFn::apply(local.contiguous(),
                           cached_all_to_all_plan(a, sd, src_sizes, dd, dst_sizes));
}

at::Tensor box_exchange(const at::Tensor& local, const DeviceMesh& mesh,
                        const std::vector<int64_t>& mesh_dims, const std::vector<Box>& src_boxes,
                        const std::vector<Box>& dst_boxes) {
  const Prim p = Prim::BoxExchange;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(!g.dims.empty(), prefix(p), "needs at least one mesh dim");
  TORCH_CHECK(local.defined(), prefix(p), "the local tensor is undefined");
  BoxGroup bg;
  bg.comm = g.comm;
  bg.size = 1;
  bg.me = 0;
  const auto coord = mesh.coordinate();
  for (int64_t d : g.dims) {  // row-major over the sorted dims: MPI_Cart_sub's rank order
    bg.me = bg.me * mesh.size(d) + coord[d];
    bg.size *= mesh.size(d);
  }
  Checks checks(p);
  auto key = box_plan_key(bg, src_boxes, dst_boxes);
  std::shared_ptr<const BoxExchangePlan> plan = box_plans().find(key);
  const int64_t nd = local.dim();
  if (plan == nullptr) {
    if (check_boxes(checks, src_boxes, bg.size, nd, "src_boxes") &&
        check_boxes(checks, dst_boxes, bg.size, nd, "dst_boxes") &&
        check_covered(checks, src_boxes, dst_boxes, "src_boxes", "dst_boxes")) {
      check_covered(checks, dst_boxes, src_boxes, "dst_boxes", "src_boxes");
    }
  }
  if (checks.ok()) {
    checks.require(local.sizes().vec() == box_shape(src_boxes[bg.me]),
                   "the local tensor has shape ", local.sizes(), " but src_boxes[", bg.me,
                   "] has extents ", c10::IntArrayRef(box_shape(src_boxes[bg.me])));
  }
  Fingerprint fp;
  fp.add(g.dims).add(static_cast<int64_t>(local.scalar_type())).add(nd);
  for (size_t i = 1; i < key.size(); ++i) {
    if (i != 2) {
      fp.add(key[i]);  // the boxes (not the handle's bits, nor this rank's coordinate)
    }
  }
  agree_or_throw(p, g.comm, fp, checks);
  if (plan == nullptr) {
    TORCH_INTERNAL_ASSERT(transport::comm_rank(bg.comm) == bg.me, "box_exchange: rank ",
                          transport::comm_rank(bg.comm), " in the sub-communicator is not the ",
                          "row-major coordinate ", bg.me);
    plan = std::make_shared<const BoxExchangePlan>(bg, src_boxes, dst_boxes);
    box_plans().insert(std::move(key), plan);
  }
  return BoxExchangeFn::apply(local, plan);
}

}  // namespace shardtensor::comm
