// shardtensor::neighborhood_attention (include/shardtensor/ops/neighborhood_attention.h):
// NATTEN's clamped-window attention on 1-3-D token grids. On sharded grids
// every coordinate of a mesh dim that shards a spatial dim fetches exactly the
// key/value range its queries' windows reach (comm::gather_range, whose
// backward returns the halo gradients to their owners); the attention itself
// is then local: gather each query's K^D neighbours, scores, softmax, weighted
// sum, all libtorch ops (differentiable).
#include <shardtensor/ops/neighborhood_attention.h>

#include <ATen/ATen.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ops/common.h"

namespace shardtensor {

namespace {

constexpr const char* kOp = "shardtensor::neighborhood_attention";

struct Window {
  int64_t K = 1, d = 1;
  bool causal = false;
};

// Global key position of tap t (0 .. K-1) of query i along a dim of extent n
// (Note [neighbourhood window]); -1 where a causal tap falls before the grid.
int64_t tap(int64_t i, int64_t t, int64_t n, const Window& w) {
  if (w.causal) {
    const int64_t j = i - (w.K - 1 - t) * w.d;
    return j >= 0 ? j : -1;
  }
  const int64_t r = i % w.d, j = i / w.d, L = (n - r + w.d - 1) / w.d;
  const int64_t s = std::clamp<int64_t>(j - w.K / 2, 0, L - w.K);
  return r + (s + t) * w.d;
}

// The key range [lo, hi) that the windows of queries [a, b) reach ({a, a} if none).
std::pair<int64_t, int64_t> key_range(int64_t a, int64_t b, int64_t n, const Window& w) {
  if (a >= b) return {a, a};
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = a; i < b; ++i) {
    for (int64_t t = 0; t < w.K; ++t) {
      const int64_t j = tap(i, t, n, w);
      if (j < 0) continue;
      lo = std::min(lo, j);
      hi = std::max(hi, j + 1);
    }
  }
  return {lo, hi};
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  if (const ShardSpec* s = ops::spec_of(t)) {
    os << "ShardTensor(global=" << c10::IntArrayRef(s->global_shape())
       << ", placements=" << to_string(s->placements()) << ")";
  } else {
    os << "Tensor" << t.sizes();
  }
  return os.str();
}

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t K, int64_t d,
                std::optional<double> scale) {
  auto fail = [&](const std::string& why) {
    TORCH_CHECK(false, kOp, ": ", why, " (q=", describe(q), ", k=", describe(k),
                ", v=", describe(v), ", kernel_size=", K, ", dilation=", d, ")");
  };
  if (!q.defined() || !k.defined() || !v.defined()) fail("q, k and v must be defined");
  const ShardSpec *sq = ops::spec_of(q), *sk = ops::spec_of(k), *sv = ops::spec_of(v);
  if ((sq == nullptr) != (sk == nullptr) || (sq == nullptr) != (sv == nullptr)) {
    fail("q, k and v must be all plain tensors or all ShardTensors");
  }
  if (q.dim() < 4 || q.dim() > 6) {
    fail("expected [B, heads, *spatial, D] with 1 to 3 spatial dims");
  }
  if (k.sizes() != q.sizes()) fail("k must have the shape of q");
  if (v.dim() != q.dim() || v.sizes().slice(0, q.dim() - 1) != q.sizes().slice(0, q.dim() - 1)) {
    fail("v must have the shape of q except its last dim");
  }
  if (!at::isFloatingType(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type()) {
    fail("q, k and v must have one floating dtype");
  }
  if (K < 1 || K % 2 == 0) fail("kernel_size must be odd and positive");
  if (d < 1) fail("dilation must be positive");
  for (int64_t td = 2; td + 1 < q.dim(); ++td) {
    if (K * d > q.size(td)) {
      fail("kernel_size * dilation = " + std::to_string(K * d) + " exceeds the extent " +
           std::to_string(q.size(td)) + " of spatial dim " + std::to_string(td));
    }
  }
  if (scale && !(std::isfinite(*scale) && *scale > 0)) fail("scale must be finite and positive");
  if (sq == nullptr) return;
  if (!(sq->mesh() == sk->mesh()) || !(sq->mesh() == sv->mesh())) {
    fail("q, k and v must be on one mesh");
  }
  if (sk->placements() != sq->placements() || sv->placements() != sq->placements() ||
      sk->all_shard_sizes() != sq->all_shard_sizes() ||
      sv->all_shard_sizes() != sq->all_shard_sizes()) {
    fail("q, k and v must have the same placements and shard sizes");
  }
  for (const auto& p : sq->placements()) {
    if (const auto* s = std::get_if<Shard>(&p)) {
      if (s->dim == 1 || s->dim == q.dim() - 1) {
        fail("the head and feature dims must not be sharded (shard batch or spatial dims)");
      }
    }
  }
}

}  // namespace

at::Tensor neighborhood_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& v_in, int64_t kernel_size, int64_t dilation,
                                  bool is_causal, std::optional<double> scale) {
  // Note [pending partial sums]: a Partial input (a projection of
  // feature-sharded tokens) is summed first.
  const at::Tensor q = ops::summed_partial(q_in), k = ops::summed_partial(k_in),
                   v = ops::summed_partial(v_in);
  check_args(q, k, v, kernel_size, dilation, scale);
  const Window w{kernel_size, dilation, is_causal};
  const int64_t nd = q.dim() - 3, K = kernel_size;
  const ShardSpec* spec = ops::spec_of(q);
  at::Tensor ql = ops::local_of(q), kl = ops::local_of(k), vl = ops::local_of(v);

  // Per spatial dim: this rank's query run, the key range it needs (fetched
  // from the neighbours when the dim is sharded), and the local index of
  // every tap ([nq, K]) with its validity (causal taps before the grid).
  std::vector<at::Tensor> idx(nd), valid(nd);
  std::vector<int64_t> nq(nd);
  auto opts = at::TensorOptions().dtype(at::kLong);
  for (int64_t sd = 0; sd < nd; ++sd) {
    const int64_t td = 2 + sd, n = q.size(td);
    const int64_t m = spec != nullptr ? spec->mesh_dim_of(td) : -1;
    int64_t a = 0, b = n, lo = 0;
    if (m >= 0) {
      const auto& sizes = spec->shard_sizes(m);
      const auto offs = offsets_of(sizes);
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (size_t c = 0; c < sizes.size(); ++c) {
        ranges.push_back(key_range(offs[c], offs[c] + sizes[c], n, w));
      }
      const int64_t me = spec->mesh().coordinate()[m];
      a = offs[me];
      b = a + sizes[me];
      lo = ranges[me].first;
      kl = comm::gather_range(kl, spec->mesh(), m, td, sizes, ranges);
      vl = comm::gather_range(vl, spec->mesh(), m, td, sizes, ranges);
    }
    nq[sd] = b - a;
    std::vector<int64_t> ix, ok;
    ix.reserve((b - a) * K);
    ok.reserve((b - a) * K);
    for (int64_t i = a; i < b; ++i) {
      for (int64_t t = 0; t < K; ++t) {
        const int64_t j = tap(i, t, n, w);
        ix.push_back(j < 0 ? i - lo : j - lo);  // an invalid tap reads the query's own key
        ok.push_back(j >= 0);
      }
    }
    idx[sd] = at::tensor(ix, opts).view({b - a, K});
    valid[sd] = at::tensor(ok, opts).view({b - a, K}).to(at::kBool);
  }

  // Neighbourhoods: [B, H, n1, K, n2, K, ..., C] -> [B, H, n1, .., n_nd, K^nd, C].
  auto neighbours = [&](at::Tensor t) {
    for (int64_t sd = 0; sd < nd; ++sd) {
      const int64_t dim = 2 + 2 * sd;
      t = t.index_select(dim, idx[sd].reshape({-1}));
      std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
      shape[dim] = nq[sd];
      shape.insert(shape.begin() + dim + 1, K);
      t = t.view(shape);
    }
    std::vector<int64_t> perm{0, 1}, shape{t.size(0), t.size(1)};
    for (int64_t sd = 0; sd < nd; ++sd) {
      perm.push_back(2 + 2 * sd);
      shape.push_back(nq[sd]);
    }
    for (int64_t sd = 0; sd < nd; ++sd) perm.push_back(3 + 2 * sd);
    perm.push_back(2 + 2 * nd);
    int64_t taps = 1;
    for (int64_t sd = 0; sd < nd; ++sd) taps *= K;
    shape.push_back(taps);
    shape.push_back(t.size(-1));
    return t.permute(perm).reshape(shape);
  };
  at::Tensor kn = neighbours(kl), vn = neighbours(vl);

  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor s = at::matmul(ql.unsqueeze(-2), kn.transpose(-2, -1)).squeeze(-2) * sc;
  if (is_causal) {
    // Visible iff valid along every dim: the outer product of the per-dim masks.
    at::Tensor mask;
    std::vector<int64_t> full(nq.begin(), nq.end()), flat(nq.begin(), nq.end());
    for (int64_t sd = 0; sd < nd; ++sd) {
      // [nq, K] viewed with nq at position sd and K at nd + sd (order kept).
      std::vector<int64_t> view_shape(2 * nd, 1);
      view_shape[sd] = nq[sd];
      view_shape[nd + sd] = K;
      at::Tensor vsd = valid[sd].view(view_shape);
      mask = mask.defined() ? mask.logical_and(vsd) : vsd;
      full.push_back(K);
    }
    int64_t taps = 1;
    for (int64_t sd = 0; sd < nd; ++sd) taps *= K;
    flat.push_back(taps);  // explicit: a piece may hold no queries
    mask = mask.expand(full).reshape(flat);
    s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  }
  at::Tensor p = at::softmax(s, -1);
  at::Tensor out = at::matmul(p.unsqueeze(-2), vn).squeeze(-2);
  if (spec == nullptr) return out;
  std::vector<int64_t> shape(spec->global_shape());
  shape.back() = v.size(-1);
  return ops::wrap(
      out, ops::make_spec(spec->mesh(), spec->placements(), shape, spec->all_shard_sizes()));
}

}  // namespace shardtensor
