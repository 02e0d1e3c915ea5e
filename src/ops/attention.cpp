// Scaled dot-product attention; ring attention on sequence-sharded inputs
// (include/shardtensor/ops/attention.h, docs/attention.md).
//
// Note [ring attention]: the sequence (dim 2) of q, k, v is split over one mesh
// dim of P coordinates (the ring). Coordinate c holds queries and keys/values
// of its own block. The forward pass runs P steps; at step t it computes its
// queries against the K/V block of coordinate (c - t) mod P while the
// non-blocking transfer of that block to (c + 1) and of the next block from
// (c - 1) is in flight (comm::RingShift, split-phase). Blocks are merged with
// an online softmax: a running row max m, a running sum l of exp(s - m) and an
// accumulator acc of exp(s - m) v, rescaled by exp(m_old - m_new) whenever the
// max grows; at the end out = acc / l and lse = m + log l is saved.
//
// The backward pass (RingAttentionFn::backward) recomputes each score block
// from the saved q, k, v and row statistics (p = exp((s - m) - log l)). A first
// trip of K/V around the ring sums delta = rowsum(p ∘ dO vᵀ) (Note [ring
// attention precision]); a second one computes dv += pᵀ dO,
// ds = p (dO vᵀ - delta), dq += scale ds k, dk += scale dsᵀ q. In the second
// trip the dK/dV accumulator of a block travels one step behind it: at step t a rank adds
// its contribution for block (c - t) to the accumulator that arrived from
// (c - 1) (started at step t - 1, so the transfer overlapped this step's
// compute) and starts sending it to (c + 1). After P steps each accumulator is
// back at the block's owner, complete.
//
// Note [ring attention precision]: FlashAttention's delta = rowsum(dO ∘ out)
// equals rowsum(p ∘ dP) (dP = dO vᵀ) only in exact arithmetic. In float32 the
// two round differently, so rows of ds = p (dP - delta) no longer sum to zero,
// and that residue, of order eps |dO| |v|, lands in dq and dk even where the
// exact gradient is zero (a row that sees one key: p = 1, and libtorch's
// softmax backward gives ds = 0 exactly) or tiny (a saturated softmax).
// Likewise p = exp(s - lse) with lse = m + log l rounded in float32 loses
// eps |m| of every probability when the scores are large. FUZZ_SEED=500502 at
// the 2x2 mesh (test_fuzz) measured it, against float64 in float32
// tolerances: input and q/k weight gradients 1.41, 1.39 and 1.45 off, where
// single-process libtorch (matmul, softmax, matmul) was 0.0034, 0.00057 and
// 0.00026 off (libtorch's own fused CPU scaled_dot_product_attention: 3.2 on
// that program). So the backward computes delta as libtorch's softmax
// backward does, rowsum(p ∘ dP) with the same p and dP as ds, which takes a
// first trip of K/V around the ring (two more matmuls per chunk), and keeps
// m and log l apart: p = exp((s - m) - log l). After: 0.0040, 0.00055 and
// 0.00026. Attention.Float32AccuracyCausalGroupedQuery holds it to
// precision_check's bound (twice libtorch's error) at 1-4 ranks. Cost: the
// backward took about 1.1-2x as long (docs/attention.md, measured on a loaded
// 2-core machine).
//
// Note [causal balance]: with a contiguous split and a causal mask, coordinate
// c sees only keys up to its own block, so it computes about c + 1/2 blocks
// (fully-masked blocks and chunks are skipped), and the ring's wall time is the
// last coordinate's P - 1/2 blocks. Zig-zag: cut the sequence into 2P chunks;
// coordinate c takes chunks c and 2P-1-c (an early and a late one) for its
// queries and its keys/values (comm::gather_range, twice), so every
// coordinate computes the same ~P/2 + 1/2 visible blocks; the output goes back
// to q's split with comm::repartition. Both moves are differentiable, so the
// backward pass follows. Blocks then hold two runs of positions (struct Run)
// and every (query run, key run) pair is skipped or masked on its own.
//
// Memory: scores exist only for one chunk of one block at a time: rows =
// B·Hq·(Sq/P), key columns cut so that rows x columns <= chunk_elements
// (at least 16 columns), never (Sq/P) x Sk.
//
// Grouped-query heads: q [B, Hq, n, D] is viewed as [B, Hkv, g·n, D] (g =
// Hq/Hkv, query head h = kv head h/g), so one matmul against k [B, Hkv, m, D]
// serves every query head of a group, and dK/dV sum over the group for free.
//
// Note [ring attention double backward]: the ring backward computes dQ, dK,
// dV outside autograd. Under create_graph (GradMode enabled in backward)
// RingAttentionFn::backward instead recomputes this rank's output from its
// queries and the all-gathered K/V (comm::all_gather, then use_replicated:
// every rank's queries use all of them, Note [replicated gradients]) with
// plain matmul/softmax and the same masks, and returns
// torch::autograd::grad(out, {q, k, v}, dO, create_graph=true). That holds
// B·Hq·(Sq/P)·Sk scores and every K/V block at once, which the ring avoids:
// double backward trades the ring's memory bound for exactness.
//
// Note [non-finite attention inputs]: with NaN or Inf in q, k, v (or in the
// output's gradient), the result and the gradients must hold NaN/Inf exactly
// where single-process libtorch's matmul, masked_fill(-inf), softmax, matmul
// has them. There a hidden score (bool mask false, causal j > i) has p = 0
// and a zero gradient (masked_fill's backward), but every product with it is
// still formed: out = p v gets 0 * v[j][d] = NaN in column d for any
// non-finite v[j][d], dk[j] = dsᵀ q gets 0 * q[i][d], dq[i] = ds k gets
// 0 * k[j][d], dv[j] = pᵀ dO gets 0 * dO[i][d] (and NaN from a row whose p is
// all NaN: a NaN or +Inf score, or no visible key), and softmax's backward
// delta[i] = rowsum(p ∘ dP) gets 0 * dP[i][j] = NaN whenever dO[i] or v[j]
// holds a non-finite value (then ds[i] is NaN wherever it is not hidden).
// The ring computes the same products on the chunks it visits, but skips the
// keys the causal mask hides from a whole query run (visible_chunks), so
// after a run's visible chunks it applies those rules to the keys j beyond
// the run's last query (hidden_from; for keys it did visit the rules repeat
// what the products gave): columns of out, dq, dk, dv and rows of delta
// become NaN. And it zeroes ds at hidden positions (chunk_hidden) as
// masked_fill's backward does, since p (dP - delta) is 0 * NaN there when dP
// or delta is not finite. Cost on finite inputs: a finiteness check of each
// K/V block once per trip where a causal run skips keys, and of q, dO, the row
// statistics and delta once per backward; the rules and the zeroing run only
// where one fails. (A finite dP that overflows to Inf is not caught: there
// the zeroing is skipped and ds is NaN at hidden positions where libtorch has 0.)
#include <shardtensor/ops/attention.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "comm/function_output.h"
#include "comm/ring.h"
#include "comm/settings.h"
#include "core/settings.h"
#include "ops/common.h"

namespace shardtensor {
// Held in the registry of Note [agreed settings] (core/settings.h), which spells the values.
static_assert(static_cast<int>(CausalBalance::Contiguous) == 0 &&
              static_cast<int>(CausalBalance::ZigZag) == 1);
CausalBalance set_causal_balance(CausalBalance balance) {
  return static_cast<CausalBalance>(
      detail::store_setting(Setting::CausalBalance, static_cast<int64_t>(balance)));
}
CausalBalance causal_balance() {
  return static_cast<CausalBalance>(detail::setting_value(Setting::CausalBalance));
}

namespace detail {
namespace {
std::atomic<int64_t> g_chunk_elements{int64_t(1) << 21};
}
namespace {
std::atomic<int64_t> g_score_elements{0};
}
int64_t attention_score_elements(bool reset) {
  return reset ? g_score_elements.exchange(0) : g_score_elements.load();
}
int64_t set_attention_chunk_elements(int64_t elements) {
  TORCH_CHECK(elements > 0, "set_attention_chunk_elements: expected a positive count, got ",
              elements);
  return g_chunk_elements.exchange(elements);
}
}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace ops;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  if (const ShardSpec* s = spec_of(t)) {
    os << "ShardTensor(global=" << c10::IntArrayRef(s->global_shape())
       << ", placements=" << to_string(s->placements()) << ")";
  } else {
    os << "Tensor" << t.sizes();
  }
  return os.str();
}

[[noreturn]] void fail_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, const std::string& why) {
  TORCH_CHECK(false, "shardtensor::scaled_dot_product_attention: ", why, " (q=", describe(q),
              ", k=", describe(k), ", v=", describe(v), ", attn_mask=", describe(mask), ")");
}

// A run of rows of a block: rows [local, local + len) hold the global sequence
// positions [global, global + len). A contiguous shard is one run; a zig-zag
// shard two (Note [causal balance]).
struct Run {
  int64_t local = 0, global = 0, len = 0;
};

// Everything the local block computation needs (identical on every rank
// except `me` and the local tensors).
struct RingPlan : torch::CustomClassHolder {
  DeviceMesh mesh;
  int64_t ring_dim = -1;                  // mesh dim sharding the sequence; -1: none
  int64_t P = 1, me = 0;                  // ring size, this coordinate
  std::vector<int64_t> kv_sizes;          // key/value rows of each ring coordinate's block
  std::vector<std::vector<Run>> kv_runs;  // their global positions
  std::vector<Run> q_runs;                // global positions of this rank's queries
  int64_t groups = 1;                     // Hq / Hkv
  double scale = 1.0;
  bool causal = false;
  // Local mask viewed as [b, hkv|1, g|1, n|1, Sk|1] (bool or q's dtype); undefined if none.
  at::Tensor mask5;
  bool mask_full_keys = false;  // mask's key extent is Sk (sliced per chunk), else 1
};

// The mask's entries for the queries of run `qr` and the keys at global
// positions [kstart, kstart + cl), [b, hkv|1, g|1, nq|1, cl|1]; undefined if none.
at::Tensor chunk_mask(const RingPlan& p, const Run& qr, int64_t kstart, int64_t cl) {
  if (!p.mask5.defined()) return at::Tensor();
  at::Tensor mc = p.mask_full_keys ? p.mask5.narrow(-1, kstart, cl) : p.mask5;
  if (mc.size(3) != 1) mc = mc.narrow(3, qr.local, qr.len);
  return mc;
}

// Where the causal mask hides those keys from those queries, [nq, cl];
// undefined where it hides none.
at::Tensor causal_hidden(const RingPlan& p, const Run& qr, int64_t kstart, int64_t cl) {
  if (!p.causal || kstart + cl - 1 <= qr.global) return at::Tensor();  // fully visible
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor qi = at::arange(qr.global, qr.global + qr.len, opts).unsqueeze(1);
  at::Tensor kj = at::arange(kstart, kstart + cl, opts).unsqueeze(0);
  return kj > qi;
}

// Where masked_fill hides a score (bool mask false, causal), broadcastable to
// [B, Hkv, g, nq, cl]; undefined where nothing is (Note [non-finite attention inputs]).
at::Tensor chunk_hidden(const RingPlan& p, const Run& qr, int64_t kstart, int64_t cl) {
  at::Tensor hidden = causal_hidden(p, qr, kstart, cl);
  const at::Tensor mc = chunk_mask(p, qr, kstart, cl);
  if (mc.defined() && mc.scalar_type() == at::kBool) {
    hidden = hidden.defined() ? mc.logical_not().logical_or(hidden) : mc.logical_not();
  }
  return hidden;
}

// One chunk of scores, [B, Hkv, g*nq, cl], for the queries of run `qr` (q4 holds
// only those rows) against keys at global positions [kstart, kstart + cl), with
// the mask and the causal mask applied (-inf where hidden).
at::Tensor chunk_scores(const RingPlan& p, const at::Tensor& q4, const at::Tensor& kc,
                        const Run& qr, int64_t kstart) {
  const int64_t cl = kc.size(2), nq = qr.len;
  at::Tensor s = at::matmul(q4, kc.transpose(-2, -1));
  s.mul_(p.scale);
  detail::g_score_elements += s.numel();
  at::Tensor s5 = s.view({s.size(0), s.size(1), p.groups, nq, cl});
  if (const at::Tensor mc = chunk_mask(p, qr, kstart, cl); mc.defined()) {
    if (mc.scalar_type() == at::kBool) {
      s5.masked_fill_(mc.logical_not(), kNegInf);
    } else {
      s5.add_(mc);
    }
  }
  if (const at::Tensor hidden = causal_hidden(p, qr, kstart, cl); hidden.defined()) {
    s5.masked_fill_(hidden, kNegInf);
  }
  return s;
}

// ---- Note [non-finite attention inputs] ----
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool all_finite(const at::Tensor& t) {
  return t.numel() == 0 || at::isfinite(t).all().item<bool>();
}
// True where t is NaN or +-Inf, reduced with any() over `dims`.
at::Tensor nonfinite_any(const at::Tensor& t, at::IntArrayRef dims) {
  return at::isfinite(t).logical_not().any(dims);
}
// The first row of key run `kr` that the causal mask hides from every query
// of run `qr` (qr.len > 0): rows [result, kr.len) are; kr.len when none is.
int64_t hidden_from(const RingPlan& p, const Run& qr, const Run& kr) {
  if (!p.causal) return kr.len;
  return std::clamp<int64_t>(qr.global + qr.len - kr.global, 0, kr.len);
}
// Whether a K/V block is all finite, checked once, when first asked.
class FiniteOnce {
 public:
  explicit FiniteOnce(const at::Tensor& t) : t_(t) {}
  bool operator()() {
    if (!known_) {
      finite_ = all_finite(t_);
      known_ = true;
    }
    return finite_;
  }

 private:
  const at::Tensor& t_;
  bool known_ = false, finite_ = true;
};
// Once per backward: which of this rank's local operands are all finite.
struct FiniteLocals {
  bool q = true, dout = true, rows = true, delta = true;  // rows: softmax statistics
};

// Key chunk length for `rows` score rows.
int64_t chunk_len(int64_t rows, int64_t len) {
  const int64_t budget = detail::g_chunk_elements.load();
  const int64_t c = std::max<int64_t>(16, budget / std::max<int64_t>(rows, 1));
  return std::max<int64_t>(1, std::min(c, len));
}

// True when the key at global position `kstart` and every later one is hidden
// from every query of run `qr`.
bool fully_masked(const RingPlan& p, const Run& qr, int64_t kstart) {
  return p.causal && kstart > qr.global + qr.len - 1;
}

// `progress` runs after every chunk: it lets MPI move the ring's messages while
// this rank computes (Note [ring attention]).
using Progress = std::function<void()>;

// The rows of run `r` of a [B, Hkv, g*n, ...] tensor, as [B, Hkv, g, r.len, ...]
// (a view) — or flattened back to [B, Hkv, g*r.len, ...] (a copy unless r spans n).
at::Tensor rows5(const at::Tensor& t4, int64_t g, int64_t n, const Run& r) {
  std::vector<int64_t> shape{t4.size(0), t4.size(1), g, n};
  for (int64_t d = 3; d < t4.dim(); ++d) shape.push_back(t4.size(d));
  return t4.view(shape).narrow(3, r.local, r.len);
}
at::Tensor rows4(const at::Tensor& t4, int64_t g, int64_t n, const Run& r) {
  if (r.local == 0 && r.len == n) return t4;
  at::Tensor t5 = rows5(t4, g, n, r);
  std::vector<int64_t> shape{t4.size(0), t4.size(1), g * r.len};
  for (int64_t d = 3; d < t4.dim(); ++d) shape.push_back(t4.size(d));
  return t5.reshape(shape);
}

struct FwdState {
  at::Tensor m, l, acc;  // [B, Hkv, g*n], [B, Hkv, g*n], [B, Hkv, g*n, D]
};

// Calls `body(kr, c0, cl)` for every chunk [c0, c0 + cl) of every run `kr`
// of `src`'s K/V block that query run `qr` sees, in key order (a run or
// chunk fully masked by the causal mask is skipped; the later ones are
// further ahead). `rows` (query rows of the chunk's scores) sizes the chunks.
template <typename Body>
void visible_chunks(const RingPlan& p, const Run& qr, int64_t src, int64_t rows, Body body) {
  for (const Run& kr : p.kv_runs[src]) {
    if (kr.len == 0 || fully_masked(p, qr, kr.global)) continue;
    const int64_t step = chunk_len(rows, kr.len);
    for (int64_t c0 = 0; c0 < kr.len; c0 += step) {
      const int64_t cl = std::min(step, kr.len - c0);
      if (fully_masked(p, qr, kr.global + c0)) break;
      body(kr, c0, cl);
    }
  }
}

// Merges one K/V block (`src`'s rows) into the online softmax.
void forward_block(const RingPlan& p, const at::Tensor& q4, const at::Tensor& kb_in,
                   const at::Tensor& vb_in, int64_t n, int64_t src, FwdState& st,
                   const Progress& progress) {
  const int64_t g = p.groups;
  // Note [reduced precision]: blocks travel in their own dtype, compute in q4's (float32).
  const at::Tensor kb = kb_in.to(q4.scalar_type()), vb = vb_in.to(q4.scalar_type());
  FiniteOnce v_finite(vb);
  for (const Run& qr : p.q_runs) {
    if (qr.len == 0) continue;
    at::Tensor qq = rows4(q4, g, n, qr);
    at::Tensor m = rows5(st.m, g, n, qr), l = rows5(st.l, g, n, qr);
    at::Tensor acc = rows5(st.acc, g, n, qr);
    const int64_t rows = qq.size(0) * qq.size(1) * qq.size(2);
    visible_chunks(p, qr, src, rows, [&](const Run& kr, int64_t c0, int64_t cl) {
      at::Tensor s = chunk_scores(p, qq, kb.narrow(2, kr.local + c0, cl), qr, kr.global + c0);
      at::Tensor s5 = s.view({s.size(0), s.size(1), g, qr.len, cl});
      at::Tensor m_new = at::maximum(m, s5.amax(-1));
      at::Tensor m_safe = m_new.masked_fill(m_new.isneginf(), 0.0);
      s5.sub_(m_safe.unsqueeze(-1)).exp_();
      at::Tensor alpha = (m - m_safe).exp_();
      l.mul_(alpha).add_(s5.sum(-1));
      at::Tensor pv = at::matmul(s, vb.narrow(2, kr.local + c0, cl));
      acc.mul_(alpha.unsqueeze(-1)).add_(pv.view(acc.sizes()));
      m.copy_(m_new);
      progress();
    });
    // Note [non-finite attention inputs]: out[i][d] += 0 * v[j][d] for the keys
    // hidden from the whole run.
    for (const Run& kr : p.kv_runs[src]) {
      const int64_t h = hidden_from(p, qr, kr);
      if (h == kr.len || v_finite()) continue;
      at::Tensor bad = nonfinite_any(vb.narrow(2, kr.local + h, kr.len - h), {2});  // [B, Hkv, D]
      acc.masked_fill_(bad.unsqueeze(2).unsqueeze(3), kNaN);
    }
  }
}

// The saved softmax statistics of every query row (Note [ring attention
// precision]): the row max (0 where -inf) and log of the row sum.
struct RowStats {
  at::Tensor max, log_sum;  // [B, Hkv, g*n] each
};

// Probabilities p = exp((s - max) - log_sum) of one score chunk, in place
// (Note [ring attention precision]); `mx`, `ls` are the rows of `s`.
void probabilities_(at::Tensor& s, const at::Tensor& mx, const at::Tensor& ls) {
  s.sub_(mx.unsqueeze(-1)).sub_(ls.unsqueeze(-1)).exp_();
}

// Adds one K/V block's (`src`'s) part of delta = rowsum(p ∘ dO vᵀ) to `delta`
// ([B, Hkv, g*n]; Note [ring attention precision]).
void delta_block(const RingPlan& p, const at::Tensor& q4, const at::Tensor& do4, const RowStats& rs,
                 const FiniteLocals& fin, const at::Tensor& kb_in, const at::Tensor& vb_in,
                 int64_t n, int64_t src, at::Tensor& delta, const Progress& progress) {
  const int64_t g = p.groups;
  const at::Tensor kb = kb_in.to(q4.scalar_type()), vb = vb_in.to(q4.scalar_type());
  FiniteOnce v_finite(vb);
  for (const Run& qr : p.q_runs) {
    if (qr.len == 0) continue;
    at::Tensor qq = rows4(q4, g, n, qr), dd = rows4(do4, g, n, qr);
    at::Tensor mx = rows4(rs.max, g, n, qr), ls = rows4(rs.log_sum, g, n, qr);
    at::Tensor de = rows5(delta, g, n, qr);
    const int64_t rows = qq.size(0) * qq.size(1) * qq.size(2);
    visible_chunks(p, qr, src, rows, [&](const Run& kr, int64_t c0, int64_t cl) {
      at::Tensor pr = chunk_scores(p, qq, kb.narrow(2, kr.local + c0, cl), qr, kr.global + c0);
      probabilities_(pr, mx, ls);
      pr.mul_(at::matmul(dd, vb.narrow(2, kr.local + c0, cl).transpose(-2, -1)));
      de.add_(pr.sum(-1).view(de.sizes()));
      progress();
    });
    // Note [non-finite attention inputs]: delta[i] += 0 * dP[i][j] for the keys
    // hidden from the whole run, NaN where dO[i] or v[j] is not finite.
    for (const Run& kr : p.kv_runs[src]) {
      const int64_t h = hidden_from(p, qr, kr);
      if (h == kr.len || (fin.dout && v_finite())) continue;
      at::Tensor bad = nonfinite_any(dd, {-1}).view(de.sizes());  // [B, Hkv, g, len]
      bad = bad.logical_or(
          nonfinite_any(vb.narrow(2, kr.local + h, kr.len - h), {2, 3}).unsqueeze(2).unsqueeze(3));
      de.masked_fill_(bad, kNaN);
    }
  }
}

// Adds one K/V block's (`src`'s) contribution to dq4 and to dkv ([2, B, Hkv, len, D]).
void backward_block(const RingPlan& p, const at::Tensor& q4, const at::Tensor& do4,
                    const RowStats& rs, const at::Tensor& delta, const FiniteLocals& fin,
                    const at::Tensor& kb_in, const at::Tensor& vb_in, int64_t n, int64_t src,
                    at::Tensor& dq4, at::Tensor& dkv, const Progress& progress) {
  const int64_t g = p.groups;
  const at::Tensor kb = kb_in.to(q4.scalar_type()), vb = vb_in.to(q4.scalar_type());
  FiniteOnce k_finite(kb), v_finite(vb);
  // Note [non-finite attention inputs]: ds = p (dP - delta) is exactly 0 where
  // p is unless dP, delta or p is not finite; only then are the hidden
  // positions zeroed explicitly.
  const bool may_hide = p.causal || (p.mask5.defined() && p.mask5.scalar_type() == at::kBool);
  const bool zero_hidden = may_hide && !(fin.dout && fin.delta && fin.rows && v_finite());
  for (const Run& qr : p.q_runs) {
    if (qr.len == 0) continue;
    at::Tensor qq = rows4(q4, g, n, qr), dd = rows4(do4, g, n, qr);
    at::Tensor mx = rows4(rs.max, g, n, qr), ls = rows4(rs.log_sum, g, n, qr);
    at::Tensor de = rows4(delta, g, n, qr);
    at::Tensor dq = rows5(dq4, g, n, qr);
    const int64_t rows = qq.size(0) * qq.size(1) * qq.size(2);
    visible_chunks(p, qr, src, rows, [&](const Run& kr, int64_t c0, int64_t cl) {
      at::Tensor kc = kb.narrow(2, kr.local + c0, cl), vc = vb.narrow(2, kr.local + c0, cl);
      at::Tensor pr = chunk_scores(p, qq, kc, qr, kr.global + c0);
      probabilities_(pr, mx, ls);
      dkv[1].narrow(2, kr.local + c0, cl).add_(at::matmul(pr.transpose(-2, -1), dd));
      at::Tensor ds = at::matmul(dd, vc.transpose(-2, -1));
      ds.sub_(de.unsqueeze(-1)).mul_(pr);
      if (zero_hidden) {
        if (const at::Tensor hidden = chunk_hidden(p, qr, kr.global + c0, cl); hidden.defined()) {
          ds.view({ds.size(0), ds.size(1), g, qr.len, cl}).masked_fill_(hidden, 0.0);
        }
      }
      pr = at::Tensor();
      dq.add_(at::matmul(ds, kc).view(dq.sizes()), p.scale);
      dkv[0].narrow(2, kr.local + c0, cl).add_(at::matmul(ds.transpose(-2, -1), qq), p.scale);
      progress();
    });
    // Note [non-finite attention inputs]: the keys hidden from the whole run.
    for (const Run& kr : p.kv_runs[src]) {
      const int64_t h = hidden_from(p, qr, kr);
      if (h == kr.len) continue;
      if (!fin.dout || !fin.rows) {  // dv[j][d] += 0 * dO[i][d], or NaN * dO[i][d]
        at::Tensor bad = nonfinite_any(dd, {2}).logical_or(
            nonfinite_any(mx, {2}).logical_or(nonfinite_any(ls, {2})).unsqueeze(-1));
        dkv[1].narrow(2, kr.local + h, kr.len - h).masked_fill_(bad.unsqueeze(2), kNaN);
      }
      if (!fin.q) {  // dk[j][d] += 0 * q[i][d]
        dkv[0]
            .narrow(2, kr.local + h, kr.len - h)
            .masked_fill_(nonfinite_any(qq, {2}).unsqueeze(2), kNaN);
      }
      if (!k_finite()) {  // dq[i][d] += 0 * k[j][d]
        at::Tensor bad = nonfinite_any(kb.narrow(2, kr.local + h, kr.len - h), {2});
        dq.masked_fill_(bad.unsqueeze(2).unsqueeze(3), kNaN);
      }
    }
  }
}

std::vector<int64_t> kv_shape(const at::Tensor& k, int64_t len) {
  return {2, k.size(0), k.size(1), len, k.size(3)};
}

// Note [ring attention double backward]: this rank's output block recomputed
// from all of K/V with differentiable ops, and its gradients with create_graph.
// Collective over the ring's mesh dim (an all-gather of K and of V).
variable_list ring_double_backward(const RingPlan& p, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& dout,
                                   std::array<bool, 3> need) {
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), g = p.groups;
  at::Tensor kf = k, vf = v;
  if (p.ring_dim >= 0) {
    kf = comm::use_replicated(comm::all_gather(k.contiguous(), p.mesh, p.ring_dim, 2, p.kv_sizes),
                              p.mesh, {p.ring_dim});
    vf = comm::use_replicated(comm::all_gather(v.contiguous(), p.mesh, p.ring_dim, 2, p.kv_sizes),
                              p.mesh, {p.ring_dim});
  }
  // Global positions of the gathered key rows and of this rank's query rows.
  std::vector<int64_t> kpos, qpos(n, 0);
  for (const auto& runs : p.kv_runs) {
    for (const Run& r : runs) {
      for (int64_t i = 0; i < r.len; ++i) kpos.push_back(r.global + i);
    }
  }
  for (const Run& r : p.q_runs) {
    for (int64_t i = 0; i < r.len; ++i) qpos[r.local + i] = r.global + i;
  }
  const int64_t Sk = static_cast<int64_t>(kpos.size());
  auto opts = at::TensorOptions().dtype(at::kLong);
  const at::Tensor kp = at::tensor(kpos, opts), qp = at::tensor(qpos, opts);
  at::Tensor s = at::matmul(q.reshape({B, Hkv, g * n, D}), kf.transpose(-2, -1)) * p.scale;
  s = s.view({B, Hkv, g, n, Sk});
  if (p.mask5.defined()) {
    at::Tensor m = p.mask_full_keys ? p.mask5.index_select(-1, kp) : p.mask5;
    s = m.scalar_type() == at::kBool ? s.masked_fill(m.logical_not(), kNegInf) : s + m;
  }
  if (p.causal) s = s.masked_fill(kp.unsqueeze(0) > qp.unsqueeze(1), kNegInf);
  at::Tensor out = at::matmul(at::softmax(s, -1), vf.unsqueeze(2)).reshape({B, Hq, n, D});
  std::vector<at::Tensor> inputs;
  const at::Tensor* all[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    if (need[i]) inputs.push_back(*all[i]);
  }
  variable_list grads(4);
  if (inputs.empty()) return grads;
  auto r = torch::autograd::grad({out}, inputs, {dout}, /*retain_graph=*/true,
                                 /*create_graph=*/true, /*allow_unused=*/true);
  size_t j = 0;
  for (int i = 0; i < 3; ++i) {
    if (need[i]) grads[i] = r[j++];
  }
  return grads;
}

// Note [ring attention]. Inputs are local tensors: q [B, Hq, n, D], k and v
// [B, Hkv, m, D] (this rank's blocks); the result is this rank's output block.
// Hand-written: K/V blocks circulate and are never all present, so backward recomputes scores
// block by block and circulates dK/dV itself (comm::RingShift), not through autograd.
struct RingAttentionFn : torch::autograd::Function<RingAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::intrusive_ptr<RingPlan> plan) {
    const RingPlan& p = *plan;
    const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
    const int64_t Hkv = k.size(1);
    // Note [reduced precision]: for float16/bfloat16 q, k, v the running max,
    // sum and accumulator (and the scores) are float32; the output is rounded
    // once, lse stays float32.
    const auto acc = q.options().dtype(acc_dtype(q.scalar_type()));
    at::Tensor q4 = q.contiguous().view({B, Hkv, p.groups * n, D}).to(acc);
    FwdState st;
    st.m = at::full({B, Hkv, p.groups * n}, kNegInf, acc);
    st.l = at::zeros({B, Hkv, p.groups * n}, acc);
    st.acc = at::zeros({B, Hkv, p.groups * n, D}, acc);

    at::Tensor cur = at::stack({k, v}).contiguous();
    for (int64_t t = 0; t < p.P; ++t) {
      const int64_t src = (p.me - t + p.P) % p.P;
      comm::RingShift next;
      if (t + 1 < p.P) {
        const int64_t nsrc = (p.me - t - 1 + 2 * p.P) % p.P;
        next = comm::RingShift::start(cur, kv_shape(k, p.kv_sizes[nsrc]), p.mesh, p.ring_dim,
                                      comm::kRingTagBlocks);
      }
      forward_block(p, q4, cur[0], cur[1], n, src, st, [&] { next.progress(); });
      if (t + 1 < p.P) cur = next.finish();
    }
    at::Tensor out4 = st.acc.div_(st.l.unsqueeze(-1));
    // Note [ring attention precision]: max and log-sum kept apart, not lse = m + log l.
    at::Tensor row_max = st.m.masked_fill(st.m.isneginf(), 0.0), log_sum = st.l.log();
    // The saved tensor is the returned one (Note [function outputs are not views]).
    at::Tensor out = comm::function_output(out4.view({B, Hq, n, D}).to(q.scalar_type()), {q, k, v});
    ctx->save_for_backward({q, k, v, out, row_max, log_sum});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return ::shardtensor::ops::carried_backward("RingAttentionFn::backward", ctx, std::move(grads),
                                                &backward_formula);
  }
  // The formula (Note [carried rule errors]: carried_backward runs it).
  static variable_list backward_formula(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const RowStats rs{saved[4], saved[5]};
    auto holder = ctx->saved_data.at("plan").toCapsule();
    const RingPlan& p = *static_cast<RingPlan*>(holder.get());
    const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
    const int64_t Hkv = k.size(1), G = p.groups * n;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    if (at::GradMode::is_enabled()) {
      // Note [ring attention double backward]. The flags are the same on every rank.
      return ring_double_backward(
          p, q, k, v, dout,
          {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)});
    }
    at::NoGradGuard no_grad;
    // Note [reduced precision]: as forward, float32 for float16/bfloat16; the
    // dK/dV accumulators circulate in float32 and are rounded once, at home.
    const auto acc = q.options().dtype(rs.max.scalar_type());
    at::Tensor q4 = q.contiguous().view({B, Hkv, G, D}).to(acc);
    at::Tensor do4 = dout.contiguous().view({B, Hkv, G, D}).to(acc);
    at::Tensor dq4 = at::zeros({B, Hkv, G, D}, acc);

    // Note [ring attention precision]: delta = rowsum(p ∘ dO vᵀ) over every
    // block, a first trip of K/V around the ring.
    at::Tensor delta = at::zeros({B, Hkv, G}, acc);
    // Note [non-finite attention inputs]: what the rules need, checked once.
    FiniteLocals fin;
    fin.q = all_finite(q4);
    fin.dout = all_finite(do4);
    fin.rows = all_finite(rs.max) && all_finite(rs.log_sum);
    const at::Tensor own = at::stack({k, v}).contiguous();
    at::Tensor cur = own;
    for (int64_t t = 0; t < p.P; ++t) {
      const int64_t src = (p.me - t + p.P) % p.P;
      comm::RingShift next;
      if (t + 1 < p.P) {
        const int64_t nsrc = (p.me - t - 1 + 2 * p.P) % p.P;
        next = comm::RingShift::start(cur, kv_shape(k, p.kv_sizes[nsrc]), p.mesh, p.ring_dim,
                                      comm::kRingTagBlocks);
      }
      delta_block(p, q4, do4, rs, fin, cur[0], cur[1], n, src, delta, [&] { next.progress(); });
      if (t + 1 < p.P) cur = next.finish();
    }
    fin.delta = all_finite(delta);
    // The second trip (dQ, dK, dV) starts again from this rank's own block.
    cur = own;
    comm::RingShift acc_in;
    for (int64_t t = 0; t < p.P; ++t) {
      const int64_t src = (p.me - t + p.P) % p.P;
      const int64_t nsrc = (p.me - t - 1 + 2 * p.P) % p.P;
      comm::RingShift next;
      if (t + 1 < p.P) {
        next = comm::RingShift::start(cur, kv_shape(k, p.kv_sizes[nsrc]), p.mesh, p.ring_dim,
                                      comm::kRingTagBlocks);
      }
      at::Tensor dkv = at::zeros(kv_shape(k, p.kv_sizes[src]), acc);
      backward_block(p, q4, do4, rs, delta, fin, cur[0], cur[1], n, src, dq4, dkv, [&] {
        next.progress();
        if (t > 0) acc_in.progress();
      });
      if (t > 0) dkv.add_(acc_in.finish());  // the accumulator of block src, from (c - 1)
      if (p.ring_dim < 0) {
        // No ring (the sequence is not sharded; P == 1): the only block is this
        // rank's own and its accumulator stays here. RingShift must not run:
        // mesh dim -1 would be the last mesh dim and swap the batch pieces' dK/dV.
        return {dq4.view({B, Hq, n, D}), dkv[0], dkv[1], at::Tensor()};
      }
      acc_in = comm::RingShift::start(dkv, kv_shape(k, p.kv_sizes[nsrc]), p.mesh, p.ring_dim,
                                      comm::kRingTagAccumulators);
      if (t + 1 < p.P) cur = next.finish();
    }
    at::Tensor dkv = acc_in.finish();  // this rank's block, complete
    return {dq4.view({B, Hq, n, D}).to(q.scalar_type()), dkv[0].to(k.scalar_type()),
            dkv[1].to(v.scalar_type()), at::Tensor()};
  }
};

// ---- validation --------------------------------------------------------------------------

struct Shapes {
  int64_t B, Hq, Hkv, Sq, Sk, D;
};

Shapes check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& mask, std::optional<double> scale) {
  if (!q.defined() || !k.defined() || !v.defined())
    fail_call(q, k, v, mask, "q, k, v must be defined");
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    fail_call(q, k, v, mask, "q, k and v must be 4-D ([B, H, S, D])");
  }
  if (k.sizes() != v.sizes()) {
    fail_call(q, k, v, mask,
              "k and v must have the same shape (" + shape_str(k.sizes()) + " vs " +
                  shape_str(v.sizes()) + ")");
  }
  if (q.size(0) != k.size(0) || q.size(3) != k.size(3)) {
    fail_call(q, k, v, mask, "q and k/v differ in batch size or head dim");
  }
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    fail_call(q, k, v, mask,
              "the number of query heads (" + std::to_string(q.size(1)) +
                  ") must be a multiple of the number of key/value heads (" +
                  std::to_string(k.size(1)) + ")");
  }
  if (!at::isFloatingType(q.scalar_type()) || q.scalar_type() != k.scalar_type() ||
      q.scalar_type() != v.scalar_type()) {
    fail_call(q, k, v, mask, "q, k and v must share one floating dtype");
  }
  if (scale && !std::isfinite(*scale)) {
    fail_call(q, k, v, mask, "the scale must be finite");
  }
  Shapes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  if (mask.defined()) {
    if (mask.scalar_type() != at::kBool && !at::isFloatingType(mask.scalar_type())) {
      fail_call(q, k, v, mask, "the mask must be bool or floating");
    }
    if (mask.requires_grad()) {
      fail_call(q, k, v, mask, "the mask is not differentiated; pass it detached");
    }
    const std::vector<int64_t> full{s.B, s.Hq, s.Sq, s.Sk};
    bool ok = mask.dim() <= 4;
    for (int64_t i = 0; ok && i < mask.dim(); ++i) {
      const int64_t e = mask.size(mask.dim() - 1 - i), f = full[3 - i];
      ok = e == 1 || e == f;
    }
    if (!ok) {
      fail_call(q, k, v, mask,
                "the mask of shape " + shape_str(mask.sizes()) +
                    " does not broadcast to the scores [B, Hq, Sq, Sk] = " + shape_str(full) +
                    " (at most 4 dims, each the full extent or 1)");
    }
  }
  return s;
}

// The mask's local piece as [b, hkv|1, g|1, n|1, Sk|1].
at::Tensor mask5_of(at::Tensor m, const Shapes& s, c10::ScalarType dtype) {
  while (m.dim() < 4) m = m.unsqueeze(0);
  if (m.scalar_type() != at::kBool && m.scalar_type() != dtype) m = m.to(dtype);
  const int64_t g = s.Hq / s.Hkv;
  if (m.size(1) == s.Hq && s.Hq > 1) {
    return m.reshape({m.size(0), s.Hkv, g, m.size(2), m.size(3)});
  }
  return m.unsqueeze(1);
}

// ---- the plain path -------------------------------------------------------------------------

at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& mask, bool causal, double scale) {
  const int64_t g = q.size(1) / k.size(1);
  at::Tensor kk = g > 1 ? k.repeat_interleave(g, 1) : k;
  at::Tensor vv = g > 1 ? v.repeat_interleave(g, 1) : v;
  at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) * scale;
  if (mask.defined()) {
    s = mask.scalar_type() == at::kBool ? s.masked_fill(mask.logical_not(), kNegInf)
                                        : s + mask.to(s.scalar_type());
  }
  if (causal) {
    at::Tensor hidden = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(hidden, kNegInf);
  }
  return at::matmul(at::softmax(s, -1), vv);
}

// ---- the sharded path -----------------------------------------------------------------------

// q, k, v on one mesh, k and v laid out alike (both sharded paths).
void check_same_mesh_and_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask) {
  const ShardSpec& sk = *spec_of(k);
  const ShardSpec& sv = *spec_of(v);
  const DeviceMesh& mesh = spec_of(q)->mesh();
  if (sk.mesh() != mesh || sv.mesh() != mesh) {
    fail_call(q, k, v, mask, "q, k and v live on different meshes");
  }
  if (sk != sv) {
    fail_call(
        q, k, v, mask,
        "k and v must have the same layout (" + sk.to_string() + " vs " + sv.to_string() + ")");
  }
}

// This rank's block of the mask for scores laid out as `score_spec`: a plain
// mask is sliced, a sharded one must already have that layout.
at::Tensor mask_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& mask, const ShardSpec& score_spec) {
  if (!mask.defined()) return at::Tensor();
  const ShardSpec target = operand_spec(score_spec, mask.sizes());
  const ShardSpec* ms = spec_of(mask);
  if (ms == nullptr) return detail::local_slice(mask, target);
  if (ms->mesh() != score_spec.mesh()) fail_call(q, k, v, mask, "the mask lives on another mesh");
  if (*ms != target) {
    fail_call(q, k, v, mask,
              "the mask must be a plain tensor or laid out as the scores' block [B, Hq, Sq, "
              "Sk] (sharded with the queries): expected " +
                  target.to_string() + ", got " + ms->to_string());
  }
  return local_of(mask);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& mask, bool causal, double scale, const Shapes& s) {
  const ShardSpec& sq = *spec_of(q);
  const ShardSpec& sk = *spec_of(k);
  const DeviceMesh& mesh = sq.mesh();
  check_same_mesh_and_kv(q, k, v, mask);
  if (sq.placements() != sk.placements()) {
    fail_call(q, k, v, mask,
              "q and k/v must have the same placements (" + to_string(sq.placements()) + " vs " +
                  to_string(sk.placements()) +
                  "): shard the sequence (dim 2) of all three on "
                  "the same mesh dim");
  }
  auto plan = c10::make_intrusive<RingPlan>();
  plan->mesh = mesh;
  int64_t batch_dim = -1;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const Placement& pl = sq.placements()[m];
    if (is_partial(pl)) {
      fail_call(q, k, v, mask, "Partial inputs are not accepted; redistribute them first");
    }
    if (!is_shard(pl)) continue;
    const int64_t d = shard_dim(pl) < 0 ? shard_dim(pl) + 4 : shard_dim(pl);
    if (d == 2) {
      plan->ring_dim = m;
    } else if (d == 0) {
      batch_dim = m;
      if (sq.shard_sizes(m) != sk.shard_sizes(m)) {
        fail_call(q, k, v, mask, "q and k/v must have the same batch split");
      }
    } else {
      fail_call(
          q, k, v, mask,
          "only the batch (0) and sequence (2) dims may be sharded, not dim " + std::to_string(d));
    }
  }
  // The scores' layout [B, Hq, Sq, Sk]: the mask must be laid out as its operand.
  Placements score_pl(mesh.ndim(), Replicate{});
  ShardSizes score_sizes(mesh.ndim());
  if (batch_dim >= 0) {
    score_pl[batch_dim] = Shard{0};
    score_sizes[batch_dim] = sq.shard_sizes(batch_dim);
  }
  if (plan->ring_dim >= 0) {
    score_pl[plan->ring_dim] = Shard{2};
    score_sizes[plan->ring_dim] = sq.shard_sizes(plan->ring_dim);
  }
  const ShardSpec score_spec(mesh, score_pl, {s.B, s.Hq, s.Sq, s.Sk}, score_sizes);
  at::Tensor mask_local = mask_block(q, k, v, mask, score_spec);

  // ---- no communication above this line; every check ran on every rank alike ----
  plan->groups = s.Hq / s.Hkv;
  plan->scale = scale;
  plan->causal = causal;
  at::Tensor ql = local_of(q), kl = local_of(k), vl = local_of(v);
  std::vector<std::vector<comm::Segment>> zz_segments;  // zig-zag rows per coordinate
  if (plan->ring_dim >= 0) {
    const int64_t P = mesh.size(plan->ring_dim), me = mesh.coordinate()[plan->ring_dim];
    plan->P = P;
    plan->me = me;
    const auto& q_sizes = sq.shard_sizes(plan->ring_dim);
    const auto& kv_sizes = sk.shard_sizes(plan->ring_dim);
    // Note [agreed settings]: read only where every rank would use it.
    if (causal && P > 1 && s.Sq == s.Sk &&
        comm::use_setting(mesh, Setting::CausalBalance) ==
            static_cast<int64_t>(CausalBalance::ZigZag)) {
      // Note [causal balance]: 2P chunks; coordinate c computes on chunks c and 2P-1-c.
      const auto chunks = balanced_sizes(s.Sq, 2 * P);
      const auto off = offsets_of(chunks);
      std::vector<std::pair<int64_t, int64_t>> first(P), second(P);
      for (int64_t c = 0; c < P; ++c) {
        const int64_t c2 = 2 * P - 1 - c;
        first[c] = {off[c], off[c] + chunks[c]};
        second[c] = {off[c2], off[c2] + chunks[c2]};
        zz_segments.push_back({{off[c], chunks[c]}, {off[c2], chunks[c2]}});
        plan->kv_sizes.push_back(chunks[c] + chunks[c2]);
        plan->kv_runs.push_back({{0, off[c], chunks[c]}, {chunks[c], off[c2], chunks[c2]}});
      }
      plan->q_runs = plan->kv_runs[me];
      auto to_zigzag = [&](const at::Tensor& t, int64_t dim, const std::vector<int64_t>& sizes) {
        return at::cat({comm::gather_range(t, mesh, plan->ring_dim, dim, sizes, first),
                        comm::gather_range(t, mesh, plan->ring_dim, dim, sizes, second)},
                       dim);
      };
      ql = to_zigzag(ql, 2, q_sizes);
      kl = to_zigzag(kl, 2, kv_sizes);
      vl = to_zigzag(vl, 2, kv_sizes);
      // The mask has query rows to move iff its Sq extent is the full Sq (then
      // mask_block split it with q's sizes, even when Sq == 1): a global
      // property, never this rank's piece, whose one row or none would skip the
      // collective gather_range the other ranks enter.
      if (mask_local.defined() && mask.dim() >= 2 && mask.size(-2) == s.Sq) {
        at::NoGradGuard no_grad;
        mask_local = to_zigzag(mask_local, mask_local.dim() - 2, q_sizes);
      }
    } else {
      plan->kv_sizes = kv_sizes;
      const auto kv_off = offsets_of(kv_sizes);
      for (int64_t c = 0; c < P; ++c) plan->kv_runs.push_back({{0, kv_off[c], kv_sizes[c]}});
      plan->q_runs = {{0, offsets_of(q_sizes)[me], q_sizes[me]}};
    }
  } else {
    plan->kv_sizes = {s.Sk};
    plan->kv_runs = {{{0, 0, s.Sk}}};
    plan->q_runs = {{0, 0, ql.size(2)}};
  }
  if (mask_local.defined()) {
    plan->mask5 = mask5_of(mask_local, s, q.scalar_type());
    plan->mask_full_keys = mask_local.size(-1) == s.Sk;
  }
  at::Tensor out = RingAttentionFn::apply(ql, kl, vl, plan);
  if (!zz_segments.empty()) {
    // Back to q's own split.
    out = comm::repartition(out, mesh, plan->ring_dim, 2, zz_segments,
                            sq.shard_sizes(plan->ring_dim));
  }
  return wrap(out, spec_ptr_of(q));
}

// Note [mixed-placement attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// q and k/v split differently along the sequence, on one mesh dim m (latent-
// query models: a small set of queries attending to sharded points, and back):
//  - q Replicate, k/v Shard(2): each rank attends every query to its own keys
//    and keeps the log-sum-exp l_r per query row. With M = max_r l_r (an
//    all-reduce max, detached: M cancels exactly) and w_r = exp(l_r - M), the
//    result is sum_r w_r o_r / sum_r w_r: two sum all-reduces over m (output
//    rows and normalizers). Backward: the sums' adjoint is the identity, so
//    dk/dv stay local, and dq is summed over m (comm::use_replicated).
//    Memory: Sq x Sk/P scores per rank.
//  - q Shard(2), k/v Replicate: this rank's query rows attend to all keys, no
//    forward communication; dk/dv are summed over m (comm::use_replicated).
// Batch may be split (Shard(0), same sizes) on other mesh dims. A mask is
// sliced to the scores' local block like the ring path's; is_causal compares
// global positions (key j visible to query i iff j <= i).
at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& mask, bool causal, double scale, const Shapes& s) {
  const ShardSpec& sq = *spec_of(q);
  const ShardSpec& sk = *spec_of(k);
  const DeviceMesh& mesh = sq.mesh();
  check_same_mesh_and_kv(q, k, v, mask);
  auto dim_of = [](const Placement& p) {
    return is_shard(p) ? (shard_dim(p) < 0 ? shard_dim(p) + 4 : shard_dim(p)) : int64_t(-1);
  };
  int64_t kv_dim = -1, q_dim = -1;  // the mesh dim that splits only k/v, or only q
  Placements score_pl(mesh.ndim(), Replicate{});
  ShardSizes score_sizes(mesh.ndim());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const Placement& a = sq.placements()[m];
    const Placement& b = sk.placements()[m];
    if (is_partial(a) || is_partial(b)) {
      fail_call(q, k, v, mask, "Partial inputs are not accepted; redistribute them first");
    }
    const int64_t da = dim_of(a), db = dim_of(b);
    if (da == 0 && db == 0) {
      if (sq.shard_sizes(m) != sk.shard_sizes(m)) {
        fail_call(q, k, v, mask, "q and k/v must have the same batch split");
      }
      score_pl[m] = Shard{0};
      score_sizes[m] = sq.shard_sizes(m);
    } else if (da == -1 && db == 2 && kv_dim < 0 && q_dim < 0) {
      kv_dim = m;
      score_pl[m] = Shard{3};
      score_sizes[m] = sk.shard_sizes(m);
    } else if (da == 2 && db == -1 && kv_dim < 0 && q_dim < 0) {
      q_dim = m;
      score_pl[m] = Shard{2};
      score_sizes[m] = sq.shard_sizes(m);
    } else if (!(da == -1 && db == -1)) {
      fail_call(q, k, v, mask,
                "unsupported placements " + to_string(sq.placements()) + " (q) with " +
                    to_string(sk.placements()) +
                    " (k/v): per mesh dim, q and k/v must be both Shard(0) (batch), both "
                    "Shard(2) on every mesh dim alike (ring attention), or on one mesh dim "
                    "Replicate with Shard(2) (mixed; Note [mixed-placement attention])");
    }
  }
  const ShardSpec score_spec(mesh, score_pl, {s.B, s.Hq, s.Sq, s.Sk}, score_sizes);
  at::Tensor mask_local = mask_block(q, k, v, mask, score_spec);
  // ---- no communication above this line; every check ran on every rank alike ----
  at::Tensor ql = local_of(q), kl = local_of(k), vl = local_of(v);
  const int64_t g = s.Hq / s.Hkv;
  if (q_dim >= 0) {
    kl = comm::use_replicated(kl, mesh, {q_dim});
    vl = comm::use_replicated(vl, mesh, {q_dim});
  } else {
    ql = comm::use_replicated(ql, mesh, {kv_dim});
  }
  at::Tensor kk = g > 1 ? kl.repeat_interleave(g, 1) : kl;
  at::Tensor vv = g > 1 ? vl.repeat_interleave(g, 1) : vl;
  at::Tensor sc = at::matmul(ql, kk.transpose(-2, -1)) * scale;
  if (mask_local.defined()) {
    sc = mask_local.scalar_type() == at::kBool ? sc.masked_fill(mask_local.logical_not(), kNegInf)
                                               : sc + mask_local.to(sc.scalar_type());
  }
  if (causal) {
    const int64_t q0 = q_dim >= 0 ? offsets_of(sq.shard_sizes(q_dim))[mesh.coordinate()[q_dim]] : 0;
    const int64_t k0 =
        kv_dim >= 0 ? offsets_of(sk.shard_sizes(kv_dim))[mesh.coordinate()[kv_dim]] : 0;
    auto opts = at::TensorOptions().dtype(at::kLong);
    at::Tensor qi = at::arange(q0, q0 + ql.size(2), opts).unsqueeze(1);
    at::Tensor kj = at::arange(k0, k0 + kl.size(2), opts).unsqueeze(0);
    sc = sc.masked_fill(kj > qi, kNegInf);
  }
  if (q_dim >= 0) {
    return wrap(at::matmul(at::softmax(sc, -1), vv), spec_ptr_of(q));
  }
  // q Replicate, k/v Shard(2) on kv_dim: combine the per-rank partial softmaxes.
  // Stabilizers are detached constants (they cancel exactly), so every
  // differentiable path is exp(score - constant): no 0 * inf in backward for a
  // row with no visible key here (empty piece, mask, causal).
  // Note [reduced precision]: float16/bfloat16 scores are combined in float32
  // (exp, partial sums, all-reduces) and the result is rounded once.
  const at::ScalarType out_type = sc.scalar_type();
  sc = sc.to(acc_dtype(out_type));
  vv = vv.to(sc.scalar_type());
  at::Tensor top_local, factor;
  {
    at::NoGradGuard no_grad;
    at::Tensor row_max = sc.size(-1) > 0 ? std::get<0>(sc.detach().max(-1, /*keepdim=*/true))
                                         : at::full({sc.size(0), sc.size(1), sc.size(2), 1},
                                                    kNegInf, sc.options().requires_grad(false));
    at::Tensor seen = row_max.isfinite();
    top_local = at::where(seen, row_max, at::zeros_like(row_max));
    at::Tensor top = comm::all_reduce_nograd(row_max, mesh, {kv_dim}, ReduceOp::Max);
    factor = at::where(seen, at::exp(row_max - top), at::zeros_like(row_max));
  }
  at::Tensor e = at::exp(sc - top_local);  // [b, Hq, Sq, Sk_local], 0 where hidden
  at::Tensor num = comm::all_reduce(at::matmul(e, vv) * factor, mesh, {kv_dim});
  at::Tensor den = comm::all_reduce(e.sum(-1, /*keepdim=*/true) * factor, mesh, {kv_dim});
  return wrap((num / den).to(out_type), spec_ptr_of(q));
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& attn_mask,
                                        bool is_causal, std::optional<double> scale) {
  const Shapes s = check_shapes(q, k, v, attn_mask, scale);
  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  const int n_sharded = (spec_of(q) != nullptr) + (spec_of(k) != nullptr) + (spec_of(v) != nullptr);
  if (n_sharded == 0) {
    if (spec_of(attn_mask)) {
      fail_call(q, k, v, attn_mask, "a ShardTensor mask needs ShardTensor q, k, v");
    }
    return plain_attention(q, k, v, attn_mask, is_causal, sc);
  }
  if (n_sharded != 3) {
    fail_call(q, k, v, attn_mask, "q, k and v must be all ShardTensors or all plain tensors");
  }
  {
    // Note [reduced precision]: the sharded paths compute float16/bfloat16 in
    // float32; they must still refuse a dtype libtorch's matmul/softmax refuse.
    const bool rg = ops::will_backward(q) || ops::will_backward(k) || ops::will_backward(v);
    const std::string why =
        ops::dtype_support_error("scaled_dot_product_attention", {q.scalar_type()}, rg,
                                 [](c10::ArrayRef<at::ScalarType> t, bool grad) {
                                   at::Tensor x = ops::probe_ones({1, 1, 2, 2}, t[0], grad);
                                   return plain_attention(x, x, x, at::Tensor(), false, 1.0);
                                 });
    if (!why.empty()) fail_call(q, k, v, attn_mask, why);
  }
  if (spec_of(q)->placements() != spec_of(k)->placements() &&
      spec_of(q)->mesh() == spec_of(k)->mesh()) {
    return mixed_attention(q, k, v, attn_mask, is_causal, sc,
                           s);  // Note [mixed-placement attention]
  }
  return ring_attention(q, k, v, attn_mask, is_causal, sc, s);
}

namespace {

// aten::scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
// is_causal=False, *, scale=None, enable_gqa=False) -> Tensor on ShardTensors: ring
// attention. The op is CompositeImplicitAutograd in torch 2.x; taking it here, before
// its decomposition into _fused_sdp_choice and a backend kernel
// (_scaled_dot_product_flash_attention_for_cpu, ...), keeps the S x S scores unbuilt.
void sdpa_rule(const c10::OperatorHandle& op, ops::Stack* stack) {
  auto args = pop_args(op, stack);
  const double dropout_p = args[4].toDouble();
  if (dropout_p != 0.0) {
    fail(op, args, "dropout inside sharded attention is not supported (dropout_p must be 0)");
  }
  const bool enable_gqa = args[7].toBool();
  const at::Tensor& q = args[0].toTensor();
  const at::Tensor& k = args[1].toTensor();
  if (!enable_gqa && q.dim() >= 3 && k.dim() >= 3 && q.size(-3) != k.size(-3)) {
    fail(op, args,
         "query and key have different numbers of heads; pass enable_gqa=True for grouped-query "
         "attention (as torch requires)");
  }
  at::Tensor mask = args[3].isTensor() ? args[3].toTensor() : at::Tensor();
  std::optional<double> scale;
  if (!args[6].isNone()) scale = args[6].toDouble();
  at::Tensor out =
      scaled_dot_product_attention(q, k, args[2].toTensor(), mask, args[5].toBool(), scale);
  stack->push_back(out);
}

const RuleRegistrar sdpa_ops({"scaled_dot_product_attention"}, sdpa_rule);

}  // namespace
}  // namespace shardtensor
