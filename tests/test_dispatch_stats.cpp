// The dispatcher's own counters (Note [dispatch stats]) and its per-op cache
// of how an op is handled (Note [rule cache]): every intercepted call is
// counted once under the handling op_coverage() reports for it, repeated calls
// (served from the cache) give the single-process results, and the counters
// reset.
#include <shardtensor/dispatch/coverage.h>
#include <shardtensor/dispatch/stats.h>
#include <torch/torch.h>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

const st::Placement S0 = st::Shard{0};

st::OpHandling handling_of(const std::string& name) {
  for (const auto& c : st::op_coverage())
    if (c.name == name) return c.handling;
  ADD_FAILURE() << "op_coverage() lists no " << name;
  return st::OpHandling::Fallback;
}

TEST(DispatchStats, ResetZeroesEveryCounter) {
  auto mesh = test_mesh();
  st::ShardTensor sx(st::distribute_tensor(rnd({8, 4}, 1), mesh, fit_placements(mesh, {S0})));
  auto y = at::relu(sx);
  EXPECT_GT(st::dispatch_stats().calls, 0);
  st::reset_dispatch_stats();
  const auto s = st::dispatch_stats();
  EXPECT_EQ(s.calls, 0);
  EXPECT_EQ(s.rule_calls, 0);
  EXPECT_EQ(s.decompositions, 0);
  EXPECT_EQ(s.fallbacks, 0);
  EXPECT_EQ(s.lookup_seconds, 0.0);
  EXPECT_EQ(s.boundary_seconds, 0.0);
  EXPECT_EQ(s.handler_seconds, 0.0);
}

TEST(DispatchStats, RuleCallsAreCountedAndCachedCallsMatchLibtorch) {
  ASSERT_EQ(handling_of("aten::relu"), st::OpHandling::Rule);
  auto mesh = test_mesh();
  auto x = rnd({9, 5}, 2, 1.0, -0.5);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  st::reset_dispatch_stats();
  // The first call resolves the handler; the next ones read the cache.
  for (int i = 0; i < 3; ++i) {
    auto y = at::relu(sx);
    EXPECT_TRUE(all_close(st::ShardTensor(y).full_tensor(), at::relu(x)));
  }
  const auto s = st::dispatch_stats();
  EXPECT_EQ(s.calls, 3);
  EXPECT_EQ(s.rule_calls, 3);
  EXPECT_EQ(s.decompositions, 0);
  EXPECT_EQ(s.fallbacks, 0);
  EXPECT_GE(s.boundary_seconds, s.lookup_seconds);
  EXPECT_GT(s.handler_seconds, 0.0);
  EXPECT_TRUE(all_ranks(true));
}

TEST(DispatchStats, FallbackCallsAreCounted) {
  ASSERT_EQ(handling_of("aten::trace"), st::OpHandling::Fallback);
  st::set_strict(false);
  auto mesh = test_mesh();
  auto x = rnd({6, 6}, 3);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  st::reset_dispatch_stats();
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(all_close(at::trace(sx), at::trace(x)));
  const auto s = st::dispatch_stats();
  EXPECT_EQ(s.fallbacks, 2);
  EXPECT_EQ(s.calls, s.rule_calls + s.decompositions + s.fallbacks);
}

TEST(DispatchStats, DecompositionsCountTheOpAndItsPieces) {
  // A CompositeImplicitAutograd op with no rule of its own: the call is
  // counted as a decomposition, and its pieces are intercepted again.
  // aten::absolute is an alias that decomposes into aten::abs.
  if (handling_of("aten::absolute") != st::OpHandling::Decomposes)
    GTEST_SKIP() << "aten::absolute has a rule now";
  auto mesh = test_mesh();
  auto x = rnd({7, 3}, 4);
  st::ShardTensor sx(st::distribute_tensor(x, mesh, fit_placements(mesh, {S0})));
  st::reset_dispatch_stats();
  auto y = at::absolute(sx);
  const auto s = st::dispatch_stats();
  EXPECT_TRUE(all_close(st::ShardTensor(y).full_tensor(), at::absolute(x)));
  EXPECT_EQ(s.decompositions, 1);
  EXPECT_GE(s.calls, 2);
  EXPECT_EQ(s.calls, s.rule_calls + s.decompositions + s.fallbacks);
}

}  // namespace

// Every sharding rule names an op of the libtorch this runs on: a rule registered under a
// name torch renamed (1.13's aten::_scaled_dot_product_attention is
// aten::scaled_dot_product_attention in 2.x) would silently never run.
TEST(DispatchStats, RulesNameLiveOps) {
  const auto dead = st::unreachable_rules();
  std::string all;
  for (const auto& d : dead) all += " " + d;
  EXPECT_TRUE(dead.empty()) << "rules for ops this libtorch does not have:" << all;
}
