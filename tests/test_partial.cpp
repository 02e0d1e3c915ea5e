// Pending partial sums (Note [pending partial sums], src/ops/pointwise.cpp): the
// matmul family and einsum leave a sharded contraction Partial, the elementwise
// ops that are linear in their Partial operand keep it, and the sum is paid
// once, where a non-linear consumer needs the value. Compared with plain
// libtorch on the full tensors: outputs, input gradients and parameter
// gradients; the intermediate placements are asserted, and the forward
// communication is compared with the same chain resolved eagerly (every
// Partial redistributed to Replicate as soon as it is made, the old behaviour).
//
// Layouts are written for a 2x2 mesh and trimmed by fit_placements() on a 1-D
// mesh (1, 2, 3 and 4 ranks). Extents are not divisible by 3 or 4 (uneven
// pieces); empty(...) inputs give coordinate 0 of every sharded mesh dim an
// empty piece, and a contraction of extent 3 leaves a rank empty on 4 ranks.
// Tolerances: the project's rtol 1e-5 / atol 1e-6.
#include <torch/torch.h>

#include <iostream>
#include <limits>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
const st::Placement Pa = st::Partial{};

using Fn =
    std::function<at::Tensor(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&)>;

class PendingPartial : public ::testing::Test {
 protected:
  st::DeviceMesh mesh = test_mesh();

  RefInput sh(const at::Tensor& full, const P& wanted, bool grad = true) {
    return sharded_input(mesh, full, wanted, grad);
  }
  RefInput empty(const at::Tensor& full, const P& wanted, bool grad = true) {
    return empty_first_input(mesh, full, wanted, grad);
  }
  static RefInput plain(const at::Tensor& full, bool grad = true) {
    return RefInput{full, std::nullopt, grad};
  }
  ::testing::AssertionResult check(const Fn& fn, const std::vector<RefInput>& in,
                                   const std::vector<at::Tensor>& params = {}) {
    return reference_check(fn, in, mesh, params, kRtol, kAtol);
  }
  // The placements `wanted` fitted to the mesh.
  P fit(const P& wanted) const { return fit_placements(mesh, wanted); }
};

// Placements of a ShardTensor ("plain" for a plain tensor), for messages.
std::string placements_of(const at::Tensor& t) {
  return st::ShardTensor::is_shard_tensor(t) ? st::to_string(st::ShardTensor(t).placements())
                                             : std::string("plain");
}

bool has_placements(const at::Tensor& t, const P& want) {
  return st::ShardTensor::is_shard_tensor(t) && st::ShardTensor(t).placements() == want;
}

// The old behaviour: a Partial value summed as soon as it is made.
at::Tensor eager(const at::Tensor& t) {
  if (!st::ShardTensor::is_shard_tensor(t)) return t;
  P p = st::ShardTensor(t).placements();
  bool any = false;
  for (auto& pl : p) {
    if (st::is_partial(pl)) {
      pl = R;
      any = true;
    }
  }
  return any ? st::ShardTensor(t).redistribute(p) : t;
}

// Records the placements of a ShardTensor seen in the sharded run of reference_check.
struct Seen {
  std::vector<std::string> got;
  bool ok = true;
  void expect(const at::Tensor& t, const P& want) {
    if (!st::ShardTensor::is_shard_tensor(t)) return;  // the plain reference run
    got.push_back(placements_of(t));
    if (!has_placements(t, want)) ok = false;
  }
  std::string str() const {
    std::string s;
    for (const auto& g : got) s += g + " ";
    return s;
  }
};

struct Comm {
  int64_t bytes = 0, messages = 0;
};

// Collective (as `fn` is). Forward communication of `fn` on the sharded
// inputs: this rank's sent bytes and messages (the transport's cost model).
Comm forward_comm(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fn,
                  const std::vector<at::Tensor>& in) {
  st::reset_comm_stats();
  fn(in);
  const auto s = st::comm_stats();
  return Comm{s.bytes_sent, s.messages};
}

// The layout of a product whose contraction is sharded on mesh dim 0: Partial
// there, and on mesh dim 1 (2x2) the Shard of `x`'s rows (or Replicate).
P partial_rows(const st::DeviceMesh& mesh, const at::Tensor& x) {
  P want = {Pa, R};
  if (st::ShardTensor::is_shard_tensor(x) && mesh.ndim() > 1) {
    const auto& pl = st::ShardTensor(x).placements()[1];
    if (st::is_shard(pl)) want[1] = st::Shard{st::shard_dim(pl)};
  }
  return fit_placements(mesh, want);
}

}  // namespace

// ---------------------------------------------------------------- the chain

TEST_F(PendingPartial, MatmulChainSumsOnce) {
  // ((x @ w1) * 2 - (x2 @ w2)).relu().sum(): both products contract a sharded
  // k, stay Partial through the scaling and the difference, and are summed
  // once, by relu (one all-reduce of the [n, m] piece instead of two).
  auto x = rnd({5, 7}, 1), w1 = rnd({7, 4}, 2), x2 = rnd({5, 6}, 3), w2 = rnd({6, 4}, 4);
  auto x3 = rnd({5, 3}, 5), w3 = rnd({3, 4}, 6);  // k = 3: an empty piece on 4 ranks
  Seen seen;
  const P part = fit({Pa, S0});
  Fn chain = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y1 = at::matmul(in[0], in[1]);
    at::Tensor y2 = at::matmul(in[2], in[3]);
    seen.expect(y1, part);
    at::Tensor d = y1 * 2 - y2;
    seen.expect(d, part);
    return d.relu().sum();
  };
  for (bool empty_first : {false, true}) {
    auto in = [&](const at::Tensor& t, const P& p) { return empty_first ? empty(t, p) : sh(t, p); };
    EXPECT_TRUE(check(chain, {in(x, {S1, S0}), in(w1, {S0}), in(x2, {S1, S0}), in(w2, {S0})}))
        << "empty-first " << empty_first;
    EXPECT_TRUE(check(chain, {in(x3, {S1, S0}), in(w3, {S0}), in(x2, {S1, S0}), in(w2, {S0})}))
        << "empty-first " << empty_first;
  }
  EXPECT_TRUE(seen.ok) << seen.str();

  // Forward communication against the eager chain (each product summed at once).
  std::vector<at::Tensor> in = {
      st::distribute_tensor(x, mesh, fit({S1, S0})), st::distribute_tensor(w1, mesh, fit({S0})),
      st::distribute_tensor(x2, mesh, fit({S1, S0})), st::distribute_tensor(w2, mesh, fit({S0}))};
  auto pending = [](const std::vector<at::Tensor>& t) {
    return ((at::matmul(t[0], t[1]) * 2) - at::matmul(t[2], t[3])).relu().sum();
  };
  auto resolved = [](const std::vector<at::Tensor>& t) {
    return ((eager(at::matmul(t[0], t[1])) * 2) - eager(at::matmul(t[2], t[3]))).relu().sum();
  };
  const Comm now = forward_comm(pending, in);
  const Comm before = forward_comm(resolved, in);
  if (mesh.rank() == 0) {
    std::cout << "[chain] mesh " << mesh.to_string() << ": forward bytes sent (rank 0) "
              << before.bytes << " -> " << now.bytes << ", messages " << before.messages << " -> "
              << now.messages << "\n";
  }
  if (mesh.size(0) > 1) {
    // One all-reduce of the [5, 4] piece fewer (the scalar all-reduce of sum()
    // over the other mesh dims is in both).
    EXPECT_TRUE(all_ranks(now.bytes < before.bytes && now.messages < before.messages))
        << before.bytes << " -> " << now.bytes << " bytes, " << before.messages << " -> "
        << now.messages << " messages";
  } else {
    EXPECT_TRUE(all_ranks(now.bytes == before.bytes));
  }
}

TEST_F(PendingPartial, LinearWithBiasCountsBiasOnce) {
  // linear(x, w, b) with k sharded: the bias joins the pending sum on
  // coordinate 0 of the Partial mesh dims only.
  auto x = rnd({3, 7, 6}, 7), x2 = rnd({7, 6}, 8);
  auto w = rnd({5, 6}, 9), b = rnd({5}, 10);
  Seen seen;
  Fn with_bias = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    at::Tensor y = at::linear(in[0], p[0], p[1]);
    seen.expect(y, partial_rows(mesh, in[0]));
    return y.tanh();
  };
  for (const P& p : {P{S2, S1}, P{S2, R}, P{S2, S0}}) {
    EXPECT_TRUE(check(with_bias, {sh(x, p)}, {w, b})) << st::to_string(p);
    EXPECT_TRUE(check(with_bias, {empty(x, p)}, {w, b})) << st::to_string(p);
  }
  EXPECT_TRUE(check(with_bias, {sh(x2, {S1, S0})}, {w, b}));
  EXPECT_TRUE(seen.ok) << seen.str();

  // A sharded weight (row-parallel) and a bias sharded along the output features
  // on the Partial mesh dim: the bias is gathered there, then joins the sum.
  Fn sharded = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::linear(in[0], in[1], in[2]).sin();
  };
  EXPECT_TRUE(check(sharded, {sh(x, {S2, S1}), sh(w, {S1}), sh(b, {S0})}));
  EXPECT_TRUE(check(sharded, {sh(x, {S2}), sh(w, {S1}), plain(b)}));
  EXPECT_TRUE(check(sharded, {empty(x, {S2, S0}), empty(w, {S1}), sh(b, {R, S0})}));

  // addmm / addmv / baddbmm with beta and alpha.
  auto a = rnd({7, 6}, 11), m = rnd({6, 5}, 12), bias2 = rnd({7, 5}, 13), v = rnd({6}, 14);
  auto bb = rnd({2, 7, 6}, 15), bm = rnd({2, 6, 5}, 16), bbias = rnd({2, 7, 5}, 17);
  Fn addmm = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::addmm(in[2], in[0], in[1], 0.5, 2.0).exp();
  };
  Fn addmv = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::addmv(in[2], in[0], in[1], -1.0, 3.0).relu();
  };
  Fn baddbmm = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::baddbmm(in[2], in[0], in[1], 2.0, 0.5).abs();
  };
  EXPECT_TRUE(check(addmm, {sh(a, {S1, S0}), sh(m, {S0}), plain(bias2)}));
  EXPECT_TRUE(check(addmm, {sh(a, {S1, S0}), sh(m, {S0}), sh(bias2, {S1, S0})}));
  EXPECT_TRUE(check(addmv, {sh(a, {S1}), sh(v, {S0}), plain(rnd({7}, 18))}));
  EXPECT_TRUE(check(baddbmm, {sh(bb, {S2, S0}), sh(bm, {S1, S0}), plain(bbias)}));
  EXPECT_TRUE(check(baddbmm, {empty(bb, {S2}), empty(bm, {S1}), sh(bbias, {S1})}));
}

TEST_F(PendingPartial, PartialTimesReplicated) {
  // (x @ w) @ v with v replicated: linear in the Partial operand, so the result
  // stays Partial; v's gradient is summed over the Partial mesh dim.
  auto x = rnd({5, 7}, 20), w = rnd({7, 4}, 21), v = rnd({4, 3}, 22);
  Seen seen;
  Fn fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    at::Tensor y = at::matmul(at::matmul(in[0], in[1]), p.empty() ? in[2] : p[0]);
    seen.expect(y, fit({Pa, S0}));
    return y;
  };
  EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0})}, {v}));
  EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0}), plain(v)}));
  EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0}), sh(v, {R, R})}));
  EXPECT_TRUE(check(fn, {empty(x, {S1, S0}), empty(w, {S0})}, {v}));
  EXPECT_TRUE(seen.ok) << seen.str();
  // No forward communication at all for (x @ w) @ v.
  std::vector<at::Tensor> in = {st::distribute_tensor(x, mesh, fit({S1, S0})),
                                st::distribute_tensor(w, mesh, fit({S0})), v};
  const Comm c = forward_comm(
      [](const std::vector<at::Tensor>& t) { return at::matmul(at::matmul(t[0], t[1]), t[2]); },
      in);
  EXPECT_TRUE(all_ranks(c.bytes == 0 && c.messages == 0)) << c.bytes << " bytes";

  // The mirror image, v @ (x @ w)^T-like: replicated @ Partial.
  auto u = rnd({3, 5}, 23);
  Fn left = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    return at::matmul(p[0], at::matmul(in[0], in[1]));
  };
  EXPECT_TRUE(check(left, {sh(x, {S1, R}), sh(w, {S0, R})}, {u}));
  // Partial @ Shard of a non-contraction dim on another mesh dim (2x2): Partial
  // on mesh dim 0, Shard(col) on mesh dim 1.
  auto v2 = rnd({4, 6}, 24);
  Fn cols = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y = at::matmul(at::matmul(in[0], in[1]), in[2]);
    return y;
  };
  EXPECT_TRUE(check(cols, {sh(x, {S1}), sh(w, {S0}), sh(v2, {R, S1})}));
  // Same mesh dim: the Partial operand is summed first.
  EXPECT_TRUE(check(cols, {sh(x, {S1}), sh(w, {S0}), sh(v2, {S1})}));
  EXPECT_TRUE(check(cols, {sh(x, {S1}), sh(w, {S0}), sh(v2, {S0})}));
}

TEST_F(PendingPartial, PartialTimesPartialIsSummed) {
  // (x @ w) @ (u @ z): the product of two sums needs one of them summed.
  auto x = rnd({5, 7}, 30), w = rnd({7, 4}, 31), u = rnd({4, 6}, 32), z = rnd({6, 3}, 33);
  Fn fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::matmul(at::matmul(in[0], in[1]), at::matmul(in[2], in[3]));
  };
  EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0}), sh(u, {S1}), sh(z, {S0})}));
  EXPECT_TRUE(check(fn, {empty(x, {S1}), empty(w, {S0}), sh(u, {S1}), sh(z, {S0})}));
  // Elementwise product of two Partials: summed first.
  Fn mul = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y = at::matmul(in[0], in[1]);
    return y * y.neg();
  };
  EXPECT_TRUE(check(mul, {sh(x, {S1, S0}), sh(w, {S0})}));
}

TEST_F(PendingPartial, MvDotEinsum) {
  auto a = rnd({5, 7}, 40), v = rnd({7}, 41), v2 = rnd({7}, 42), b = rnd({7, 4}, 43);
  Seen seen;
  Fn mv = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y = at::mv(in[0], in[1]);
    seen.expect(y, fit({Pa, R}));
    return y.sigmoid();
  };
  EXPECT_TRUE(check(mv, {sh(a, {S1}), sh(v, {S0})}));
  EXPECT_TRUE(check(mv, {empty(a, {S1}), empty(v, {S0})}));
  // dot: a full reduction, summed at once into a plain tensor.
  Fn dot = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y = at::dot(in[0], in[1]);
    EXPECT_FALSE(st::ShardTensor::is_shard_tensor(y));
    return y * 3;
  };
  EXPECT_TRUE(check(dot, {sh(v, {S0}), sh(v2, {S0})}));
  EXPECT_TRUE(check(dot, {empty(v, {S0}), empty(v2, {S0})}));
  Fn ein = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    at::Tensor y = at::einsum("ij,jk->ik", {in[0], in[1]});
    seen.expect(y, fit({Pa, S0}));
    return y.tanh();
  };
  EXPECT_TRUE(check(ein, {sh(a, {S1, S0}), sh(b, {S0})}));
  EXPECT_TRUE(check(ein, {empty(a, {S1, S0}), empty(b, {S0})}));
  Fn ein0 = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::einsum("i,i->", {in[0], in[1]});
  };
  EXPECT_TRUE(check(ein0, {sh(v, {S0}), sh(v2, {S0})}));
  EXPECT_TRUE(seen.ok) << seen.str();
}

// ---------------------------------------------------------------- elementwise

TEST_F(PendingPartial, LinearElementwiseKeepPartial) {
  auto x = rnd({5, 7}, 50), w = rnd({7, 4}, 51), x2 = rnd({5, 6}, 52), w2 = rnd({6, 4}, 53);
  auto r = rnd({4}, 54), r2 = rnd({5, 4}, 55, 1.0, 3.0);
  const P part = fit({Pa, S0});
  struct Case {
    const char* name;
    std::function<at::Tensor(const at::Tensor& p, const at::Tensor& q, const at::Tensor& r,
                             const at::Tensor& r2)>
        f;
    bool keeps;
  };
  const std::vector<Case> cases = {
      {"p + q", [](auto& p, auto& q, auto&, auto&) { return p + q; }, true},
      {"sub alpha", [](auto& p, auto& q, auto&, auto&) { return at::sub(p, q, 0.5); }, true},
      {"neg", [](auto& p, auto&, auto&, auto&) { return -p; }, true},
      {"clone", [](auto& p, auto&, auto&, auto&) { return p.clone(); }, true},
      {"p * r", [](auto& p, auto&, auto& r, auto&) { return p * r; }, true},
      {"r2 * p", [](auto& p, auto&, auto&, auto& r2) { return r2 * p; }, true},
      {"p * 3", [](auto& p, auto&, auto&, auto&) { return p * 3; }, true},
      {"p / r2", [](auto& p, auto&, auto&, auto& r2) { return p / r2; }, true},
      {"p / 4", [](auto& p, auto&, auto&, auto&) { return p / 4; }, true},
      {"add_", [](auto& p, auto& q, auto&, auto&) { return p.clone().add_(q, 2); }, true},
      {"add_ r", [](auto& p, auto&, auto& r, auto&) { return p.clone().add_(r); }, true},
      {"sub_ r2", [](auto& p, auto&, auto&, auto& r2) { return p.clone().sub_(r2, 3); }, true},
      {"mul_", [](auto& p, auto&, auto& r, auto&) { return p.clone().mul_(r); }, true},
      {"div_", [](auto& p, auto&, auto&, auto& r2) { return p.clone().div_(r2); }, true},
      {"neg_", [](auto& p, auto&, auto&, auto&) { return p.clone().neg_(); }, true},
      {"copy_ q", [](auto& p, auto& q, auto&, auto&) { return p.clone().copy_(q); }, true},
      {"copy_ r2", [](auto& p, auto&, auto&, auto& r2) { return p.clone().copy_(r2); }, true},
      {"slice copy_",
       [](auto& p, auto& q, auto&, auto& r2) {
         at::Tensor y = p * 1.5;
         y.slice(0, 1, 3).copy_(q.slice(0, 2, 4));
         y.slice(1, 0, 2).copy_(r2.slice(1, 1, 3));
         return y;
       },
       true},
      // not linear, in place into a Partial self: summed, updated, written back
      // as a pending sum (the layout of the target is kept)
      {"relu_", [](auto& p, auto&, auto&, auto&) { return p.clone().relu_(); }, true},
      {"add_ 1", [](auto& p, auto&, auto&, auto&) { return p.clone().add_(1); }, true},
      {"mul_ q", [](auto& p, auto& q, auto&, auto&) { return p.clone().mul_(q).exp(); }, false},
      {"slice relu_",
       [](auto& p, auto&, auto&, auto&) {
         at::Tensor y = p.clone();
         y.slice(0, 1, 4).relu_();
         return y;
       },
       true},
      // summed first
      {"p + r", [](auto& p, auto&, auto& r, auto&) { return p + r; }, false},
      {"p + 1", [](auto& p, auto&, auto&, auto&) { return p + 1; }, false},
      {"p * q", [](auto& p, auto& q, auto&, auto&) { return p * q; }, false},
      {"r2 / p", [](auto& p, auto&, auto&, auto& r2) { return r2 / (p + 10); }, false},
      {"exp", [](auto& p, auto&, auto&, auto&) { return p.exp(); }, false},
      {"floor div",
       [](auto& p, auto&, auto&, auto& r2) { return at::div(p, r2, c10::string_view("floor")); },
       false},
      {"cast", [](auto& p, auto&, auto&, auto&) { return p.to(at::kDouble); }, false},
      // the comparison sums both; the replicated mask times a Partial keeps it
      {"mask * p", [](auto& p, auto& q, auto&, auto&) { return (p > q).to(at::kFloat) * p; }, true},
  };
  for (const auto& c : cases) {
    Seen seen;
    Fn fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& prm) {
      at::Tensor p = at::matmul(in[0], in[1]), q = at::matmul(in[2], in[3]);
      at::Tensor y = c.f(p, q, prm[0], prm[1]);
      if (st::ShardTensor::is_shard_tensor(y)) {
        seen.got.push_back(placements_of(y));
        bool partial = false;
        for (const auto& pl : st::ShardTensor(y).placements()) partial |= st::is_partial(pl);
        if (partial != c.keeps) seen.ok = false;
      }
      return y;
    };
    EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0}), sh(x2, {S1, S0}), sh(w2, {S0})}, {r, r2}))
        << c.name;
    EXPECT_TRUE(
        check(fn, {empty(x, {S1, S0}), empty(w, {S0}), sh(x2, {S1, S0}), sh(w2, {S0})}, {r, r2}))
        << c.name;
    EXPECT_TRUE(seen.ok) << c.name << ": " << seen.str();
  }
  // A ShardTensor operand sharded on the Partial mesh dim: summed first.
  Fn sharded_other = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::matmul(in[0], in[1]) * in[2];
  };
  EXPECT_TRUE(check(sharded_other, {sh(x, {S1}), sh(w, {S0}), sh(r2, {S0})}));
  EXPECT_TRUE(check(sharded_other, {sh(x, {S1}), sh(w, {S0}), sh(r2, {R, S1})}));
}

TEST_F(PendingPartial, NnLinearChain) {
  // A feature-parallel pair of nn::Linear layers (the second row-parallel through
  // a plain weight): linear -> (Partial) -> *0.5 -> gelu (summed) -> linear.
  torch::manual_seed(7);
  torch::nn::Linear l1(torch::nn::LinearOptions(6, 5)), l2(torch::nn::LinearOptions(5, 3));
  auto x = rnd({2, 7, 6}, 60);
  Fn fn = [](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
    at::Tensor h = at::linear(in[0], p[0], p[1]) * 0.5;
    return at::linear(at::gelu(h), p[2], p[3]);
  };
  std::vector<at::Tensor> params = {l1->weight.detach(), l1->bias.detach(), l2->weight.detach(),
                                    l2->bias.detach()};
  EXPECT_TRUE(check(fn, {sh(x, {S2, S1})}, params));
  EXPECT_TRUE(check(fn, {empty(x, {S2, S0})}, params));
}

// Note [partial IEEE] (issue 25): mul/div of a Partial by operands with zeros
// (div) or non-finite values keep IEEE results only when summed first: per
// summand, s_i / 0 over summands of opposite sign gives +inf and -inf, whose
// sum is NaN where single-process torch gives +-inf. Random summands of a
// contraction of extent 11 have mixed signs at P > 1, so each case fails
// without the check (1 rank: no Partial, the case still runs). A divisor
// sharded on the other mesh dim (2x2) with a zero in one piece only: every
// rank must decide alike (a flag reduced over that mesh dim). An in-place op
// cannot change its target's layout: div_/mul_ of a Partial target sum first
// and write the value back as a pending sum (Note [pending partial sums]:
// coordinate 0 of the Partial mesh dims holds it, the other pieces zeros,
// which sums to it exactly, inf and NaN included), so the target stays
// Partial in that form.
TEST_F(PendingPartial, NonFiniteOrZeroOperandsSumFirst) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto x = rnd({5, 11}, 60), w = rnd({11, 4}, 61), x2 = rnd({5, 6}, 62), w2 = rnd({6, 4}, 63);
  auto r = rnd({4}, 64);
  r.index_put_({1}, inf);
  r.index_put_({2}, nan);
  auto r2 = rnd({5, 4}, 65, 1.0, 3.0);
  r2.index_put_({3, 2}, 0.0);
  auto z = rnd({5, 4}, 66, 1.0, 3.0);  // no zero, finite: stays Partial
  struct Case {
    const char* name;
    std::function<at::Tensor(const at::Tensor& p, const at::Tensor& q, const at::Tensor& r,
                             const at::Tensor& r2)>
        f;
    enum { kSums, kKeeps, kWritesBack } want;
  };
  const std::vector<Case> cases = {
      {"p / 0", [](auto& p, auto&, auto&, auto&) { return p / 0; }, Case::kSums},
      {"p / 0.0 tensor",
       [](auto& p, auto&, auto&, auto&) { return at::div(p, at::scalar_tensor(0.0)); },
       Case::kSums},
      {"p * inf", [=](auto& p, auto&, auto&, auto&) { return p * inf; }, Case::kSums},
      {"-inf * p", [=](auto& p, auto&, auto&, auto&) { return -inf * p; }, Case::kSums},
      {"p * nan", [=](auto& p, auto&, auto&, auto&) { return p * nan; }, Case::kSums},
      {"p / inf", [=](auto& p, auto&, auto&, auto&) { return p / inf; }, Case::kSums},
      {"p * r (inf, nan)", [](auto& p, auto&, auto& r, auto&) { return p * r; }, Case::kSums},
      {"p / r2 (a zero)", [](auto& p, auto&, auto&, auto& r2) { return p / r2; }, Case::kSums},
      {"div_ r2", [](auto& p, auto&, auto&, auto& r2) { return p.clone().div_(r2); },
       Case::kWritesBack},
      {"mul_ r", [](auto& p, auto&, auto& r, auto&) { return p.clone().mul_(r); },
       Case::kWritesBack},
      {"div_ 0", [](auto& p, auto&, auto&, auto&) { return p.clone().div_(0); }, Case::kWritesBack},
      {"p[1][2] / 0", [](auto& p, auto&, auto&, auto&) { return p.select(0, 1)[2] / 0; },
       Case::kSums},
      {"p + inf * q", [=](auto& p, auto& q, auto&, auto&) { return at::add(p, q, inf); },
       Case::kSums},
      // IEEE-safe: stay Partial
      {"p / 4", [](auto& p, auto&, auto&, auto&) { return p / 4; }, Case::kKeeps},
      {"p + q", [](auto& p, auto& q, auto&, auto&) { return p + q; }, Case::kKeeps},
      {"neg", [](auto& p, auto&, auto&, auto&) { return -p; }, Case::kKeeps},
  };
  for (const auto& c : cases) {
    Seen seen;
    Fn fn = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& prm) {
      at::Tensor p = at::matmul(in[0], in[1]), q = at::matmul(in[2], in[3]);
      at::Tensor y = c.f(p, q, prm[0], prm[1]);
      if (st::ShardTensor::is_shard_tensor(y)) {
        seen.got.push_back(placements_of(y));
        const st::ShardTensor sy(y);
        bool partial = false, zero_piece = false;
        const auto coord = sy.mesh().coordinate();
        for (size_t m = 0; m < sy.placements().size(); ++m) {
          if (!st::is_partial(sy.placements()[m])) continue;
          partial = true;
          zero_piece |= coord[m] != 0;
        }
        if (partial != (c.want != Case::kSums)) seen.ok = false;
        // The written-back form: pieces off coordinate 0 hold zeros (not +-inf or NaN summands).
        if (c.want == Case::kWritesBack && zero_piece && !sy.local().eq(0).all().item<bool>()) {
          seen.ok = false;
        }
      }
      return y;
    };
    EXPECT_TRUE(check(fn, {sh(x, {S1, S0}), sh(w, {S0}), sh(x2, {S1, S0}), sh(w2, {S0})}, {r, r2}))
        << c.name;
    EXPECT_TRUE(
        check(fn, {empty(x, {S1, S0}), empty(w, {S0}), sh(x2, {S1, S0}), sh(w2, {S0})}, {r, r2}))
        << c.name;
    EXPECT_TRUE(seen.ok) << c.name << ": " << seen.str();
  }
  // A divisor sharded on the other mesh dim (rows), a zero in one piece only.
  Fn sharded_div = [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
    return at::matmul(in[0], in[1]) / in[2];
  };
  EXPECT_TRUE(check(sharded_div, {sh(x, {S1, S0}), sh(w, {S0}), sh(r2, {R, S0})}));
  EXPECT_TRUE(check(sharded_div, {sh(x, {S1, S0}), sh(w, {S0}), sh(z, {R, S0})}));
  EXPECT_TRUE(check(sharded_div, {empty(x, {S1, S0}), empty(w, {S0}), empty(r2, {R, S0})}));
}
