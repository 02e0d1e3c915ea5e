// Settings that change communication (Note [agreed settings], src/core/settings.h):
// under SHARDTENSOR_DEBUG=1, ranks that hold different values of
// set_fft_layout, set_causal_balance or a SHARDTENSOR_*_SPLIT /
// SHARDTENSOR_CONV_OVERLAP switch all raise the same clear error, naming the
// setting and each rank's value, instead of hanging in mismatched
// collectives or computing a wrong result. The last world rank holds the odd
// value. Runs at 2 and 3 ranks and on the 2x2 mesh; at 1 rank there is no one
// to disagree with.
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "testing.h"

namespace st = shardtensor;
using namespace shardtensor::testing;

namespace {

const st::Placement S1 = st::Shard{1}, S2 = st::Shard{2}, S3 = st::Shard{3};
const st::Placement R = st::Replicate{};

// Sets an environment variable for its scope (nullptr: unset).
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~EnvGuard() { set(old_ ? old_->c_str() : nullptr); }
  void set(const char* value) {
    if (value) {
      setenv(name_, value, 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

bool odd_rank() { return st::world_rank() == st::world_size() - 1; }

// `f` throws on every rank a c10::Error that names the setting and both values.
void expect_all_throw(const std::function<void()>& f, const std::string& name,
                      const std::string& v1, const std::string& v2) {
  EXPECT_TRUE(throws_everywhere(
      f, {"ranks disagree on the setting " + name, v1, v2, "mesh rank 0", "mesh rank 1"}));
}

class Settings : public ::testing::Test {
 protected:
  void SetUp() override {
    if (st::world_size() == 1) GTEST_SKIP() << "one rank: nothing to disagree with";
  }
  st::DeviceMesh mesh = test_mesh();
  EnvGuard debug_{"SHARDTENSOR_DEBUG", "1"};

  // Spatial dims 2 and 3 sharded (trimmed on a 1-D mesh).
  at::Tensor image(int64_t h = 12, int64_t w = 10) {
    return st::distribute_tensor(rnd({2, 3, h, w}, 7), mesh, fit_placements(mesh, {S2, S3}));
  }

  // An environment switch: agreeing ranks run `f` without error (both
  // values), a disagreeing last rank makes every rank throw.
  void check_switch(const char* name, const std::function<void()>& f) {
    {
      EnvGuard all_off(name, "0");
      EXPECT_NO_THROW(f());
    }
    {
      EnvGuard all_on(name, "1");
      EXPECT_NO_THROW(f());
    }
    EnvGuard odd(name, odd_rank() ? "0" : nullptr);
    expect_all_throw(f, name, "on", "off");
  }
};

TEST_F(Settings, FftLayout) {
  // Dim 0 stays whole, so that a swap has a free target on the 2x2 mesh too.
  auto sx = st::distribute_tensor(rnd({4, 6, 10}, 3), mesh, fit_placements(mesh, {S1, S2}));
  auto f = [&] { (void)torch::fft::fft2(sx); };  // dims 1 and 2
  EXPECT_NO_THROW(f());
  st::FftLayoutGuard g(odd_rank() ? st::FftLayout::Input : st::FftLayout::Spectral);
  expect_all_throw(f, "set_fft_layout", "FftLayout::Input", "FftLayout::Spectral");
}

TEST_F(Settings, CausalBalance) {
  const int64_t S = 8 * mesh.size(0);
  auto pl = fit_placements(mesh, {S2, R});
  auto q = st::distribute_tensor(rnd({1, 2, S, 4}, 11), mesh, pl);
  auto f = [&] { (void)st::scaled_dot_product_attention(q, q, q, {}, /*is_causal=*/true); };
  EXPECT_NO_THROW(f());
  const auto old = st::set_causal_balance(odd_rank() ? st::CausalBalance::Contiguous
                                                     : st::CausalBalance::ZigZag);
  expect_all_throw(f, "set_causal_balance", "CausalBalance::Contiguous", "CausalBalance::ZigZag");
  st::set_causal_balance(old);
  // Non-causal attention does not read the setting: no error.
  st::set_causal_balance(odd_rank() ? st::CausalBalance::Contiguous : old);
  EXPECT_NO_THROW((void)st::scaled_dot_product_attention(q, q, q, {}, false));
  st::set_causal_balance(old);
}

TEST_F(Settings, ConvOverlap) {
  auto sx = image();
  auto w = rnd({4, 3, 3, 3}, 8);
  check_switch("SHARDTENSOR_CONV_OVERLAP", [&] { (void)at::conv2d(sx, w, {}, 1, 1); });
}

TEST_F(Settings, PoolSplit) {
  auto sx = image();
  check_switch("SHARDTENSOR_POOL_SPLIT", [&] { (void)at::max_pool2d(sx, {3, 3}, {2, 2}, {1, 1}); });
}

TEST_F(Settings, TconvSplit) {
  auto sx = image();
  auto w = rnd({3, 4, 3, 3}, 9);
  check_switch("SHARDTENSOR_TCONV_SPLIT",
               [&] { (void)at::conv_transpose2d(sx, w, {}, /*stride=*/2, /*padding=*/1); });
}

TEST_F(Settings, InterpSplit) {
  auto sx = image();
  check_switch("SHARDTENSOR_INTERP_SPLIT", [&] {
    (void)at::upsample_bilinear2d(sx, {24, 20}, /*align_corners=*/false);
  });
}

// SHARDTENSOR_HALO_NEIGHBOR changed after init on the last rank only (a
// setenv in rank-dependent code, which the init agreement cannot see). The
// halo's own check covers its mesh dim's line of ranks only, and on the 2x2
// mesh the other line went on; the check at the op's entry covers the whole
// mesh (Note [settings at op entry]): every rank raises the same error, naming
// every mesh rank's value, and the job goes on once the ranks agree again.
TEST_F(Settings, HaloNeighborChangedAfterInit) {
  auto sx = image();
  auto w = rnd({4, 3, 3, 3}, 8);
  // max_pool2d reads the setting in its halos (HaloPlan::start), one line of
  // the mesh at a time; conv2d's own block exchange never reads it.
  const std::vector<std::pair<std::string, std::function<at::Tensor(const at::Tensor&)>>> ops = {
      {"aten::max_pool2d",
       [](const at::Tensor& t) {
         return at::max_pool2d(t, {3, 3}, {1, 1}, {1, 1});
       }},
      {"aten::conv2d", [&](const at::Tensor& t) { return at::conv2d(t, w, {}, 1, 1); }}};
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    {
      EnvGuard all_on("SHARDTENSOR_HALO_NEIGHBOR", "1");
      EXPECT_NO_THROW((void)op(sx));
    }
    std::vector<std::string> want = {"ranks disagree on the setting SHARDTENSOR_HALO_NEIGHBOR",
                                     "(" + name + ")", "set the same value on every rank"};
    for (int64_t r = 0; r < mesh.size(); ++r) {
      want.push_back("mesh rank " + std::to_string(r) + ": " +
                     (r == mesh.size() - 1 ? std::string("on") : std::string("off")));
    }
    {
      EnvGuard odd("SHARDTENSOR_HALO_NEIGHBOR", odd_rank() ? "1" : nullptr);
      EXPECT_TRUE(throws_everywhere([&] { (void)op(sx); }, want));
    }
    // Agreeing again, the job goes on and is right.
    EXPECT_TRUE(at::allclose(gathered(op(sx)), op(gathered(sx))));
  }
}

// The check is uncounted: agreeing ranks see the same CommStats with and
// without SHARDTENSOR_DEBUG.
TEST_F(Settings, DebugCheckIsUncounted) {
  auto sx = image();
  auto w = rnd({4, 3, 3, 3}, 8);
  st::reset_comm_stats();
  (void)at::conv2d(sx, w, {}, 1, 1);
  const auto with_debug = st::comm_stats();
  EnvGuard off("SHARDTENSOR_DEBUG", "0");
  st::reset_comm_stats();
  (void)at::conv2d(sx, w, {}, 1, 1);
  const auto without = st::comm_stats();
  EXPECT_EQ(with_debug.bytes_sent, without.bytes_sent);
  EXPECT_EQ(with_debug.messages, without.messages);
}

}  // namespace
