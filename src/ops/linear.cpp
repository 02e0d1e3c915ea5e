// Linear algebra: linear, matmul, mm, bmm, mv, dot, addmm, addmv, baddbmm
// (functional, in-place and out= forms). torch::nn::Linear arrives here as
// aten::linear. einsum, tensordot, chain_matmul and friends have no rule: they
// decompose into these ops (and view ops), or fail naming the piece that has no rule.
//
// Note [matmul layout]: every op here is reduced to one product with matmul
// semantics, a @ b, plus an optional bias term:
//   a: [*batch_a, n, k] (or [k]),  b: [*batch_b, k, m] (or [k]),
//   out: [*broadcast(batch_a, batch_b), n?, m?].
// Each dim of an operand has a role: batch (an output batch dim), row (a's n),
// col (b's m) or contraction (k). Per mesh dim, the pair of placements (a's, b's)
// decides what every rank computes locally (plain at::matmul on its pieces):
//
//   a                 b                 output on that mesh dim
//   Replicate         Replicate         Replicate
//   Shard(batch i)    Replicate         Shard(i); b is sliced to the same range when it
//                                       spans batch i at full size (local, no communication)
//   Shard(row)        Replicate         Shard(row)
//   Replicate         Shard(batch/col)  Shard(batch/col), the mirror image
//   Shard(batch i)    Shard(batch i)    Shard(i), when the two splits are equal
//   Shard(k)          Shard(k)          Partial: per-rank partial sums, left pending (Note
//                                       [pending partial sums]), when the two splits are equal
//   Shard(k)          Replicate         the replicated side is sliced along k to the same
//                                       ranges (local), then as above (and the mirror image)
//   Partial           Replicate         Partial: the product is linear in the Partial operand
//                                       (and the mirror image)
//   Partial           Shard(any)        the Partial operand is summed first, then as above
//   Partial           Partial           the smaller operand is summed first (the product of
//                                       two sums is not the sum of the products), then as above
//   Shard(row)        Shard(col)        Shard(row): a ring (Note [ring matmul]); b stays
//                                       sharded and its blocks circulate (Q @ K^T)
//   Shard(row)        Shard(k)          Shard(row): a ring, each step contracting a's columns
//                                       of the visiting block of b (P @ V)
//   anything else (different batch dims, k vs row, unequal splits, a sharded
//   size-1 batch dim that broadcasts): the smaller operand (global numel) is redistributed
//   -- to Replicate, or to its partner's split when only the splits differ -- and the
//   table is consulted again.
// When the per-mesh-dim choices collide (one tensor dim would be sharded by two mesh dims),
// the smaller operand is replicated on one of the mesh dims involved and the plan is
// redone. All of this reads only global shapes and specs, so every rank plans alike,
// and every check happens before the first communication.
//
// Costs (P ranks along the mesh dim, sizes in elements):
//  - batch/row/col sharded against a replicated partner: no forward communication. In
//    backward the replicated operand's gradient is all-reduced over the mesh dims where
//    compute is sharded (comm::use_replicated; Note [replicated gradients]): one
//    all-reduce of the weight's size, the usual data-parallel cost.
//  - contraction sharded: no forward communication; the output is Partial on that mesh
//    dim and its sum (one all-reduce of this rank's output piece, or a reduce-scatter) is
//    paid once, where a consumer needs the value (Note [pending partial sums]). The
//    replicated partner is only sliced (no communication) and its gradient is
//    all-gathered in backward. Nothing is communicated for the input's own gradient. A
//    0-d result (dot, vector @ vector) is a full reduction: it is all-reduced at once
//    into a plain tensor, as full reductions are (Note [reduction layout]).
//  - a Partial operand against a replicated one: no forward communication; the
//    replicated operand's gradient is all-reduced over the Partial mesh dims (every rank
//    used it on a different summand; comm::use_replicated through to_layout).
//  - a bias (linear, addmm, addmv, baddbmm) is added in the output layout. Where the
//    output is Partial the bias joins the pending sum on coordinate 0 of those mesh dims
//    only (comm::replicate_to_partial; zeros elsewhere), so it is counted once and no
//    communication is added; its gradient is the plain sum of the output gradient
//    (all-reduced over the mesh dims where the output is sharded).
//  - 2-D meshes compose per mesh dim: rows on mesh dim 0 and cols on mesh dim 1 give each
//    rank one output block with no forward communication (a's row block is replicated
//    along mesh dim 1, b's col block along mesh dim 0, and their gradients are all-reduced
//    over those dims); rows on mesh dim 0 and k on mesh dim 1 all-reduce only this rank's
//    row block of the output, over mesh dim 1.
//  - a ring (row vs col or row vs k on one mesh dim): P - 1 shifts of b's block, the
//    traffic of an all-gather of b but never more than two of its blocks in memory, and
//    no gathered bytes (Note [visible gathers]); backward circulates b again for a's
//    gradient and an accumulator for b's.
//
// Note [ring matmul]
// ~~~~~~~~~~~~~~~~~~
// a's rows are split over mesh dim m (P coordinates) and so is b's column dim (Q @ K^T
// on sequence-sharded tokens) or b's contraction dim (P @ V). Gathering b would hold all
// of it on every rank (an S x D operand and, for Q @ K^T, nothing smaller to gather).
// Instead b's blocks circulate: at step t coordinate c holds the block of coordinate
// (c - t) mod P while the next one travels from (c - 1) (comm::RingShift, split-phase,
// overlapped with the step's product). For columns, step t fills the output's columns
// of that block, a @ b_src; for the contraction, it adds a[..., k_src] @ b_src, where
// k_src are the block's global contraction indices (a holds all of them). The output
// keeps a's rows split on m. Backward (RingMatmulFn::backward): a's gradient needs b
// again, so b circulates once more (dA += dOut_src @ b_src^H, or dA[..., k_src] =
// dOut @ b_src^H); b's gradient needs only a and dOut, and this rank's contribution
// to block src is added to an accumulator that travels one step behind (as dK/dV in
// Note [ring attention]): after P steps each accumulator is back at its owner,
// complete. Batch dims broadcast as at::matmul does (contributions summed back to the
// operand's shape with at::sum_to). Under create_graph (double backward) backward
// recomputes this rank's output from the all-gathered b with differentiable ops, as
// Note [ring attention double backward] does, trading the ring's memory bound for
// exactness of higher derivatives.
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <sstream>

#include "comm/function_output.h"
#include "comm/ring.h"
#include "ops/common.h"

namespace shardtensor::ops {
namespace {

bool is_one(const c10::Scalar& s) { return s.equal(1); }
bool is_zero(const c10::Scalar& s) { return s.equal(0); }

// One operand of the product, as the planner sees it.
struct Operand {
  at::Tensor t;                // as passed: plain (replicated) or a ShardTensor
  std::vector<int64_t> shape;  // global
  Placements place;            // wanted own layout (plain: Replicate; Partial kept)
  ShardSizes sizes;
  int64_t numel = 0;

  int64_t nd() const { return static_cast<int64_t>(shape.size()); }
  // The tensor dim sharded on mesh dim m, or -1.
  int64_t dim_at(int64_t m) const {
    return is_shard(place[m]) ? c10::maybe_wrap_dim(shard_dim(place[m]), nd()) : -1;
  }
  void replicate(int64_t m) {
    place[m] = Replicate{};
    sizes[m] = {};
  }
};

Operand make_operand(const at::Tensor& t, const DeviceMesh& mesh) {
  Operand o;
  o.t = t;
  o.shape = t.sizes().vec();
  o.numel = c10::multiply_integers(o.shape);
  const ShardSpec* s = spec_of(t);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (s && is_shard(s->placements()[m])) {
      o.place.push_back(Shard{c10::maybe_wrap_dim(shard_dim(s->placements()[m]), o.nd())});
      o.sizes.push_back(s->shard_sizes(m));
    } else if (s && is_partial(s->placements()[m])) {
      o.place.push_back(Partial{});
      o.sizes.push_back({});
    } else {
      o.place.push_back(Replicate{});
      o.sizes.push_back({});
    }
  }
  return o;
}

// w.t() without a trip through the dispatcher for ShardTensors: the local piece
// is transposed and the spec's dims swapped (metadata only).
at::Tensor transposed(const at::Tensor& w) {
  if (w.dim() < 2) return w;
  const ShardSpec* s = spec_of(w);
  if (!s) return w.t();
  Placements p = s->placements();
  for (auto& pl : p) {
    if (is_shard(pl)) pl = Shard{1 - c10::maybe_wrap_dim(shard_dim(pl), 2)};
  }
  auto spec =
      make_spec(s->mesh(), p, {s->global_shape()[1], s->global_shape()[0]}, s->all_shard_sizes());
  return wrap(local_of(w).t(), spec);
}

enum class Role { Batch, Row, K, Col };

// Where each operand dim goes in the output (Note [matmul layout]).
struct Geometry {
  int64_t na, nb, L;  // operand ranks, number of output batch dims

  int64_t row_out() const { return L; }
  int64_t col_out() const { return L + (na >= 2 ? 1 : 0); }
  int64_t a_k() const { return na - 1; }
  int64_t b_k() const { return nb >= 2 ? nb - 2 : 0; }
  // Operand dim of output batch dim i, or -1 if the operand has none.
  int64_t batch_dim(bool of_a, int64_t i) const {
    const int64_t n = of_a ? na : nb;
    if (n < 2) return -1;
    const int64_t d = i - L + n - 2;
    return d >= 0 ? d : -1;
  }
  // Role of operand dim d and, for batch/row/col, its output dim.
  Role role(bool of_a, int64_t d, int64_t* out_dim) const {
    const int64_t n = of_a ? na : nb;
    *out_dim = -1;
    if (n == 1) return Role::K;
    if (of_a) {
      if (d == na - 1) return Role::K;
      if (d == na - 2) {
        *out_dim = row_out();
        return Role::Row;
      }
    } else {
      if (d == nb - 2) return Role::K;
      if (d == nb - 1) {
        *out_dim = col_out();
        return Role::Col;
      }
    }
    *out_dim = L - (n - 2) + d;
    return Role::Batch;
  }
};

struct Plan {
  std::vector<int64_t> out_shape;
  SpecPtr out, ta, tb;                // output layout, operand layouts for the local product
  std::vector<int64_t> partial_dims;  // mesh dims where the output is Partial (pending sums)
  int64_t ring_dim = -1;              // Note [ring matmul]: the mesh dim b's blocks circulate on
  bool ring_contracts = false;        // b's ring-sharded dim is the contraction (else its columns)
  std::vector<int64_t> ring_sizes;    // b's extent of each ring coordinate
};

// The first (mesh dim, mesh dim) pair sharding one tensor dim twice, or (-1, -1).
std::pair<int64_t, int64_t> collision(const Placements& p, int64_t nd) {
  std::vector<int64_t> owner(nd, -1);
  for (int64_t m = 0; m < static_cast<int64_t>(p.size()); ++m) {
    if (!is_shard(p[m])) continue;
    const int64_t d = c10::maybe_wrap_dim(shard_dim(p[m]), nd);
    if (owner[d] >= 0) return {owner[d], m};
    owner[d] = m;
  }
  return {-1, -1};
}

// Metadata only (no communication): validates the product and decides the
// layouts (Note [matmul layout]). Throws on every rank alike.
Plan plan_product(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, Operand A,
                  Operand B, const DeviceMesh& mesh) {
  if (A.nd() == 0 || B.nd() == 0) {
    fail(op, args, "both operands of a matrix product must be at least 1-D");
  }
  std::vector<int64_t> batch_a(A.shape.begin(), A.shape.end() - std::min<int64_t>(A.nd(), 2));
  std::vector<int64_t> batch_b(B.shape.begin(), B.shape.end() - std::min<int64_t>(B.nd(), 2));
  std::vector<int64_t> batch;
  try {
    batch = at::infer_size(batch_a, batch_b);
  } catch (const c10::Error&) {
    fail(op, args,
         "the batch dims " + shape_str(batch_a) + " and " + shape_str(batch_b) +
             " do not broadcast");
  }
  const Geometry g{A.nd(), B.nd(), static_cast<int64_t>(batch.size())};
  if (A.shape[g.a_k()] != B.shape[g.b_k()]) {
    fail(op, args,
         "the contraction dims differ (" + std::to_string(A.shape[g.a_k()]) + " vs " +
             std::to_string(B.shape[g.b_k()]) + ")");
  }
  Plan plan;
  plan.out_shape = batch;
  if (g.na >= 2) plan.out_shape.push_back(A.shape[g.na - 2]);
  if (g.nb >= 2) plan.out_shape.push_back(B.shape[g.nb - 1]);
  const int64_t out_nd = static_cast<int64_t>(plan.out_shape.size());
  const int64_t nm = mesh.ndim();
  const bool b_smaller = B.numel <= A.numel;
  Operand* small = b_smaller ? &B : &A;
  Operand* large = b_smaller ? &A : &B;

  // Each round either yields a plan or replicates / re-splits an operand on one
  // mesh dim (a Partial one is summed), so at most 2 * nm + nm + 2 * nm rounds are needed.
  for (int64_t round = 0; round <= 6 * nm + 4; ++round) {
    // A sharded batch dim that broadcasts (size 1 against a larger output) is gathered.
    for (Operand* X : {&A, &B}) {
      for (int64_t m = 0; m < nm; ++m) {
        const int64_t d = X->dim_at(m);
        int64_t od;
        if (d >= 0 && g.role(X == &A, d, &od) == Role::Batch && X->shape[d] != plan.out_shape[od]) {
          X->replicate(m);
        }
      }
    }
    Placements ta = A.place, tb = B.place, to(nm, Replicate{});
    ShardSizes sa = A.sizes, sb = B.sizes, so(nm);
    plan.partial_dims.clear();
    plan.ring_dim = -1;
    bool again = false;
    for (int64_t m = 0; m < nm && !again; ++m) {
      const bool pa = is_partial(A.place[m]), pb = is_partial(B.place[m]);
      if (pa || pb) {
        // Note [pending partial sums]: the product is linear in each operand.
        Operand& X = pa ? A : B;  // a Partial operand
        Operand& Y = pa ? B : A;
        if (pa && pb) {
          small->replicate(m);  // sum one of them: the product of sums needs one sum
          again = true;
        } else if (Y.dim_at(m) >= 0) {
          X.replicate(m);  // Partial against Shard on the same mesh dim: sum it first
          again = true;
        } else {
          to[m] = Partial{};  // Partial @ Replicate: stays a pending sum
          plan.partial_dims.push_back(m);
        }
        continue;
      }
      const int64_t da = A.dim_at(m), db = B.dim_at(m);
      if (da < 0 && db < 0) continue;
      if (da < 0 || db < 0) {
        // One side sharded, the other replicated.
        const bool a_side = da >= 0;
        Operand& X = a_side ? A : B;
        Operand& Y = a_side ? B : A;
        Placements& ty = a_side ? tb : ta;
        ShardSizes& sy = a_side ? sb : sa;
        int64_t od;
        const Role r = g.role(a_side, a_side ? da : db, &od);
        if (r == Role::K) {
          ty[m] = Shard{a_side ? g.b_k() : g.a_k()};
          sy[m] = X.sizes[m];
          to[m] = Partial{};
          plan.partial_dims.push_back(m);
        } else {
          to[m] = Shard{od};
          so[m] = X.sizes[m];
          if (r == Role::Batch) {
            const int64_t yd = g.batch_dim(!a_side, od);
            if (yd >= 0 && Y.shape[yd] == plan.out_shape[od]) {
              ty[m] = Shard{yd};
              sy[m] = X.sizes[m];
            }
          }
        }
        continue;
      }
      // Both sharded.
      int64_t oa, ob;
      const Role ra = g.role(true, da, &oa), rb = g.role(false, db, &ob);
      const bool same =
          (ra == Role::K && rb == Role::K) || (ra == Role::Batch && rb == Role::Batch && oa == ob);
      if (same && A.sizes[m] == B.sizes[m]) {
        if (ra == Role::K) {
          to[m] = Partial{};
          plan.partial_dims.push_back(m);
        } else {
          to[m] = Shard{oa};
          so[m] = A.sizes[m];
        }
      } else if (same) {
        small->sizes[m] = large->sizes[m];  // re-split the smaller one like the other
        again = true;
      } else if (ra == Role::Row && (rb == Role::Col || rb == Role::K) && plan.ring_dim < 0) {
        // Note [ring matmul]: b keeps its split and circulates; a's rows stay.
        plan.ring_dim = m;
        plan.ring_contracts = rb == Role::K;
        plan.ring_sizes = B.sizes[m];
        to[m] = Shard{oa};
        so[m] = A.sizes[m];
      } else {
        small->replicate(m);
        again = true;
      }
    }
    if (again) continue;
    // Collisions: an operand dim sharded by its own mesh dim and sliced for another.
    bool collided = false;
    for (bool of_a : {true, false}) {
      Operand& X = of_a ? A : B;
      Operand& Y = of_a ? B : A;
      auto [m1, m2] = collision(of_a ? ta : tb, X.nd());
      if (m1 < 0) continue;
      const int64_t own = X.dim_at(m1) >= 0 ? m1 : m2;
      const int64_t sliced = own == m1 ? m2 : m1;
      TORCH_INTERNAL_ASSERT(X.dim_at(own) >= 0 && X.dim_at(sliced) < 0);
      if (&Y == small) {
        Y.replicate(sliced);
      } else {
        X.replicate(own);
      }
      collided = true;
      break;
    }
    if (!collided) {
      auto [m1, m2] = collision(to, out_nd);
      if (m1 >= 0) {
        // Cannot happen without an operand collision; replicate to be safe.
        (small->dim_at(m2) >= 0 ? small : large)->replicate(m2);
        collided = true;
      }
    }
    if (collided) continue;
    plan.ta = make_spec(mesh, ta, A.shape, sa);
    plan.tb = make_spec(mesh, tb, B.shape, sb);
    plan.out = make_spec(mesh, to, plan.out_shape, so);
    return plan;
  }
  TORCH_INTERNAL_ASSERT(false, "matmul layout planning did not converge for ",
                        describe_call(op, args));
}

// ---- Note [ring matmul] ------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RingMatmulPlan : torch::CustomClassHolder {
  DeviceMesh mesh;
  int64_t dim = 0;                      // the ring's mesh dim
  int64_t P = 1, me = 0;                // ring size, this coordinate
  bool contracts = false;               // b's ring dim is its contraction dim (else columns)
  std::vector<int64_t> sizes, offsets;  // b's extent and global offset per coordinate

  // b's local dim that the ring splits (b is at least 2-D here).
  int64_t b_dim(const at::Tensor& lb) const { return lb.dim() - (contracts ? 2 : 1); }
  // The shape of coordinate c's block of b.
  std::vector<int64_t> block_shape(const at::Tensor& lb, int64_t c) const {
    std::vector<int64_t> s = lb.sizes().vec();
    s[b_dim(lb)] = sizes[c];
    return s;
  }
  int64_t src(int64_t t) const { return (me - t + 2 * P) % P; }
};

at::Tensor conj_t(const at::Tensor& t) { return t.transpose(-2, -1).conj(); }

// Note [ring matmul], create_graph: this rank's output recomputed from the
// all-gathered b with differentiable ops. Collective over the ring's mesh dim.
variable_list ring_matmul_double_backward(const RingMatmulPlan& p, const at::Tensor& la,
                                          const at::Tensor& lb, const at::Tensor& dout,
                                          std::array<bool, 2> need) {
  at::Tensor bf = comm::use_replicated(
      comm::all_gather(lb.contiguous(), p.mesh, p.dim, p.b_dim(lb), p.sizes), p.mesh, {p.dim});
  at::Tensor out = at::matmul(la, bf);
  std::vector<at::Tensor> inputs;
  if (need[0]) inputs.push_back(la);
  if (need[1]) inputs.push_back(lb);
  variable_list grads(3);
  if (inputs.empty()) return grads;
  auto r = torch::autograd::grad({out}, inputs, {dout}, /*retain_graph=*/true,
                                 /*create_graph=*/true, /*allow_unused=*/true);
  size_t j = 0;
  for (int i = 0; i < 2; ++i) {
    if (need[i]) grads[i] = r[j++];
  }
  return grads;
}

// Inputs are local pieces: a [*, n_c, k] (all of k), b [*, k, m_c] (columns) or
// [*, k_c, m] (contraction); the result is this rank's rows of a @ b.
// Hand-written: b's blocks circulate and are never all present, so backward
// circulates b again and b's gradient itself (comm::RingShift), not through autograd.
struct RingMatmulFn : torch::autograd::Function<RingMatmulFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& la, const at::Tensor& lb,
                            c10::intrusive_ptr<RingMatmulPlan> plan) {
    const RingMatmulPlan& p = *plan;
    at::Tensor cur = lb.contiguous();
    std::vector<at::Tensor> blocks(p.P);
    at::Tensor acc;
    for (int64_t t = 0; t < p.P; ++t) {
      const int64_t src = p.src(t);
      comm::RingShift next;
      if (t + 1 < p.P) {
        next = comm::RingShift::start(cur, p.block_shape(lb, p.src(t + 1)), p.mesh, p.dim,
                                      comm::kRingTagBlocks);
      }
      if (p.contracts) {
        at::Tensor part = at::matmul(la.narrow(-1, p.offsets[src], p.sizes[src]), cur);
        acc = acc.defined() ? acc.add_(part) : part;
      } else {
        blocks[src] = at::matmul(la, cur);
      }
      if (t + 1 < p.P) cur = next.finish();
    }
    at::Tensor out = p.contracts ? acc : at::cat(blocks, -1);
    out = comm::function_output(out, {la, lb});
    ctx->save_for_backward({la, lb});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    ctx->saved_data["out_shape"] = out.sizes().vec();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("RingMatmulFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &la = saved[0], &lb = saved[1];
    auto holder = ctx->saved_data.at("plan").toCapsule();
    const RingMatmulPlan& p = *static_cast<RingMatmulPlan*>(holder.get());
    const bool need_a = ctx->needs_input_grad(0), need_b = ctx->needs_input_grad(1);
    at::Tensor dout = grads[0].defined()
                          ? grads[0]
                          : at::zeros(ctx->saved_data.at("out_shape").toIntVector(), la.options());
    if (at::GradMode::is_enabled()) {
      return ring_matmul_double_backward(p, la, lb, dout, {need_a, need_b});
    }
    at::NoGradGuard no_grad;
    at::Tensor da = need_a ? at::zeros_like(la) : at::Tensor();
    at::Tensor cur = lb.contiguous();
    comm::RingShift acc_in;
    for (int64_t t = 0; t < p.P; ++t) {
      const int64_t src = p.src(t), nsrc = p.src(t + 1);
      const int64_t off = p.offsets[src], len = p.sizes[src];
      comm::RingShift next;
      if (need_a && t + 1 < p.P) {
        next = comm::RingShift::start(cur, p.block_shape(lb, nsrc), p.mesh, p.dim,
                                      comm::kRingTagBlocks);
      }
      if (need_a) {
        if (p.contracts) {
          at::Tensor slot = da.narrow(-1, off, len);
          slot.copy_(at::sum_to(at::matmul(dout, conj_t(cur)), slot.sizes()));
        } else {
          da.add_(at::sum_to(at::matmul(dout.narrow(-1, off, len), conj_t(cur)), da.sizes()));
        }
      }
      if (need_b) {
        // This rank's contribution to block src's gradient, added to the
        // accumulator that arrived from (c - 1), sent on to (c + 1).
        at::Tensor part = p.contracts ? at::matmul(conj_t(la.narrow(-1, off, len)), dout)
                                      : at::matmul(conj_t(la), dout.narrow(-1, off, len));
        at::Tensor db = at::sum_to(part, p.block_shape(lb, src)).contiguous();
        if (t > 0) db = db.add(acc_in.finish());
        acc_in = comm::RingShift::start(db, p.block_shape(lb, nsrc), p.mesh, p.dim,
                                        comm::kRingTagAccumulators);
      }
      if (need_a && t + 1 < p.P) cur = next.finish();
    }
    at::Tensor db = need_b ? acc_in.finish() : at::Tensor();  // this rank's block, complete
    return {da, db, at::Tensor()};
  }
};

// Collective over the ring's mesh dim. The local rows of a @ b (Note [ring matmul]).
at::Tensor ring_matmul(at::Tensor la, at::Tensor lb, const Plan& plan, const DeviceMesh& mesh) {
  auto p = c10::make_intrusive<RingMatmulPlan>();
  p->mesh = mesh;
  p->dim = plan.ring_dim;
  p->P = mesh.size(plan.ring_dim);
  p->me = mesh.coordinate()[plan.ring_dim];
  p->contracts = plan.ring_contracts;
  p->sizes = plan.ring_sizes;
  p->offsets = offsets_of(plan.ring_sizes);
  const bool vector_b = lb.dim() == 1;  // b = [k_c]: a column [k_c, 1]
  if (vector_b) lb = lb.unsqueeze(-1);
  TORCH_INTERNAL_ASSERT(!p->contracts || la.size(-1) == p->offsets.back() + p->sizes.back(),
                        "ring matmul: a does not hold the whole contraction dim");
  at::Tensor out = RingMatmulFn::apply(la, lb, p);
  return vector_b ? out.squeeze(-1) : out;
}

// Collective (redistribution, the ring). The local piece of a @ b in the layout
// plan.out: on plan.partial_dims this rank's summand, not summed here (Note
// [pending partial sums]).
at::Tensor run_product(const Operand& A, const Operand& B, const Plan& plan,
                       const DeviceMesh& mesh) {
  // Plain operands (weights) and operands replicated on mesh dims where the
  // output is sharded are marked by to_layout so that their gradients are
  // summed there (Note [replicated gradients]).
  at::Tensor la = to_layout(A.t, *plan.ta, *plan.out);
  at::Tensor lb = to_layout(B.t, *plan.tb, *plan.out);
  return plan.ring_dim >= 0 ? ring_matmul(la, lb, plan, mesh) : at::matmul(la, lb);
}

enum class Kind { Linear, Matmul, Mm, Bmm, Mv, Dot, Addmm, Addmv, Baddbmm };

Kind kind_of(const std::string& base) {
  if (base == "linear") return Kind::Linear;
  if (base == "matmul") return Kind::Matmul;
  if (base == "mm") return Kind::Mm;
  if (base == "bmm") return Kind::Bmm;
  if (base == "mv") return Kind::Mv;
  if (base == "dot") return Kind::Dot;
  if (base == "addmm") return Kind::Addmm;
  if (base == "addmv") return Kind::Addmv;
  if (base == "baddbmm") return Kind::Baddbmm;
  TORCH_INTERNAL_ASSERT(false, "linear algebra rule registered for unexpected op ", base);
}

void linalg_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const auto& schema = op.schema();
  std::string base = schema.name().substr(schema.name().find("::") + 2);
  const bool inplace = !base.empty() && base.back() == '_';
  if (inplace) base.pop_back();
  const Kind kind = kind_of(base);
  const DeviceMesh mesh = common_mesh(op, args);

  int64_t out_idx = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    if (schema.arguments()[i].kwarg_only() && is_written(schema.arguments()[i])) {
      out_idx = static_cast<int64_t>(i);
    }
  }
  auto tensor_arg = [&](size_t i) {
    return args[i].isTensor() ? args[i].toTensor() : at::Tensor();
  };
  at::Tensor a, b, bias;
  c10::Scalar beta = 1, alpha = 1;
  if (kind == Kind::Addmm || kind == Kind::Addmv || kind == Kind::Baddbmm) {
    bias = tensor_arg(0);
    a = tensor_arg(1);
    b = tensor_arg(2);
    beta = args[3].toScalar();
    alpha = args[4].toScalar();
  } else {
    a = tensor_arg(0);
    b = tensor_arg(1);
    if (kind == Kind::Linear) bias = tensor_arg(2);
  }

  // Op-specific ranks (matmul and linear accept any rank >= 1).
  auto need = [&](bool ok, const std::string& why) {
    if (!ok) fail(op, args, why);
  };
  need(a.defined() && b.defined(), "an operand is undefined");
  switch (kind) {
    case Kind::Linear:
      need(b.dim() == 1 || b.dim() == 2, "the weight must be 1-D or 2-D");
      break;
    case Kind::Mm:
    case Kind::Addmm:
      need(a.dim() == 2 && b.dim() == 2, "both operands must be 2-D matrices");
      break;
    case Kind::Bmm:
    case Kind::Baddbmm:
      need(a.dim() == 3 && b.dim() == 3, "both operands must be 3-D");
      need(a.size(0) == b.size(0), "the batch sizes differ (" + std::to_string(a.size(0)) + " vs " +
                                       std::to_string(b.size(0)) + ")");
      break;
    case Kind::Mv:
    case Kind::Addmv:
      need(a.dim() == 2 && b.dim() == 1, "expected a 2-D matrix and a 1-D vector");
      break;
    case Kind::Dot:
      need(a.dim() == 1 && b.dim() == 1, "both operands must be 1-D");
      break;
    case Kind::Matmul:
      break;
  }
  need(a.scalar_type() == b.scalar_type(), std::string("the operands have different dtypes (") +
                                               c10::toString(a.scalar_type()) + " and " +
                                               c10::toString(b.scalar_type()) + ")");
  if (bias.defined()) {
    need(bias.scalar_type() == a.scalar_type(),
         std::string("the bias has dtype ") + c10::toString(bias.scalar_type()) +
             ", the operands " + c10::toString(a.scalar_type()));
  }

  Operand A = make_operand(a, mesh);
  Operand B = make_operand(kind == Kind::Linear ? transposed(b) : b, mesh);
  const Plan plan = plan_product(op, args, A, B, mesh);
  const std::vector<int64_t>& out_shape = plan.out_shape;

  // The bias (or in-place self) must broadcast to the result.
  if (bias.defined() && !inplace) {
    std::vector<int64_t> s;
    try {
      s = at::infer_size(bias.sizes(), out_shape);
    } catch (const c10::Error&) {
    }
    need(s == out_shape, "the bias of shape " + shape_str(bias.sizes()) +
                             " does not broadcast to the result shape " + shape_str(out_shape));
  }
  at::Tensor target;  // in-place self or out=
  if (inplace) target = bias;
  if (out_idx >= 0) target = args[out_idx].toTensor();
  const ShardSpec* target_spec = target.defined() ? spec_of(target) : nullptr;
  if (target.defined()) {
    need(target_spec != nullptr,
         "the in-place or out= tensor must be a ShardTensor when an operand is one");
    need(target_spec->global_shape() == out_shape, "the in-place or out= tensor has shape " +
                                                       shape_str(target_spec->global_shape()) +
                                                       ", the result " + shape_str(out_shape));
    need(!target_spec->has_partial(), "the in-place or out= tensor must not be Partial");
  }

  // An operand replicated beyond its piece is a visible gather (Note [visible gathers]).
  {
    bool gather = false;
    int64_t bytes = 0;
    for (const Operand* X : {&A, &B}) {
      const ShardSpec* s = spec_of(X->t);
      if (!s) continue;
      const ShardSpec own = without_partial(*s);
      const ShardSpec& tgt = X == &A ? *plan.ta : *plan.tb;
      if (gathers(own, tgt)) {
        gather = true;
        bytes += gathered_bytes(own, tgt, X->t.element_size());
      }
    }
    if (gather) note_gather(op, args, mesh, bytes, "matmul replicates a sharded operand");
  }

  // ---- communication starts here; every check above ran on every rank alike ----
  at::Tensor res = run_product(A, B, plan, mesh);
  if (inplace) {
    // self = beta * self + alpha * (a @ b), in self's layout.
    at::Tensor p = detail::redistribute_local(res, *plan.out, *target_spec);
    at::Tensor self_local = local_of(target);
    if (is_zero(beta)) {
      self_local.zero_();
    } else if (!is_one(beta)) {
      self_local.mul_(beta);
    }
    self_local.add_(p, alpha);
    stack->push_back(target);
    return;
  }
  if (bias.defined() && !is_zero(beta)) {
    // In the output layout; on its Partial mesh dims on coordinate 0 only (zeros
    // elsewhere), so it is counted once in the pending sum (Note [pending partial sums]).
    // A bias sharded on such a mesh dim is gathered there (its own size), then
    // made Partial (redistribute has no Shard -> Partial).
    ShardSpec tgt = pending_operand_spec(*plan.out, bias.sizes());
    Placements tp = tgt.placements(), cp = plan.out->placements();
    std::vector<int64_t> later;
    if (const ShardSpec* bs = spec_of(bias)) {
      for (int64_t m : plan.partial_dims) {
        if (is_shard(bs->placements()[m])) {
          tp[m] = cp[m] = Replicate{};
          later.push_back(m);
        }
      }
    }
    at::Tensor lb = to_layout(bias, ShardSpec(mesh, tp, bias.sizes().vec(), tgt.all_shard_sizes()),
                              ShardSpec(mesh, cp, out_shape, plan.out->all_shard_sizes()));
    for (int64_t m : later) lb = comm::replicate_to_partial(lb, mesh, m);
    if (!is_one(beta)) lb = lb * beta;
    res = at::add(lb, res, alpha);
  } else if (!is_one(alpha)) {
    res = res * alpha;
  }
  if (target.defined()) {
    local_of(target).copy_(detail::redistribute_local(res, *plan.out, *target_spec));
    stack->push_back(target);
    return;
  }
  // A 0-d result (a dot product) is a full reduction: a plain, replicated tensor
  // (its pending sums are summed now, as full reductions are).
  if (out_shape.empty()) {
    if (!plan.partial_dims.empty()) res = comm::all_reduce(res, mesh, plan.partial_dims);
    stack->push_back(res);
  } else {
    stack->push_back(wrap(res, plan.out));
  }
}

const RuleRegistrar linalg_ops({"linear", "matmul", "mm", "bmm", "mv", "dot", "addmm", "addmm_",
                                "addmv", "addmv_", "baddbmm", "baddbmm_"},
                               linalg_rule);

}  // namespace
}  // namespace shardtensor::ops
