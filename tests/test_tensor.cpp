// ShardTensor wrapper, factories, redistribution and the elementwise rule,
// each compared with plain libtorch on the full tensors.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

at::Tensor seeded_randn(c10::IntArrayRef shape, uint64_t seed = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

// This rank's piece of `full` under `spec`, by brute-force arithmetic.
at::Tensor expected_piece(const at::Tensor& full, const st::ShardSpec& spec) {
  at::Tensor out = full;
  auto offs = spec.local_offsets();
  auto shape = spec.local_shape();
  for (int64_t d = 0; d < spec.ndim(); ++d) out = out.narrow(d, offs[d], shape[d]);
  return out;
}

std::vector<st::Placements> layouts(const st::DeviceMesh& mesh) {
  return {fit_placements(mesh, {st::Shard{0}, st::Shard{1}}),
          fit_placements(mesh, {st::Shard{1}, st::Shard{0}}),
          fit_placements(mesh, {st::Replicate{}, st::Shard{1}}),
          fit_placements(mesh, {st::Shard{2}, st::Replicate{}}),
          fit_placements(mesh, {st::Replicate{}, st::Replicate{}})};
}

// Restores the strict flag on scope exit.
struct StrictGuard {
  bool prev;
  explicit StrictGuard(bool on) : prev(st::strict()) { st::set_strict(on); }
  ~StrictGuard() { st::set_strict(prev); }
};

}  // namespace

TEST(ShardTensorBasics, WrapperReportsGlobalShape) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 7, 3});
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
  EXPECT_EQ(sx.sizes(), x.sizes());
  EXPECT_EQ(sx.dim(), 3);
  EXPECT_EQ(sx.numel(), x.numel());
  EXPECT_EQ(sx.scalar_type(), at::kFloat);
  EXPECT_TRUE(st::ShardTensor::is_shard_tensor(sx));
  EXPECT_FALSE(st::ShardTensor::is_shard_tensor(x));
  EXPECT_EQ(sx.local().sizes().vec(), sx.spec().local_shape());
  EXPECT_TRUE(sx.local().equal(expected_piece(x, sx.spec())));
  EXPECT_THROW(st::ShardTensor{x}, c10::Error);
  std::ostringstream os;
  os << sx;
  EXPECT_NE(os.str().find("global=[5, 7, 3]"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("Shard(0)"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("local="), std::string::npos) << os.str();
}

TEST(ShardTensorFactories, DistributeThenFullTensorRoundTrips) {
  auto mesh = test_mesh();
  auto x = seeded_randn({7, 5, 4});
  for (const auto& p : layouts(mesh)) {
    st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
    EXPECT_TRUE(sx.local().equal(expected_piece(x, sx.spec()))) << st::to_string(p);
    EXPECT_TRUE(all_close(sx.full_tensor(), x, 0, 0)) << st::to_string(p);
    // Uneven explicit sizes with an empty piece.
    auto sizes = sizes_with_empty_first(mesh, p, x.sizes());
    st::ShardTensor se(st::distribute_tensor(x, mesh, p, false, sizes));
    EXPECT_TRUE(all_close(se.full_tensor(), x, 0, 0)) << st::to_string(p);
  }
}

TEST(ShardTensorFactories, PartialSumsToTheValue) {
  auto mesh = test_mesh();
  auto x = seeded_randn({6, 5});
  st::ShardTensor sx(
      st::distribute_tensor(x, mesh, fit_placements(mesh, {st::Partial{}, st::Shard{1}})));
  EXPECT_TRUE(all_close(sx.full_tensor(), x, 0, 0));
  st::ShardTensor r(sx.redistribute(fit_placements(mesh, {st::Shard{0}, st::Shard{1}})));
  EXPECT_TRUE(all_close(r.full_tensor(), x, 0, 0));
}

TEST(ShardTensorFactories, ScatterSendsEachRankOnlyItsPiece) {
  auto mesh = test_mesh();
  auto x = seeded_randn({9, 6, 5});
  const int last = static_cast<int>(mesh.size()) - 1;
  for (int src : {0, last}) {
    for (const auto& p : layouts(mesh)) {
      st::reset_comm_stats();
      // Only src passes the tensor; others pass an undefined one.
      st::ShardTensor sx(
          st::scatter_tensor(mesh.rank() == src ? x : at::Tensor(), src, mesh, p, true));
      auto stats = st::comm_stats();
      EXPECT_TRUE(sx.local().requires_grad());
      EXPECT_TRUE(sx.local().equal(expected_piece(x, sx.spec()))) << st::to_string(p);
      if (mesh.rank() != src) {
        // Metadata record (4 + 16 = 20 int64: header incl. the large-count size, dims) plus exactly
        // this rank's piece.
        EXPECT_EQ(stats.bytes_received, 20 * 8 + sx.local().numel() * 4) << st::to_string(p);
      }
    }
  }
  // Undefined on src: every rank throws, and a later collective still works.
  bool threw = false;
  try {
    st::scatter_tensor(at::Tensor(), 0, mesh, fit_placements(mesh, {st::Shard{0}}));
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("scatter_tensor") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
}

TEST(ShardTensorFactories, FromLocalGathersUnevenSizes) {
  auto mesh = test_mesh();
  // Coordinate c along mesh dim 0 holds c+1 rows; mesh dim 1 (if any) replicates.
  const int64_t c = mesh.coordinate()[0];
  auto full_rows = mesh.size(0) * (mesh.size(0) + 1) / 2;
  auto x = seeded_randn({full_rows, 3});
  const int64_t off = c * (c + 1) / 2;
  auto local = x.narrow(0, off, c + 1).clone();
  auto p = fit_placements(mesh, {st::Shard{0}, st::Replicate{}});
  st::ShardTensor sx(st::ShardTensor::from_local(local, mesh, p));
  EXPECT_EQ(sx.sizes(), x.sizes());
  EXPECT_TRUE(all_close(sx.full_tensor(), x, 0, 0));
  // The same with sizes given explicitly, and wrong sizes rejected everywhere.
  st::ShardSizes sizes(mesh.ndim());
  for (int64_t i = 0; i < mesh.size(0); ++i) sizes[0].push_back(i + 1);
  st::ShardTensor sy(st::ShardTensor::from_local(local, mesh, p, sizes));
  EXPECT_TRUE(all_close(sy.full_tensor(), x, 0, 0));
  if (mesh.size(0) > 1) {
    st::ShardSizes bad = sizes;
    std::reverse(bad[0].begin(), bad[0].end());
    bool threw = false;
    try {
      st::ShardTensor::from_local(local, mesh, p, bad);
    } catch (const c10::Error& e) {
      threw = std::string(e.what()).find("from_local") != std::string::npos;
    }
    EXPECT_TRUE(all_ranks(threw));
  }
}

TEST(ShardTensorFactories, FromLocalRejectsMismatchedReplicatedExtentOnEveryRank) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  // One rank disagrees on an unsharded extent: every rank must throw.
  auto local = at::zeros({2, mesh.rank() == 1 ? 4 : 3});
  bool threw = false;
  std::string msg;
  try {
    st::ShardTensor::from_local(local, mesh, fit_placements(mesh, {st::Shard{0}}));
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what();
  }
  EXPECT_TRUE(all_ranks(threw));
  EXPECT_NE(msg.find("Shard(0)"), std::string::npos) << msg;
  // A later collective still works.
  st::ShardTensor sx(
      st::distribute_tensor(at::ones({4}), mesh, fit_placements(mesh, {st::Shard{0}})));
  EXPECT_TRUE(all_close(sx.full_tensor(), at::ones({4})));
}

TEST(ShardTensorRedistribute, EveryPairOfLayoutsIsExactAndDifferentiable) {
  auto mesh = test_mesh();
  auto x = seeded_randn({7, 6, 5});
  auto ls = layouts(mesh);
  for (const auto& from : ls) {
    for (const auto& to : ls) {
      auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
        return at::Tensor(st::ShardTensor(in[0]).redistribute(to));
      };
      EXPECT_TRUE(reference_check(fn, {{x, from}}, mesh))
          << st::to_string(from) << " -> " << st::to_string(to);
    }
  }
}

TEST(ShardTensorRedistribute, RebalancesToExplicitSizesIncludingEmpty) {
  auto mesh = test_mesh();
  auto x = seeded_randn({9, 4});
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  auto sizes = sizes_with_empty_first(mesh, p, x.sizes());
  auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
    st::ShardTensor r(st::ShardTensor(in[0]).redistribute(p, sizes));
    EXPECT_EQ(r.spec().all_shard_sizes(), sizes);
    return at::Tensor(r);
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh));
  EXPECT_TRUE(reference_check(fn, {{x, p, true, sizes}}, mesh));
}

// Note [shard-dim swap]: a cycle of Shard -> Shard transitions is one box
// exchange, exact with its gradient, uneven and empty pieces included, in
// every dtype, never a gather (allowed in strict mode).
TEST(ShardTensorRedistribute, ShardDimSwapIsExactAndDifferentiable) {
  auto mesh = test_mesh();
  if (mesh.ndim() < 2) GTEST_SKIP() << "a cycle needs two mesh dims (the 2x2 mesh)";
  struct Case {
    std::vector<int64_t> shape;
    st::Placements from, to;
  };
  const std::vector<Case> cases = {
      {{3, 5}, {S0, S1}, {S1, S0}},    {{5, 3}, {S0, S1}, {S1, S0}},
      {{1, 7}, {S0, S1}, {S1, S0}},    {{1, 7}, {S1, S0}, {S0, S1}},
      {{6, 4}, {S1, S0}, {S0, S1}},    {{4, 3, 5}, {S0, S2}, {S2, S0}},
      {{2, 3, 5}, {S2, S1}, {S1, S2}},
  };
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(st::to_string(c.from) + " -> " + st::to_string(c.to) + " " +
                   c10::toString(dtype));
      at::Tensor x = seeded_randn(c.shape, 7).to(dtype);
      bool zero_gathered = true;
      auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
        StrictGuard strict(true);
        st::reset_comm_stats();
        st::ShardTensor y(st::ShardTensor(in[0]).redistribute(c.to));
        zero_gathered = st::comm_stats().gathered_bytes == 0;
        EXPECT_EQ(y.placements(), c.to);
        EXPECT_EQ(y.local().sizes().vec(), y.spec().local_shape());
        return at::Tensor(y);
      };
      EXPECT_TRUE(reference_check(fn, {{x, c.from}}, mesh));
      EXPECT_TRUE(all_ranks(zero_gathered));
      // Empty first pieces on both mesh dims, and to explicit uneven sizes.
      EXPECT_TRUE(reference_check(fn, {empty_first_input(mesh, x, c.from)}, mesh));
      auto to_sizes = sizes_with_empty_first(mesh, c.to, x.sizes());
      auto fn_sized = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
        if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
        StrictGuard strict(true);
        st::ShardTensor y(st::ShardTensor(in[0]).redistribute(c.to, to_sizes));
        EXPECT_EQ(y.spec().all_shard_sizes(), to_sizes);
        return at::Tensor(y);
      };
      EXPECT_TRUE(reference_check(fn_sized, {{x, c.from}}, mesh));
    }
  }
}

// Cycles on 3-D meshes (4 ranks as 2x1x2, 1x2x2, 2x2x1): two- and three-way
// cycles, with the other mesh dim sharding, replicating or Partial, and
// valid steps before (a slice) or after (a gather) the exchange.
TEST(ShardTensorRedistribute, ShardDimCyclesOnThreeDimMeshes) {
  if (st::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const st::Placement Pa = st::Partial{};
  struct Case {
    std::vector<int64_t> mesh_shape, shape;
    st::Placements from, to;
  };
  const std::vector<Case> cases = {
      {{2, 1, 2}, {5, 3, 4}, {S0, S1, S2}, {S1, S0, S2}},
      {{2, 1, 2}, {3, 5, 2}, {S0, S1, R}, {S1, S0, R}},
      {{2, 1, 2}, {3, 5}, {S0, S1, Pa}, {S1, S0, Pa}},
      {{2, 1, 2}, {4, 4, 4}, {S0, S1, S2}, {S1, S0, R}},
      {{2, 1, 2}, {3, 4, 5}, {S0, S1, S2}, {S1, S2, S0}},
      {{2, 1, 2}, {3, 4, 5}, {S0, S1, S2}, {S2, S0, S1}},
      {{1, 2, 2}, {3, 4, 5}, {R, S0, S1}, {S2, S1, S0}},
      {{2, 2, 1}, {5, 3, 2}, {S0, S1, R}, {S1, S0, S2}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("mesh " + c10::str(c10::IntArrayRef(c.mesh_shape)) + " " + st::to_string(c.from) +
                 " -> " + st::to_string(c.to));
    auto mesh = st::DeviceMesh::create(c.mesh_shape);
    at::Tensor x = seeded_randn(c.shape, 21);
    bool zero_gathered = true;
    auto fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
      if (!st::ShardTensor::is_shard_tensor(in[0])) return in[0] * 1.0;
      StrictGuard strict(true);
      st::reset_comm_stats();
      st::ShardTensor y(st::ShardTensor(in[0]).redistribute(c.to));
      zero_gathered = st::comm_stats().gathered_bytes == 0;
      return at::Tensor(y);
    };
    EXPECT_TRUE(reference_check(fn, {{x, c.from}}, mesh));
    EXPECT_TRUE(all_ranks(zero_gathered));
    EXPECT_TRUE(reference_check(
        fn, {{x, c.from, true, sizes_with_empty_first(mesh, c.from, x.sizes())}}, mesh));
  }
  // [S0, S1, S2] -> [S1, S0, R] on 2x1x2 with [4, 4, 4]: the exchange sends 8
  // of the 16 elements of the piece (8 stay), then the gather of dim 2 sends
  // the new 16-element piece to the one peer: 24 elements on every rank.
  auto mesh = st::DeviceMesh::create({2, 1, 2});
  st::ShardTensor sx(st::distribute_tensor(seeded_randn({4, 4, 4}, 22), mesh, {S0, S1, S2}));
  st::reset_comm_stats();
  st::ShardTensor y(sx.redistribute({S1, S0, R}));
  const st::CommStats s = st::comm_stats();
  EXPECT_TRUE(all_ranks(s.bytes_sent == 24 * 4 && s.gathered_bytes == 0))
      << "sent " << s.bytes_sent;
}

// The swap's bytes: each rank sends at most its piece (what it keeps stays),
// and the piece to exactly one peer on the 2x2 mesh for [S0, S1] -> [S1, S0].
TEST(ShardTensorRedistribute, ShardDimSwapSendsAtMostThePiece) {
  auto mesh = test_mesh();
  if (mesh.ndim() < 2) GTEST_SKIP() << "a cycle needs two mesh dims (the 2x2 mesh)";
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{8, 6}, {3, 5}, {7, 2, 5}, {64, 64, 64}}) {
    at::Tensor x = seeded_randn(shape, 3);
    st::ShardTensor sx(st::distribute_tensor(x, mesh, {S0, S1}));
    st::reset_comm_stats();
    st::ShardTensor y(sx.redistribute({S1, S0}));
    const st::CommStats s = st::comm_stats();
    const int64_t piece = sx.local().numel() * 4;
    const auto coord = mesh.coordinate();
    // The part this rank keeps: rows of its mesh-dim-1 range, cols of its mesh-dim-0 range.
    const auto& from = sx.spec();
    const auto& to = y.spec();
    auto overlap = [](int64_t a, int64_t an, int64_t b, int64_t bn) {
      return std::max<int64_t>(0, std::min(a + an, b + bn) - std::max(a, b));
    };
    int64_t kept = 4;
    for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
      kept *= overlap(from.local_offsets()[d], from.local_shape()[d], to.local_offsets()[d],
                      to.local_shape()[d]);
    }
    const bool ok = s.bytes_sent == piece - kept && s.gathered_bytes == 0 &&
                    s.bytes_received == y.local().numel() * 4 - kept;
    EXPECT_TRUE(all_ranks(ok)) << "shape " << c10::IntArrayRef(shape) << " coordinate "
                               << c10::IntArrayRef(coord) << ": sent " << s.bytes_sent
                               << " received " << s.bytes_received << " piece " << piece << " kept "
                               << kept;
    // The same moves as the old plan: all-gather on mesh dim 0, all-to-all on
    // mesh dim 1, slice on mesh dim 0 (Note [shard-dim swap]).
    st::reset_comm_stats();
    st::ShardTensor old(
        st::ShardTensor(st::ShardTensor(sx.redistribute({R, S1})).redistribute({R, S0}))
            .redistribute({S1, S0}));
    const int64_t old_sent = st::comm_stats().bytes_sent;
    EXPECT_TRUE(all_ranks(s.bytes_sent <= old_sent && s.bytes_sent <= piece));
    if (shape[0] == 64) {
      std::cout << "[ swap bytes ] [64,64,64] f32 [S0,S1]->[S1,S0] on 2x2, coordinate "
                << c10::IntArrayRef(coord) << ": piece " << piece << " B, direct sends "
                << s.bytes_sent << " B, through Replicate sent " << old_sent << " B\n";
    }
    EXPECT_TRUE(all_close(old.full_tensor(), x));
    EXPECT_TRUE(all_close(y.full_tensor(), x));
  }
}

TEST(ShardTensorRedistribute, ShardToPartialIsRejectedOnEveryRank) {
  auto mesh = test_mesh();
  st::ShardTensor sx(
      st::distribute_tensor(at::ones({4, 4}), mesh, fit_placements(mesh, {st::Shard{0}})));
  bool threw = false;
  try {
    sx.redistribute(fit_placements(mesh, {st::Partial{}}));
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("Partial") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
}

// ------------------------------------------------------------------ elementwise

TEST(Elementwise, UnaryAndActivations) {
  auto mesh = test_mesh();
  auto x = seeded_randn({2, 5, 7, 3});
  auto p = fit_placements(mesh, {st::Shard{2}, st::Shard{1}});
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto y = torch::tanh(in[0] * 2.0 + 1.0);
    y = torch::relu(y) + torch::sigmoid(in[0]) + torch::silu(in[0]);
    y = y + torch::gelu(in[0]) + torch::elu(in[0]) + torch::softplus(in[0]);
    y = y + torch::leaky_relu(in[0], 0.1) + torch::exp(-in[0].abs()) + in[0].pow(2);
    return y;
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh));
  auto sizes = sizes_with_empty_first(mesh, p, x.sizes());
  EXPECT_TRUE(reference_check(fn, {{x, p, true, sizes}}, mesh));
}

TEST(Elementwise, PlainOperandsBroadcastOrAreSliced) {
  auto mesh = test_mesh();
  auto x = seeded_randn({2, 4, 7, 5});
  auto bias = seeded_randn({4, 1, 1}, 1);  // broadcasts along the sharded dims
  auto field = seeded_randn({7, 5}, 2);    // spans the sharded dims at full size
  auto p = fit_placements(mesh, {st::Shard{2}, st::Shard{3}});
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& params) {
    return (in[0] + params[0]) * params[1] - in[0] * 0.5;
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh, {bias, field}));
  auto sizes = sizes_with_empty_first(mesh, p, x.sizes());
  EXPECT_TRUE(reference_check(fn, {{x, p, true, sizes}}, mesh, {bias, field}));
}

TEST(Elementwise, ShardTensorsInDifferentLayoutsAreRedistributed) {
  auto mesh = test_mesh();
  auto a = seeded_randn({6, 5, 3});
  auto b = seeded_randn({6, 5, 3}, 1);
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return torch::maximum(in[0] * in[1], in[1]) + torch::where(in[0] > 0, in[0], in[1]);
  };
  EXPECT_TRUE(reference_check(fn,
                              {{a, fit_placements(mesh, {st::Shard{0}, st::Shard{1}})},
                               {b, fit_placements(mesh, {st::Shard{1}, st::Replicate{}})}},
                              mesh));
  // Broadcast ShardTensor operand (replicated) and a sharded one.
  auto c = seeded_randn({5, 3}, 3);
  EXPECT_TRUE(reference_check(fn,
                              {{a, fit_placements(mesh, {st::Shard{0}, st::Shard{1}})},
                               {c, fit_placements(mesh, {st::Replicate{}, st::Replicate{}})}},
                              mesh));
}

TEST(Elementwise, InPlaceAndOutVariants) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 6});
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto y = in[0] * 3.0;
    y.add_(in[0]).mul_(2.0);
    auto z = y * y;
    return z.sub_(in[0]).relu_();
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh));
  // out= variants (no autograd, as in libtorch).
  torch::NoGradGuard no_grad;
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
  // Factories reached below autograd (torch:: wrappers) still give ShardTensors.
  for (const at::Tensor& f : {torch::zeros_like(sx), torch::ones_like(sx), torch::randn_like(sx),
                              torch::full_like(sx, 3.0), at::empty_like(sx)}) {
    EXPECT_TRUE(st::ShardTensor::is_shard_tensor(f));
    EXPECT_EQ(st::ShardTensor(f).spec(), sx.spec());
  }
  auto z = torch::empty_like(sx);
  auto& r = at::mul_out(z, sx, sx);
  EXPECT_TRUE(st::ShardTensor::is_shard_tensor(r));
  EXPECT_TRUE(all_close(st::ShardTensor(z).full_tensor(), x * x));
  at::add_out(z, sx, x, 2.0);  // plain operand is sliced
  EXPECT_TRUE(all_close(st::ShardTensor(z).full_tensor(), x + 2.0 * x));
}

TEST(Elementwise, ClampComparisonsAndConversions) {
  auto mesh = test_mesh();
  auto x = seeded_randn({7, 4});
  auto lo = seeded_randn({4}, 5) - 1.0;
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& params) {
    auto y = torch::clamp(in[0], -0.5, 0.5) + torch::clamp_min(in[0], params[0]);
    auto mask = (in[0] > 0.1).logical_and(in[0] < 1.0);
    y = y + mask.to(torch::kFloat) + in[0].to(torch::kDouble).to(torch::kFloat);
    y = y + in[0].clone().contiguous() + in[0].detach() + torch::zeros_like(in[0]);
    return y * torch::ones_like(in[0]);
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh, {lo}));
}

TEST(Elementwise, DropoutUsesPerRankRandomness) {
  auto mesh = test_mesh();
  auto x = torch::ones({64, 64});
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p, true));
  // Eval mode and p = 0 are the identity.
  auto e = torch::dropout(sx, 0.5, /*train=*/false);
  EXPECT_TRUE(all_close(st::ShardTensor(e).full_tensor(), x, 0, 0));
  torch::manual_seed(7);
  auto d = st::ShardTensor(torch::dropout(sx, 0.25, /*train=*/true));
  auto full = d.full_tensor();
  // Values are 0 or 1/(1-p); about a quarter are dropped; scaling is exact.
  auto kept = (full != 0);
  EXPECT_TRUE(all_ranks(full.masked_select(kept).allclose(torch::full({1}, 1.0 / 0.75))));
  double frac = 1.0 - kept.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(frac, 0.25, 0.03);
  // Backward: gradient is the mask scaled, on the same elements.
  st::backward(d, torch::ones({64, 64}));
  EXPECT_TRUE(all_close(sx.grad().full_tensor(), full, 0, 0));
}

TEST(Elementwise, ErrorsNameTheOpAndPlacementsOnEveryRank) {
  auto mesh = test_mesh();
  st::ShardTensor sx(
      st::distribute_tensor(seeded_randn({6, 4}), mesh, fit_placements(mesh, {st::Shard{0}})));
  // An op with no rule and no decomposition, in strict mode (otherwise the
  // generic fallback runs it on gathered data: tests/test_fallback.cpp).
  const bool was_strict = st::strict();
  st::set_strict(true);
  bool threw = false;
  std::string msg;
  try {
    auto y = at::trace(sx);
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what();
  }
  st::set_strict(was_strict);
  EXPECT_TRUE(all_ranks(threw));
  EXPECT_NE(msg.find("no sharding rule"), std::string::npos) << msg;
  EXPECT_NE(msg.find("trace"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Shard(0)"), std::string::npos) << msg;
  // In-place on a plain tensor with a ShardTensor operand: a visible gather
  // (Note [plain in-place target]), refused in strict mode with the hint
  // that keeps the data sharded; otherwise plain torch's result on every rank.
  st::set_strict(true);
  threw = false;
  try {
    auto plain = at::zeros({6, 4});
    plain.add_(sx);
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    threw = what.find("add_") != std::string::npos && what.find("new_zeros") != std::string::npos;
  }
  st::set_strict(false);
  EXPECT_TRUE(all_ranks(threw));
  {
    auto plain = at::ones({6, 4});
    plain.add_(sx);
    EXPECT_FALSE(st::ShardTensor::is_shard_tensor(plain));
    EXPECT_TRUE(all_close(plain, sx.full_tensor() + 1.0, 0, 0));
  }
  st::set_strict(was_strict);
  // Two different meshes.
  auto other = test_mesh();
  auto so =
      st::distribute_tensor(seeded_randn({6, 4}), other, fit_placements(other, {st::Shard{0}}));
  threw = false;
  try {
    auto y = sx + so;
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("different meshes") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
  // Collectives still work afterwards.
  EXPECT_TRUE(all_close(st::ShardTensor(sx * 2.0).full_tensor(), sx.full_tensor() * 2.0));
}

TEST(Backward, ShardedOutputWithPlainOrShardedCotangent) {
  auto mesh = test_mesh();
  auto x = seeded_randn({5, 3});
  auto g = seeded_randn({5, 3}, 9);
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p, true));
  st::backward(sx * 3.0, g);
  EXPECT_TRUE(all_close(sx.grad().full_tensor(), g * 3.0));
  st::ShardTensor sy(st::distribute_tensor(x, mesh, p, true));
  st::ShardTensor sg(
      st::distribute_tensor(g, mesh, fit_placements(mesh, {st::Shard{1}, st::Shard{0}})));
  st::backward(sy * 2.0, sg);
  EXPECT_TRUE(all_close(sy.grad().full_tensor(), g * 2.0));
  EXPECT_FALSE(st::ShardTensor(st::distribute_tensor(x, mesh, p)).grad().defined());
}

TEST(Dispatch, CompositeOpWithoutRuleRunsItsDecomposition) {
  auto mesh = test_mesh();
  auto x = seeded_randn({7, 3});
  auto p = fit_placements(mesh, {st::Shard{0}, st::Shard{1}});
  // at::multiply / at::subtract / at::greater are composite aliases with no rule
  // of their own: they decompose into mul / sub / gt, which have rules.
  auto fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    auto y = at::multiply(in[0], 2.0);
    y = at::subtract(y, in[0] * in[0]);
    return y + at::greater(in[0], 0.0).to(torch::kFloat);
  };
  EXPECT_TRUE(reference_check(fn, {{x, p}}, mesh));
  st::ShardTensor sx(st::distribute_tensor(x, mesh, p));
  EXPECT_TRUE(st::ShardTensor::is_shard_tensor(at::multiply(sx, 2.0)));
}

TEST(Dispatch, DebugModeTurnsDisagreementIntoAnErrorOnEveryRank) {
  if (std::getenv("SHARDTENSOR_DEBUG") == nullptr) GTEST_SKIP() << "needs SHARDTENSOR_DEBUG=1";
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs two ranks";
  st::ShardTensor sx(
      st::distribute_tensor(seeded_randn({6, 4}), mesh, fit_placements(mesh, {st::Shard{0}})));
  bool threw = false;
  try {
    // Rank 0 runs a different op than the others: a program bug that would
    // otherwise give silently wrong results or a hang in a later collective.
    auto y = mesh.rank() == 0 ? at::add(sx, 1.0) : at::mul(sx, 2.0);
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("disagree") != std::string::npos;
  }
  EXPECT_TRUE(all_ranks(threw));
}
