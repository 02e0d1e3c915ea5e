// Note [plain fast path] (src/ops/common.h): at P = 1, or when every mesh dim
// that shards a stencil/norm/pool op's spatial or normalized dims has size 1,
// the rule must be the plain libtorch call on the local piece. For every such
// rule this test runs the op (forward and backward) once on plain tensors and
// once on a ShardTensor laid out so, on meshes 1-D (P = 1 only), 1 x P with
// Shard on the size-1 mesh dim and Replicate on the other, and P x 1 likewise,
// and asserts:
//  - zero bytes and zero messages in comm_stats() (forward and backward),
//  - the same peak and live CPU memory (memory_stats()) as the plain call:
//    no halo-extended copy, no extra temporaries,
//  - bit-exact outputs, input gradients and parameter gradients.
// A P x 1 mesh with the batch dim sharded over P (spatial dims on the size-1
// mesh dim) checks the same fast path with data parallelism: no communication
// in forward, results equal plain libtorch on the rank's batch slice.
#include <torch/torch.h>

#include <functional>
#include <string>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;
namespace F = torch::nn::functional;

namespace {

using Fn = std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)>;

struct Case {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::vector<int64_t>> params;  // parameter shapes
  Fn fn;
};

std::vector<at::Tensor> make_params(const Case& c, uint64_t seed) {
  std::vector<at::Tensor> out;
  for (const auto& s : c.params) out.push_back(rnd(s, seed++, 0.3).requires_grad_(true));
  return out;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& p) {
  std::vector<at::Tensor> out;
  for (const auto& t : p) out.push_back(t.detach().clone().requires_grad_(true));
  return out;
}

struct Run {
  at::Tensor out, gin;
  std::vector<at::Tensor> gparams;
  int64_t fwd_peak = 0, bwd_peak = 0, live = 0;  // bytes over the starting point
  st::CommStats comm;
};

// Runs fn on `x` (plain or sharded; leaf `leaf` receives the gradient) and a
// backward pass from `cot` on the local output, recording memory and traffic.
Run run(const Case& c, const at::Tensor& x, const at::Tensor& leaf,
        const std::vector<at::Tensor>& params, const at::Tensor& cot) {
  Run r;
  st::reset_comm_stats();
  const int64_t base = st::memory_stats().current_bytes;
  st::reset_peak_memory_stats();
  at::Tensor out = c.fn(x, params);
  r.fwd_peak = st::memory_stats().peak_bytes - base;
  at::Tensor local = st::ShardTensor::is_shard_tensor(out) ? st::ShardTensor(out).local() : out;
  const int64_t base2 = st::memory_stats().current_bytes;
  st::reset_peak_memory_stats();
  torch::autograd::backward({local}, {cot.reshape(local.sizes())});
  r.bwd_peak = st::memory_stats().peak_bytes - base2;
  r.live = st::memory_stats().current_bytes - base;
  r.comm = st::comm_stats();
  r.out = local.detach();
  r.gin = leaf.grad();
  for (const auto& p : params) r.gparams.push_back(p.grad());
  return r;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() && a.equal(b);
}

// Plain vs sharded with every non-local dim whole on every rank.
::testing::AssertionResult check_plain(const Case& c, const st::DeviceMesh& mesh,
                                       const st::Placements& pl) {
  at::Tensor full = rnd(c.shape, 11, 1.0, 0.5);
  auto params = make_params(c, 100);
  // Warm-up (one-time allocations of libtorch kernels, lazily built tables).
  {
    at::Tensor x = full.clone().requires_grad_(true);
    auto p = clone_params(params);
    at::Tensor y = c.fn(x, p);
    y.sum().backward();
  }
  at::Tensor x = full.clone().requires_grad_(true);
  auto p1 = clone_params(params);
  // Cotangent of the plain output's shape.
  at::Tensor cot;
  {
    at::NoGradGuard g;
    cot = rnd(c.fn(full, clone_params(params)).sizes(), 7);
  }
  Run plain = run(c, x, x, p1, cot);

  at::Tensor sx = st::distribute_tensor(full, mesh, pl, true);
  at::Tensor leaf = st::ShardTensor(sx).local();
  auto p2 = clone_params(params);
  Run sh = run(c, sx, leaf, p2, cot);

  std::ostringstream err;
  if (sh.comm.bytes_sent != 0 || sh.comm.bytes_received != 0 || sh.comm.messages != 0) {
    err << " communicated " << sh.comm.bytes_sent << "/" << sh.comm.bytes_received << " bytes in "
        << sh.comm.messages << " messages;";
  }
  if (sh.fwd_peak != plain.fwd_peak || sh.bwd_peak != plain.bwd_peak || sh.live != plain.live) {
    err << " memory (forward peak, backward peak, live) " << sh.fwd_peak << ", " << sh.bwd_peak
        << ", " << sh.live << " vs plain " << plain.fwd_peak << ", " << plain.bwd_peak << ", "
        << plain.live << ";";
  }
  if (!same(sh.out, plain.out)) err << " output differs;";
  if (!same(sh.gin, plain.gin)) err << " input gradient differs;";
  for (size_t i = 0; i < params.size(); ++i) {
    if (!same(sh.gparams[i], plain.gparams[i]))
      err << " gradient of parameter " << i << " differs;";
  }
  const std::string msg = err.str();
  if (all_ranks(msg.empty())) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << c.name << " on " << mesh.to_string() << " with " << st::to_string(pl) << ":" << msg;
}

std::vector<Case> cases() {
  using V = std::vector<int64_t>;
  std::vector<Case> cs;
  auto add = [&](std::string n, V shape, std::vector<V> params, Fn fn) {
    cs.push_back({std::move(n), std::move(shape), std::move(params), std::move(fn)});
  };
  const V x2{4, 4, 13, 11};
  add("conv2d k3 p1", x2, {{6, 4, 3, 3}, {6}},
      [](auto& x, auto& p) { return at::conv2d(x, p[0], p[1], 1, 1); });
  add("conv2d k3 s2 p1", x2, {{6, 4, 3, 3}, {6}},
      [](auto& x, auto& p) { return at::conv2d(x, p[0], p[1], 2, 1); });
  add("conv2d same k4", x2, {{6, 4, 4, 4}},
      [](auto& x, auto& p) { return at::conv2d(x, p[0], {}, 1, "same"); });
  add("conv1d", {4, 3, 17}, {{5, 3, 3}, {5}},
      [](auto& x, auto& p) { return at::conv1d(x, p[0], p[1], 1, 1); });
  add("conv3d", {4, 2, 6, 5, 7}, {{3, 2, 3, 3, 3}},
      [](auto& x, auto& p) { return at::conv3d(x, p[0], {}, 1, 1); });
  add("conv_transpose2d s2", x2, {{4, 3, 3, 3}, {3}},
      [](auto& x, auto& p) { return at::conv_transpose2d(x, p[0], p[1], 2, 1, 1); });
  add("conv_transpose1d", {4, 3, 9}, {{3, 2, 4}},
      [](auto& x, auto& p) { return at::conv_transpose1d(x, p[0], {}, 2, 1); });
  add("max_pool2d", x2, {}, [](auto& x, auto&) {
    return at::max_pool2d(x, {3, 3}, {2, 2}, {1, 1});
  });
  add("max_pool2d_with_indices ceil", x2, {}, [](auto& x, auto&) {
    return std::get<0>(at::max_pool2d_with_indices(x, {2, 2}, {2, 2}, {0, 0}, {1, 1}, true));
  });
  add("avg_pool2d", x2, {}, [](auto& x, auto&) {
    return at::avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}, false, false);
  });
  add("max_pool1d", {4, 3, 17}, {}, [](auto& x, auto&) { return at::max_pool1d(x, {3}, {2}); });
  add("avg_pool3d", {4, 2, 6, 5, 7}, {}, [](auto& x, auto&) {
    return at::avg_pool3d(x, {2, 2, 2}, {2, 2, 2});
  });
  add("adaptive_avg_pool2d(1)", x2, {}, [](auto& x, auto&) {
    return at::adaptive_avg_pool2d(x, {1, 1});
  });
  add("adaptive_avg_pool2d(5,3)", x2, {}, [](auto& x, auto&) {
    return at::adaptive_avg_pool2d(x, {5, 3});
  });
  add("adaptive_max_pool2d", x2, {}, [](auto& x, auto&) {
    return std::get<0>(at::adaptive_max_pool2d(x, {4, 3}));
  });
  add("pad constant", x2, {}, [](auto& x, auto&) {
    return F::pad(x, F::PadFuncOptions({1, 2, 3, 1}).value(0.5));
  });
  add("pad reflect", x2, {}, [](auto& x, auto&) {
    return F::pad(x, F::PadFuncOptions({1, 2, 3, 1}).mode(torch::kReflect));
  });
  add("pad replicate", x2, {}, [](auto& x, auto&) {
    return F::pad(x, F::PadFuncOptions({2, 1, 1, 2}).mode(torch::kReplicate));
  });
  add("pad circular", x2, {}, [](auto& x, auto&) {
    return F::pad(x, F::PadFuncOptions({2, 1, 1, 2}).mode(torch::kCircular));
  });
  add("interpolate nearest x2", x2, {}, [](auto& x, auto&) {
    return F::interpolate(
        x,
        F::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kNearest));
  });
  add("interpolate bilinear x2", x2, {}, [](auto& x, auto&) {
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .scale_factor(std::vector<double>{2, 2})
                                 .mode(torch::kBilinear)
                                 .align_corners(false));
  });
  add("interpolate bilinear size ac", x2, {}, [](auto& x, auto&) {
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .size(std::vector<int64_t>{20, 7})
                                 .mode(torch::kBilinear)
                                 .align_corners(true));
  });
  add("interpolate bicubic", x2, {}, [](auto& x, auto&) {
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .scale_factor(std::vector<double>{1.5, 2})
                                 .mode(torch::kBicubic)
                                 .align_corners(false));
  });
  add("interpolate linear1d", {4, 3, 17}, {}, [](auto& x, auto&) {
    return F::interpolate(x, F::InterpolateFuncOptions()
                                 .scale_factor(std::vector<double>{3})
                                 .mode(torch::kLinear)
                                 .align_corners(false));
  });
  add("group_norm", x2, {{4}, {4}},
      [](auto& x, auto& p) { return at::group_norm(x, 2, p[0], p[1], 1e-5); });
  add("layer_norm", x2, {{13, 11}, {13, 11}}, [](auto& x, auto& p) {
    return at::layer_norm(x, {13, 11}, p[0], p[1], 1e-5);
  });
  add("instance_norm", x2, {{4}, {4}}, [](auto& x, auto& p) {
    return at::instance_norm(x, p[0], p[1], {}, {}, true, 0.1, 1e-5, false);
  });
  add("batch_norm train", x2, {{4}, {4}}, [](auto& x, auto& p) {
    return at::batch_norm(x, p[0], p[1], {}, {}, true, 0.1, 1e-5, false);
  });
  add("batch_norm eval", x2, {{4}, {4}}, [](auto& x, auto& p) {
    static const at::Tensor rm = rnd({4}, 3, 0.1), rv = rnd({4}, 4, 0.1).abs() + 0.5;
    return at::batch_norm(x, p[0], p[1], rm, rv, false, 0.1, 1e-5, false);
  });
  return cs;
}

}  // namespace

// P = 1: a 1-D mesh of one rank, spatial dim sharded.
TEST(FastPath, OneRank) {
  if (st::world_size() != 1) GTEST_SKIP() << "P = 1 only";
  auto mesh = st::DeviceMesh::create({1});
  for (const auto& c : cases()) {
    EXPECT_TRUE(check_plain(c, mesh, {st::Shard{2}}));
    EXPECT_TRUE(check_plain(c, mesh, {st::Shard{0}}));
  }
}

// 1 x P mesh: Shard on the size-1 mesh dim, Replicate over P.
TEST(FastPath, SizeOneMeshDimFirst) {
  auto mesh = st::DeviceMesh::create({1, st::world_size()});
  for (const auto& c : cases()) {
    EXPECT_TRUE(check_plain(c, mesh, {st::Shard{2}, st::Replicate{}}));
  }
}

// P x 1 mesh: Replicate over P, two dims sharded on the size-1 mesh dim... one
// per mesh dim: the last spatial dim.
TEST(FastPath, SizeOneMeshDimLast) {
  auto mesh = st::DeviceMesh::create({st::world_size(), 1});
  for (const auto& c : cases()) {
    EXPECT_TRUE(check_plain(
        c, mesh, {st::Replicate{}, st::Shard{static_cast<int64_t>(c.shape.size()) - 1}}));
  }
}

// P x 1 mesh, batch sharded over P and a spatial dim on the size-1 mesh dim:
// the forward pass communicates nothing (parameter gradients are summed in
// backward), results equal plain libtorch on this rank's batch slice.
TEST(FastPath, BatchShardedSpatialOnSizeOneDim) {
  const int64_t P = st::world_size();
  auto mesh = st::DeviceMesh::create({P, 1});
  const int64_t me = mesh.coordinate()[0];
  for (const auto& c : cases()) {
    if (c.name.rfind("batch_norm train", 0) == 0) continue;  // statistics over the batch
    at::Tensor full = rnd(c.shape, 11, 1.0, 0.5);
    auto params = make_params(c, 100);
    at::Tensor sx = st::distribute_tensor(full, mesh, {st::Shard{0}, st::Shard{2}}, true);
    auto p = clone_params(params);
    st::reset_comm_stats();
    at::Tensor out = c.fn(sx, p);
    const auto comm = st::comm_stats();
    at::Tensor local = st::ShardTensor(out).local();
    const auto& sizes = st::ShardTensor(sx).spec().shard_sizes(0);
    int64_t off = 0;
    for (int64_t i = 0; i < me; ++i) off += sizes[i];
    at::Tensor want = c.fn(full.narrow(0, off, sizes[me]), clone_params(params));
    const bool ok = comm.bytes_sent == 0 && comm.messages == 0;
    EXPECT_TRUE(all_ranks(ok)) << c.name << ": forward communicated " << comm.bytes_sent;
    EXPECT_TRUE(all_close(local.detach(), want.detach(), 1e-5, 1e-6)) << c.name;
    // Gradients: parameters summed over the batch shards = plain gradient.
    at::Tensor cot = rnd(st::ShardTensor(out).spec().global_shape(), 7);
    st::backward(out, cot);
    at::Tensor xr = full.clone().requires_grad_(true);
    auto pr = clone_params(params);
    torch::autograd::backward({c.fn(xr, pr)}, {cot});
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_TRUE(all_close(p[i].grad(), pr[i].grad(), 1e-4, 1e-5)) << c.name << " param " << i;
    }
    EXPECT_TRUE(all_close(st::ShardTensor(sx).grad().full_tensor(), xr.grad(), 1e-5, 1e-6))
        << c.name;
  }
}

// Note [adaptive reduce]: an adaptive average pool to an output smaller than
// the number of ranks moves only the output-sized partial sums (one
// all-reduce), never the input; results equal libtorch.
TEST(FastPath, AdaptiveAvgToSmallOutputReduces) {
  auto mesh = test_mesh();
  at::Tensor full = rnd({2, 3, 13, 11}, 5);
  auto pl = fit_placements(mesh, {S2, S3});
  for (int64_t o : {1, 2}) {
    at::Tensor sx = st::distribute_tensor(full, mesh, pl, true);
    st::reset_comm_stats();
    at::Tensor out = at::adaptive_avg_pool2d(sx, {o, o});
    const auto comm = st::comm_stats();
    // An all-reduce of the output (2*3*o*o floats) costs at most a few times
    // its size per rank; a gather of the input would cost a multiple of the piece.
    const int64_t out_bytes = 2 * 3 * o * o * 4;
    const bool small =
        mesh.size() == 1 || o >= mesh.size(0) || comm.bytes_received <= 4 * out_bytes * mesh.size();
    EXPECT_TRUE(all_ranks(small)) << "adaptive_avg_pool2d(" << o << ") received "
                                  << comm.bytes_received << " bytes";
    EXPECT_TRUE(all_close(gathered(out), at::adaptive_avg_pool2d(full, {o, o})));
    at::Tensor cot = rnd({2, 3, o, o}, 9);
    st::backward(out, cot);
    at::Tensor xr = full.clone().requires_grad_(true);
    at::adaptive_avg_pool2d(xr, {o, o}).backward(cot);
    EXPECT_TRUE(all_close(st::ShardTensor(sx).grad().full_tensor(), xr.grad()));
  }
}

// Note [sharded moments]: a normalization over a sharded dim does one
// all-reduce in forward (the merged moments); results equal libtorch.
TEST(FastPath, ShardedNormOneForwardAllReduce) {
  auto mesh = test_mesh();
  if (mesh.size() == 1) GTEST_SKIP() << "needs a sharded dim";
  at::Tensor full = rnd({2, 4, 13, 11}, 5, 1.0, 1e3);
  auto pl = fit_placements(mesh, {S2, S3});
  at::Tensor w = rnd({4}, 6).requires_grad_(true), b = rnd({4}, 7).requires_grad_(true);
  at::Tensor sx = st::distribute_tensor(full, mesh, pl, true);
  // The cost of one all-reduce of the statistics (2 x N x G float64) on this mesh.
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < mesh.ndim(); ++m) dims.push_back(m);
  st::reset_comm_stats();
  st::comm::all_reduce(at::zeros({2, 2, 2, 1, 1, 1}, at::kDouble), mesh, dims);
  const auto one = st::comm_stats();
  st::reset_comm_stats();
  at::Tensor out = at::group_norm(sx, 2, w, b, 1e-5);
  const auto fwd = st::comm_stats();
  EXPECT_TRUE(all_ranks(fwd.messages == one.messages && fwd.bytes_sent == one.bytes_sent))
      << "forward: " << fwd.messages << " messages, " << fwd.bytes_sent
      << " bytes; one all-reduce: " << one.messages << ", " << one.bytes_sent;
  at::Tensor xr = full.clone().requires_grad_(true);
  at::Tensor wr = w.detach().clone().requires_grad_(true),
             br = b.detach().clone().requires_grad_(true);
  at::Tensor want = at::group_norm(xr, 2, wr, br, 1e-5);
  // libtorch's float32 kernel loses digits at mean 1e3: compare with float64.
  at::Tensor want64 = at::group_norm(full.to(at::kDouble), 2, w.detach().to(at::kDouble),
                                     b.detach().to(at::kDouble), 1e-5);
  EXPECT_TRUE(all_close(gathered(out).to(at::kDouble), want64, 1e-5, 1e-5));
  at::Tensor cot = rnd(full.sizes(), 8);
  st::backward(out, cot);
  xr = full.to(at::kDouble).requires_grad_(true);
  wr = w.detach().to(at::kDouble).requires_grad_(true);
  br = b.detach().to(at::kDouble).requires_grad_(true);
  at::group_norm(xr, 2, wr, br, 1e-5).backward(cot.to(at::kDouble));
  EXPECT_TRUE(
      all_close(st::ShardTensor(sx).grad().full_tensor().to(at::kDouble), xr.grad(), 1e-4, 1e-5));
  EXPECT_TRUE(all_close(w.grad().to(at::kDouble), wr.grad(), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(b.grad().to(at::kDouble), br.grad(), 1e-4, 1e-4));
}
