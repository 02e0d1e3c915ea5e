// Sorting and selection on ShardTensors (Notes [select layout], [distributed
// selection], [selection ties], [sort gather]) against single-process
// libtorch on the gathered tensor: values, indices and input gradients,
// float32 and float64, balanced and empty-first pieces, ties and NaNs, along
// sharded and unsharded dims; traffic and memory of the selection; bad input.
#include <torch/torch.h>

#include <limits>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
using shardtensor::DeviceMesh;
using shardtensor::Placements;
using shardtensor::ShardTensor;

namespace {

using Fn1 = std::function<at::Tensor(const at::Tensor&)>;

// Every layout of kLayouts: balanced pieces in float32 and float64 (uneven at
// 3 ranks), and an empty first piece in float64.
void sweep(const DeviceMesh& mesh, const std::string& name, const Fn1& f, const at::Tensor& x,
           const std::vector<Placements>& layouts, bool grad = true) {
  const std::vector<std::pair<bool, at::ScalarType>> runs = {
      {false, at::kFloat}, {false, at::kDouble}, {true, at::kDouble}};
  for (const auto& p : layouts) {
    for (const auto& [empty, dtype] : runs) {
      auto full = x.to(dtype);
      auto in = empty ? empty_first_input(mesh, full, p, grad) : sharded_input(mesh, full, p, grad);
      auto fn = [&](const std::vector<at::Tensor>& v, const std::vector<at::Tensor>&) {
        return f(v[0]);
      };
      // Selections move elements: exact.
      EXPECT_TRUE(reference_check(fn, {in}, mesh, {}, 0.0, 0.0, grad))
          << name << " on " << st::to_string(*in.placements) << (empty ? " empty-first" : "") << " "
          << c10::toString(dtype);
    }
  }
}

// Sharded along dim 0, dim 1, dim 2 and not along dim 1; on the 2x2 mesh two dims at once.
const std::vector<Placements> kLayouts = {{S0, S1}, {S1, S0}, {S2, S1}, {R, S1}};

at::Tensor idx_as(const at::Tensor& i, const at::Tensor& like) { return i.to(like.scalar_type()); }

// Values and indices in one output, stacked in a new first dim (the gradient
// flows through the values). ShardTensor results cannot all be flattened
// (reshape refuses to merge a sharded dim), hence stack and cat along dim 0.
at::Tensor vi(const std::tuple<at::Tensor, at::Tensor>& r) {
  const auto& [v, i] = r;
  return at::stack({v * 1.5, idx_as(i, v)});
}

// Rounded values: many ties; a few NaNs where `nans`.
at::Tensor tied(c10::IntArrayRef shape, uint64_t seed, bool nans) {
  auto x = at::round(rnd(shape, seed, 1.5));
  if (nans) {
    auto m = rnd(shape, seed + 100) > 1.2;
    x = x.masked_fill(m, std::numeric_limits<double>::quiet_NaN());
  }
  return x;
}

// Collective. The index of every position of a selection holds an element
// equal to its value (NaN for NaN).
bool points_at_value(const at::Tensor& x, int64_t d, const at::Tensor& v, const at::Tensor& i) {
  auto gi = gathered(i), gv = gathered(v);
  auto at_i = x.gather(d, gi.unsqueeze(d)).squeeze(d);
  return all_ranks(
      (at_i == gv).logical_or(at_i.isnan().logical_and(gv.isnan())).all().item<bool>());
}

}  // namespace

TEST(Select, SortAndArgsort) {
  auto mesh = test_mesh();
  auto x = rnd({7, 9, 3}, 1);
  for (int64_t d : {0, 1, -1}) {
    const bool desc = d == 1;
    sweep(
        mesh, "sort " + std::to_string(d) + (desc ? " descending" : ""),
        [=](const at::Tensor& t) { return vi(at::sort(t, d, desc)); }, x, kLayouts);
  }
  // Stable sort and argsort on ties: libtorch's own order.
  auto y = tied({7, 9, 3}, 2, false);
  for (int64_t d : {0, 1}) {
    sweep(
        mesh, "stable sort, argsort " + std::to_string(d),
        [=](const at::Tensor& t) {
          return at::cat({vi(at::sort(t, /*stable=*/true, d, /*descending=*/true)),
                          at::stack({idx_as(at::argsort(t, /*stable=*/true, d), t),
                                     idx_as(at::argsort(t, d), t)})});
        },
        y, kLayouts);
  }
}

TEST(Select, KthvalueMedianDistinctValues) {
  // Distinct values: indices and gradients are unique, so all must match libtorch.
  auto mesh = test_mesh();
  auto x = rnd({7, 9, 3}, 3);
  sweep(
      mesh, "kthvalue 1, 7 dim 0",
      [](const at::Tensor& t) {
        return at::cat({vi(at::kthvalue(t, 1, 0)), vi(at::kthvalue(t, 7, 0))});
      },
      x, kLayouts);
  sweep(
      mesh, "kthvalue 3 dim 1 keepdim",
      [](const at::Tensor& t) { return vi(at::kthvalue(t, 3, 1, true)); }, x, kLayouts);
  sweep(
      mesh, "kthvalue 2 dim -1", [](const at::Tensor& t) { return vi(at::kthvalue(t, 2, -1)); }, x,
      kLayouts);
  for (int64_t d : {0, 1, -1}) {
    const bool keep = d == 1;
    sweep(
        mesh, "median.dim, nanmedian.dim " + std::to_string(d),
        [=](const at::Tensor& t) {
          return at::cat({vi(at::median(t, d, keep)), vi(at::nanmedian(t, d, keep))});
        },
        x, kLayouts);
  }
}

TEST(Select, MedianTiesAndNaNsMatchLibtorch) {
  // median.dim / nanmedian.dim take equal values in index order, as libtorch
  // 1.13 does (Note [selection ties]): values, indices and gradients match,
  // with ties and NaNs.
  auto mesh = test_mesh();
  for (bool nans : {false, true}) {
    auto x = tied({8, 9, 3}, 4, nans);
    for (int64_t d : {0, 1}) {
      sweep(
          mesh, "median.dim, nanmedian.dim " + std::to_string(d) + (nans ? " nans" : ""),
          [=](const at::Tensor& t) {
            return at::cat({vi(at::median(t, d)), vi(at::nanmedian(t, d))});
          },
          x, kLayouts);
    }
  }
  // A position that is all NaN: nanmedian is NaN there; libtorch's index is
  // implementation-defined (its nth_element among equivalent NaNs: 7 for 9
  // NaNs, 8 for 10), ours the first NaN (Note [selection ties]).
  auto x = tied({8, 9, 3}, 4, true);
  x.select(0, 2).select(1, 1).fill_(std::numeric_limits<double>::quiet_NaN());
  for (int64_t d : {0, 1}) {
    sweep(
        mesh, "nanmedian.dim all-NaN position " + std::to_string(d),
        [=](const at::Tensor& t) { return std::get<0>(at::nanmedian(t, d)); }, x, kLayouts, false);
    for (const auto& p : kLayouts) {
      auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, p));
      auto [v, i] = at::nanmedian(sx, d);
      EXPECT_TRUE(points_at_value(x, d, v, i)) << "all-NaN index on " << st::to_string(p);
    }
  }
}

TEST(Select, KthvalueTiesPointAtAnEqualElement) {
  // libtorch's kthvalue picks among equal values in an unspecified way; ours
  // takes them in index order (Note [selection ties]). Values must equal
  // libtorch's, the index must hold an element equal to the value (NaN
  // included), and the gradient goes to that element.
  auto mesh = test_mesh();
  for (bool nans : {false, true}) {
    auto x = tied({8, 9, 3}, 5, nans);
    for (int64_t d : {0, 1}) {
      const std::vector<int64_t> ks =
          d == 0 ? std::vector<int64_t>{1, 4, 8} : std::vector<int64_t>{5};
      const std::string what = "kthvalue dim " + std::to_string(d) + (nans ? " nans" : "");
      sweep(
          mesh, what,
          [=](const at::Tensor& t) {
            std::vector<at::Tensor> vs;
            for (int64_t k : ks) vs.push_back(std::get<0>(at::kthvalue(t, k, d)));
            return at::stack(vs);
          },
          x, kLayouts, false);
      for (const auto& p : {kLayouts[0], kLayouts[1]}) {
        for (bool empty : {false, true}) {
          auto in = empty ? empty_first_input(mesh, x, p) : sharded_input(mesh, x, p);
          auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, *in.placements));
          if (in.sizes) sx = st::ShardTensor(sx.redistribute(*in.placements, in.sizes));
          sx.local().requires_grad_(true);
          auto [v, i] = at::kthvalue(sx, ks.back(), d);
          EXPECT_TRUE(points_at_value(x, d, v, i))
              << what << " on " << st::to_string(*in.placements);
          st::backward(v, at::ones(v.sizes(), v.options()));
          auto expect = at::zeros_like(x).scatter(d, gathered(i).unsqueeze(d), 1.0);
          EXPECT_TRUE(all_close(gathered(sx.grad()), expect, 0, 0)) << what << " gradient";
        }
      }
    }
  }
}

TEST(Select, WholeTensorMedian) {
  // median() / nanmedian(): a plain result; the gradient is shared by the
  // elements equal to it (libtorch's evenly_distribute_backward).
  auto mesh = test_mesh();
  const std::vector<Placements> layouts = {{S0, S1}, {S1, S0}, {S2, R}, {R, R}};
  for (auto [nans, ties] :
       std::vector<std::pair<bool, bool>>{{false, false}, {true, true}, {false, true}}) {
    auto x = ties ? tied({7, 5, 3}, 6, nans) : rnd({7, 5, 3}, 6);
    sweep(
        mesh, std::string("median(), nanmedian()") + (ties ? " ties" : "") + (nans ? " nans" : ""),
        [](const at::Tensor& t) {
          return at::stack({at::median(t), at::nanmedian(t)}) * 1.5;
        },
        x, layouts);
  }
  // One NaN among distinct values; an even count (the lower middle); all NaN.
  auto y = rnd({6, 4}, 7);
  y.view(-1)[17] = std::numeric_limits<double>::quiet_NaN();
  sweep(mesh, "median() even, one NaN",
        [](const at::Tensor& t) {
          return at::stack({at::median(t), at::nanmedian(t)});
        },
        y, {{S0, S1}, {S1, S0}});
  sweep(
      mesh, "nanmedian() all NaN", [](const at::Tensor& t) { return at::nanmedian(t); },
      at::full({6, 4}, std::numeric_limits<double>::quiet_NaN()), {{S0, S1}}, false);
}

TEST(Select, Mode) {
  auto mesh = test_mesh();
  auto x = at::round(rnd({7, 9, 3}, 8, 1.2));
  for (int64_t d : {0, 1, -1}) {
    const bool keep = d == 1;
    sweep(
        mesh, "mode " + std::to_string(d) + (keep ? " keepdim" : ""),
        [=](const at::Tensor& t) { return vi(at::mode(t, d, keep)); }, x, kLayouts);
  }
}

TEST(Select, QuantileAndNanquantile) {
  auto mesh = test_mesh();
  auto x = rnd({7, 9, 3}, 12);
  auto q = at::tensor(std::vector<double>{0.0, 0.25, 0.5, 0.9, 1.0});
  struct Case {
    c10::optional<int64_t> dim;
    bool keepdim;
    const char* interpolation;
  };
  const std::vector<Case> cases = {
      {0, false, "linear"},           {1, false, "lower"},
      {-1, true, "nearest"},          {c10::nullopt, false, "midpoint"},
      {c10::nullopt, true, "higher"}, {1, true, "linear"}};
  for (const auto& c : cases) {
    const std::string what = std::string(c.interpolation) + " dim " +
                             (c.dim ? std::to_string(*c.dim) : "None") +
                             (c.keepdim ? " keepdim" : "");
    // Distinct values: gradients go to unique elements, so they match libtorch's.
    sweep(
        mesh, "quantile " + what,
        [=](const at::Tensor& t) {
          return at::quantile(t, q.to(t.scalar_type()), c.dim, c.keepdim, c.interpolation) * 1.5;
        },
        x, kLayouts);
  }
  sweep(
      mesh, "quantile.scalar, nanquantile.scalar",
      [=](const at::Tensor& t) {
        return at::stack(
            {at::quantile(t, 0.3, 1, false), at::nanquantile(t, 0.7, 1, false, "nearest")});
      },
      x, kLayouts);
  // Ties and NaNs: values (nanquantile ignores NaN, quantile returns NaN).
  auto y = tied({8, 9, 3}, 13, true);
  y.select(0, 2).select(1, 1).fill_(std::numeric_limits<double>::quiet_NaN());
  for (const auto& c : cases) {
    const std::string what =
        std::string(c.interpolation) + " dim " + (c.dim ? std::to_string(*c.dim) : "None");
    sweep(
        mesh, "quantile, nanquantile ties, NaN " + what,
        [=](const at::Tensor& t) {
          auto qt = q.to(t.scalar_type());
          return at::stack({at::quantile(t, qt, c.dim, c.keepdim, c.interpolation),
                            at::nanquantile(t, qt, c.dim, c.keepdim, c.interpolation)});
        },
        y, kLayouts, false);
  }
  auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S1}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::quantile(sx, 1.5, 0); }, {"quantile", "range"}));
  EXPECT_TRUE(
      throws_everywhere([&] { auto r = at::quantile(sx, 0.5, 4); }, {"quantile", "out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::quantile(sx, 0.5, 0, false, "cubic"); },
                                {"quantile", "interpolation"}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::quantile(sx, q, 0); }, {"quantile", "dtype"}));
  // Along the sharded dim: no gather.
  st::reset_comm_stats();
  auto r = at::quantile(sx, q.to(at::kFloat), 0);
  EXPECT_EQ(st::comm_stats().gathered_bytes, 0);
}

TEST(Select, TrafficAndLayouts) {
  auto mesh = test_mesh();
  const int64_t P = mesh.size(0);
  // Along a dim no mesh dim shards: no communication, layout kept.
  auto x = rnd({6, 10, 4}, 9);
  auto sx = st::ShardTensor(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0, S2})));
  st::reset_comm_stats();
  auto [sv, si] = at::sort(sx, 1);
  auto [kv, ki] = at::kthvalue(sx, 3, 1);
  auto [mv, mi] = at::median(sx, 1);
  auto [nv, ni] = at::nanmedian(sx, 1, true);
  auto [ov, oi] = at::mode(sx, 1);
  auto ai = at::argsort(sx, /*stable=*/true, 1);
  auto s0 = st::comm_stats();
  EXPECT_EQ(s0.bytes_sent + s0.bytes_received + s0.messages, 0);
  EXPECT_EQ(st::ShardTensor(sv).spec(), sx.spec());
  EXPECT_EQ(st::ShardTensor(ai).spec().placements(), sx.spec().placements());
  EXPECT_EQ(st::ShardTensor(kv).spec().placements(), fit_placements(mesh, {S0, S1}));
  EXPECT_EQ(st::ShardTensor(nv).spec().placements(), sx.spec().placements());
  EXPECT_TRUE(all_close(gathered(mv), std::get<0>(at::median(x, 1)), 0, 0));

  // Along a sharded dim: the selection never gathers the dim. What a rank
  // receives is independent of the dim's length (a fixed number of rounds of
  // counts per position), no byte is counted as gathered, and peak memory is
  // a small multiple of the piece.
  std::vector<int64_t> received;
  ShardTensor sy;
  at::Tensor y;
  for (int64_t n : {20000, 60000}) {
    y = rnd({n, 2}, 10);
    sy = st::ShardTensor(st::distribute_tensor(y, mesh, fit_placements(mesh, {S0})));
    const int64_t piece = sy.local().numel() * 4;
    st::reset_comm_stats();
    st::reset_peak_memory_stats();
    const int64_t before = st::memory_stats().current_bytes;
    auto [yv, yi] = at::median(sy, 0);
    auto [qv, qi] = at::kthvalue(sy, 12345, 0);
    const auto s1 = st::comm_stats();
    const int64_t peak = st::memory_stats().peak_bytes - before;
    received.push_back(s1.bytes_received);
    EXPECT_EQ(s1.gathered_bytes, 0);
    EXPECT_LE(peak, 8 * piece + 65536);
    if (st::world_rank() == 0) {
      std::printf(
          "[select] median.dim + kthvalue of [%lld, 2] over %lld ranks: %lld bytes received, "
          "%lld messages, peak +%lld bytes (piece %lld bytes)\n",
          static_cast<long long>(n), static_cast<long long>(P),
          static_cast<long long>(s1.bytes_received), static_cast<long long>(s1.messages),
          static_cast<long long>(peak), static_cast<long long>(piece));
    }
    EXPECT_TRUE(all_close(gathered(yv), std::get<0>(at::median(y, 0)), 0, 0));
    EXPECT_TRUE(all_close(gathered(yi), std::get<1>(at::median(y, 0)), 0, 0));
    EXPECT_TRUE(all_close(gathered(qv), std::get<0>(at::kthvalue(y, 12345, 0)), 0, 0));
    EXPECT_TRUE(all_close(gathered(qi), std::get<1>(at::kthvalue(y, 12345, 0)), 0, 0));
  }
  EXPECT_EQ(received[0], received[1]);
  // Gathering the dim would receive (n - piece) * 2 * 4 bytes.
  if (P > 1) EXPECT_LT(received[1], (60000 - sy.local().size(0)) * 2 * 4 / 4);

  // sort along a sharded dim gathers it, visibly; strict mode refuses it.
  st::reset_comm_stats();
  auto [zv, zi] = at::sort(sy, 0);
  EXPECT_EQ(st::comm_stats().gathered_bytes, P > 1 ? (60000 - sy.local().size(0)) * 2 * 4 : 0);
  EXPECT_TRUE(all_close(gathered(zv), std::get<0>(at::sort(y, 0)), 0, 0));
  if (P > 1) {
    const bool was = st::strict();
    st::set_strict(true);
    EXPECT_TRUE(throws_everywhere([&] { auto r = at::sort(sy, 0); }, {"aten::sort", "strict"}));
    EXPECT_TRUE(throws_everywhere([&] { auto r = at::mode(sy, 0); }, {"aten::mode", "strict"}));
    auto [wv, wi] = at::median(sy, 0);  // no gather: allowed in strict mode
    st::set_strict(was);
  }
}

TEST(Select, IntegerTensors) {
  // Integer keys are the values themselves; no NaN handling.
  auto mesh = test_mesh();
  for (auto dtype : {at::kLong, at::kInt}) {
    auto x = at::round(rnd({9, 4}, 15, 3.0)).to(dtype);
    for (const auto& p : {Placements{S0, S1}, Placements{S1, S0}}) {
      auto sx = st::distribute_tensor(x, mesh, fit_placements(mesh, p));
      auto [mv, mi] = at::median(sx, 0);
      EXPECT_TRUE(all_close(gathered(mv), std::get<0>(at::median(x, 0)), 0, 0));
      EXPECT_TRUE(all_close(gathered(mi), std::get<1>(at::median(x, 0)), 0, 0));
      auto [kv, ki] = at::kthvalue(sx, 7, 0);
      EXPECT_TRUE(all_close(gathered(kv), std::get<0>(at::kthvalue(x, 7, 0)), 0, 0));
      EXPECT_TRUE(points_at_value(x, 0, kv, ki));
      EXPECT_TRUE(all_close(at::median(sx), at::median(x), 0, 0));
      EXPECT_TRUE(all_close(at::nanmedian(sx), at::nanmedian(x), 0, 0));
    }
  }
}

TEST(Select, PartialInputIsSummedFirst) {
  auto mesh = test_mesh();
  auto x = rnd({6, 5}, 14);
  // World rank 0 holds x, every other rank zeros: the pending sum is x exactly.
  auto local = st::world_rank() == 0 ? x.clone() : at::zeros_like(x);
  auto sp = st::ShardTensor::from_local(local, mesh, Placements(mesh.ndim(), st::Partial{}));
  EXPECT_TRUE(
      all_close(gathered(std::get<0>(at::median(sp, 0))), std::get<0>(at::median(x, 0)), 0, 0));
  EXPECT_TRUE(all_close(gathered(std::get<1>(at::kthvalue(sp, 2, 1))),
                        std::get<1>(at::kthvalue(x, 2, 1)), 0, 0));
  EXPECT_TRUE(all_close(at::quantile(sp, 0.4), at::quantile(x, 0.4), 0, 0));
  EXPECT_TRUE(all_close(at::nanmedian(sp), at::nanmedian(x), 0, 0));
  EXPECT_TRUE(all_close(gathered(std::get<0>(at::sort(sp, 1))), std::get<0>(at::sort(x, 1)), 0, 0));
}

TEST(Select, BadInput) {
  auto mesh = test_mesh();
  auto sx = st::distribute_tensor(rnd({6, 5}, 11), mesh, fit_placements(mesh, {S0, S1}));
  EXPECT_TRUE(
      throws_everywhere([&] { auto r = at::kthvalue(sx, 0, 0); }, {"kthvalue", "out of range"}));
  EXPECT_TRUE(
      throws_everywhere([&] { auto r = at::kthvalue(sx, 7, 0); }, {"kthvalue", "out of range"}));
  EXPECT_TRUE(
      throws_everywhere([&] { auto r = at::kthvalue(sx, 2, 3); }, {"kthvalue", "out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::median(sx, -3); }, {"median", "out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::sort(sx, 2); }, {"sort", "out of range"}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::mode(sx, 5); }, {"mode", "out of range"}));
  auto se = st::distribute_tensor(at::zeros({0, 5}), mesh, fit_placements(mesh, {S0, S1}));
  EXPECT_TRUE(throws_everywhere([&] { auto r = at::median(se, 0); }, {"median", "non-zero size"}));
}
