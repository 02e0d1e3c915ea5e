// Serial tests of the spec layer (placements, partition arithmetic, ShardSpec)
// on abstract meshes: no MPI, so the arithmetic is checked at every coordinate.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <shardtensor/spec/shard_spec.h>

#include <functional>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace st = shardtensor;
using st::DeviceMesh;
using st::Partial;
using st::Placements;
using st::Replicate;
using st::Shard;
using st::ShardSizes;
using st::ShardSpec;
using Shape = std::vector<int64_t>;

namespace {

// Every coordinate of a mesh shape, row-major.
std::vector<Shape> all_coordinates(const Shape& mesh_shape) {
  std::vector<Shape> out;
  Shape c(mesh_shape.size(), 0);
  const int64_t total =
      std::accumulate(mesh_shape.begin(), mesh_shape.end(), int64_t{1}, std::multiplies<int64_t>());
  for (int64_t r = 0; r < total; ++r) {
    int64_t rem = r;
    for (size_t i = mesh_shape.size(); i-- > 0;) {
      c[i] = rem % mesh_shape[i];
      rem /= mesh_shape[i];
    }
    out.push_back(c);
  }
  return out;
}

// Brute force: the extent coordinate i holds, from the definition of balanced-block.
int64_t brute_balanced(int64_t n, int64_t parts, int64_t i) {
  // Deal the n elements one by one to the parts that are still short, in order:
  // part j receives ceil((n - j) / parts) elements.
  int64_t count = 0;
  for (int64_t e = i; e < n; e += parts) {
    ++count;
  }
  return count;
}

// Brute force: the global start of coordinate i by summing the extents before it.
int64_t brute_offset(const std::vector<int64_t>& sizes, int64_t i) {
  int64_t off = 0;
  for (int64_t j = 0; j < i; ++j) {
    off += sizes[j];
  }
  return off;
}

// Runs `fn`, expects a c10::Error whose message contains every string of `needles`.
void expect_error_mentions(const std::function<void()>& fn,
                           const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "message does not mention '" << n << "':\n"
                                                << msg;
    }
  }
}

}  // namespace

// ---- balanced_sizes / offsets_of --------------------------------------------

TEST(BalancedSizes, MatchesBruteForce) {
  for (int64_t parts = 1; parts <= 7; ++parts) {
    for (int64_t n = 0; n <= 23; ++n) {
      const auto sizes = st::balanced_sizes(n, parts);
      ASSERT_EQ(static_cast<int64_t>(sizes.size()), parts);
      int64_t total = 0;
      for (int64_t i = 0; i < parts; ++i) {
        EXPECT_EQ(sizes[i], brute_balanced(n, parts, i)) << "n=" << n << " parts=" << parts;
        EXPECT_EQ(sizes[i], n / parts + (i < n % parts ? 1 : 0));
        total += sizes[i];
      }
      EXPECT_EQ(total, n);
    }
  }
}

TEST(BalancedSizes, SpecialCases) {
  EXPECT_EQ(st::balanced_sizes(0, 3), (Shape{0, 0, 0}));      // n = 0
  EXPECT_EQ(st::balanced_sizes(2, 4), (Shape{1, 1, 0, 0}));   // n < P
  EXPECT_EQ(st::balanced_sizes(10, 4), (Shape{3, 3, 2, 2}));  // n % P != 0
  EXPECT_EQ(st::balanced_sizes(12, 4), (Shape{3, 3, 3, 3}));  // n % P == 0
  EXPECT_EQ(st::balanced_sizes(5, 1), (Shape{5}));
  EXPECT_THROW(st::balanced_sizes(-1, 2), c10::Error);
  EXPECT_THROW(st::balanced_sizes(4, 0), c10::Error);
  EXPECT_THROW(st::balanced_sizes(4, -2), c10::Error);
}

TEST(OffsetsOf, ExclusivePrefixSum) {
  EXPECT_EQ(st::offsets_of({}), Shape{});
  EXPECT_EQ(st::offsets_of({3, 0, 2, 5}), (Shape{0, 3, 3, 5}));
  EXPECT_EQ(st::offsets_of({0, 0}), (Shape{0, 0}));
}

// ---- placements ------------------------------------------------------------

TEST(Placement, EqualityAndPredicates) {
  EXPECT_TRUE(Shard{1} == Shard{1});
  EXPECT_FALSE(Shard{1} == Shard{2});
  EXPECT_TRUE(Replicate{} == Replicate{});
  EXPECT_TRUE(Partial{} == Partial{});
  const st::Placement s = Shard{3}, r = Replicate{}, p = Partial{};
  EXPECT_TRUE(s == st::Placement(Shard{3}));
  EXPECT_FALSE(s == r);
  EXPECT_FALSE(r == p);
  EXPECT_TRUE(st::is_shard(s) && !st::is_shard(r) && !st::is_shard(p));
  EXPECT_TRUE(st::is_replicate(r) && !st::is_replicate(s));
  EXPECT_TRUE(st::is_partial(p) && !st::is_partial(r));
  EXPECT_EQ(st::shard_dim(s), 3);
  EXPECT_EQ(st::shard_dim(r), -1);
  EXPECT_EQ(st::shard_dim(p), -1);
}

TEST(Placement, Printing) {
  EXPECT_EQ(st::to_string(st::Placement(Shard{2})), "Shard(2)");
  EXPECT_EQ(st::to_string(st::Placement(Replicate{})), "Replicate()");
  EXPECT_EQ(st::to_string(st::Placement(Partial{})), "Partial()");
  EXPECT_EQ(st::to_string(Placements{Shard{2}, Replicate{}}), "[Shard(2), Replicate()]");
  EXPECT_EQ(st::to_string(Placements{}), "[]");
  std::ostringstream os;
  os << Placements{Partial{}, Shard{0}} << " " << st::Placement(Replicate{});
  EXPECT_EQ(os.str(), "[Partial(), Shard(0)] Replicate()");
}

// ---- abstract meshes --------------------------------------------------------

TEST(AbstractMesh, Basics) {
  auto m = DeviceMesh::abstract({2, 3}, {1, 2}, {"x", "y"});
  EXPECT_TRUE(m.defined());
  EXPECT_TRUE(m.is_abstract());
  EXPECT_EQ(m.ndim(), 2);
  EXPECT_EQ(m.shape(), (Shape{2, 3}));
  EXPECT_EQ(m.size(), 6);
  EXPECT_EQ(m.size(0), 2);
  EXPECT_EQ(m.size(-1), 3);
  EXPECT_THROW(m.size(2), c10::Error);
  EXPECT_EQ(m.dim_index("y"), 1);
  EXPECT_THROW(m.dim_index("z"), c10::Error);
  EXPECT_EQ(m.coordinate(), (Shape{1, 2}));
  EXPECT_EQ(m.rank(), 5);
  EXPECT_THROW(m.comm(), c10::Error);
  EXPECT_THROW(m.comm(0), c10::Error);
  EXPECT_THROW(m.comm(std::vector<bool>{true, false}), c10::Error);
  auto d = DeviceMesh::abstract({4}, {0});
  EXPECT_EQ(d.dim_names(), (std::vector<std::string>{"dim0"}));
  auto d3 = DeviceMesh::abstract({1, 2, 2}, {0, 1, 0});
  EXPECT_EQ(d3.dim_names(), (std::vector<std::string>{"dim0", "dim1", "dim2"}));
  EXPECT_EQ(d3.rank(), 2);
  EXPECT_FALSE(DeviceMesh().defined());
  EXPECT_THROW(DeviceMesh().ndim(), c10::Error);
}

TEST(AbstractMesh, RankCoordinateRoundTrip) {
  const Shape shape{2, 3, 4};
  auto m = DeviceMesh::abstract(shape, {0, 0, 0});
  int expected = 0;
  for (const auto& c : all_coordinates(shape)) {
    EXPECT_EQ(m.rank_of(c), expected);
    EXPECT_EQ(m.coordinate_of(expected), c);
    EXPECT_EQ(DeviceMesh::abstract(shape, c).rank(), expected);
    ++expected;
  }
  EXPECT_THROW(m.rank_of({2, 0, 0}), c10::Error);
  EXPECT_THROW(m.rank_of({0, 0}), c10::Error);
  EXPECT_THROW(m.coordinate_of(24), c10::Error);
  EXPECT_THROW(m.coordinate_of(-1), c10::Error);
}

TEST(AbstractMesh, Validation) {
  expect_error_mentions([] { DeviceMesh::abstract({2, 0}, {0, 0}); }, {"[2, 0]"});
  expect_error_mentions([] { DeviceMesh::abstract({-1}, {0}); }, {"[-1]"});
  expect_error_mentions([] { DeviceMesh::abstract({}, {}); }, {"[]"});
  expect_error_mentions([] { DeviceMesh::abstract({2, 2}, {0}); }, {"[2, 2]", "[0]"});
  expect_error_mentions([] { DeviceMesh::abstract({2, 2}, {0, 2}); }, {"[2, 2]", "[0, 2]"});
  expect_error_mentions([] { DeviceMesh::abstract({2}, {-1}); }, {"[-1]"});
  expect_error_mentions([] { DeviceMesh::abstract({2, 2}, {0, 0}, {"a"}); }, {"[a]"});
  expect_error_mentions(
      [] {
        DeviceMesh::abstract({2, 2}, {0, 0}, {"a", "a"});
      },
      {"duplicate", "'a'"});
}

TEST(AbstractMesh, Equality) {
  auto a = DeviceMesh::abstract({2, 2}, {0, 1}, {"x", "y"});
  auto a_copy = a;
  EXPECT_TRUE(a == a_copy);
  EXPECT_TRUE(a == DeviceMesh::abstract({2, 2}, {0, 1}, {"x", "y"}));
  EXPECT_TRUE(a != DeviceMesh::abstract({2, 2}, {1, 1}, {"x", "y"}));  // other coordinate
  EXPECT_TRUE(a != DeviceMesh::abstract({2, 2}, {0, 1}));              // other names
  EXPECT_TRUE(a != DeviceMesh::abstract({4, 1}, {0, 0}, {"x", "y"}));  // other shape
  EXPECT_TRUE(a != DeviceMesh());
  EXPECT_TRUE(DeviceMesh() == DeviceMesh());
}

TEST(AbstractMesh, Printing) {
  auto m = DeviceMesh::abstract({2, 3}, {1, 0}, {"x", "y"});
  const std::string s = m.to_string();
  EXPECT_NE(s.find("[2, 3]"), std::string::npos) << s;
  EXPECT_NE(s.find("[x, y]"), std::string::npos) << s;
  EXPECT_NE(s.find("[1, 0]"), std::string::npos) << s;
  std::ostringstream os;
  os << m;
  EXPECT_EQ(os.str(), s);
}

// ---- ShardSpec ----------------------------------------------------------------

// Brute-force check of local_shape_at/local_offsets_at at every coordinate of
// the mesh against the spec's sizes, and of the tiling: the local blocks of the
// coordinates that differ only in Shard mesh dims cover every element once.
void check_every_coordinate(const Shape& mesh_shape, const Placements& placements,
                            const Shape& global, const std::optional<ShardSizes>& sizes) {
  SCOPED_TRACE(::testing::Message()
               << "mesh " << ::testing::PrintToString(mesh_shape) << " placements "
               << st::to_string(placements) << " global " << ::testing::PrintToString(global));
  const int64_t ndim = static_cast<int64_t>(global.size());
  for (const auto& coord : all_coordinates(mesh_shape)) {
    auto mesh = DeviceMesh::abstract(mesh_shape, coord);
    ShardSpec spec(mesh, placements, global, sizes);
    Shape shape = global;
    Shape offsets(ndim, 0);
    for (size_t m = 0; m < placements.size(); ++m) {
      if (!st::is_shard(placements[m])) {
        EXPECT_TRUE(spec.shard_sizes(m).empty());
        continue;
      }
      int64_t d = st::shard_dim(placements[m]);
      if (d < 0) {
        d += ndim;
      }
      const std::vector<int64_t> expected_sizes = sizes ? (*sizes)[m] : [&] {
        std::vector<int64_t> v;
        for (int64_t i = 0; i < mesh_shape[m]; ++i) {
          v.push_back(brute_balanced(global[d], mesh_shape[m], i));
        }
        return v;
      }();
      EXPECT_EQ(spec.shard_sizes(m), expected_sizes);
      shape[d] = expected_sizes[coord[m]];
      offsets[d] = brute_offset(expected_sizes, coord[m]);
    }
    EXPECT_EQ(spec.local_shape(), shape) << "at " << ::testing::PrintToString(coord);
    EXPECT_EQ(spec.local_offsets(), offsets) << "at " << ::testing::PrintToString(coord);
    EXPECT_EQ(spec.local_shape_at(coord), shape);
    EXPECT_EQ(spec.local_offsets_at(coord), offsets);
    // Evaluated from another coordinate, the answer is the same.
    auto other = ShardSpec(DeviceMesh::abstract(mesh_shape, Shape(mesh_shape.size(), 0)),
                           placements, global, sizes);
    EXPECT_EQ(other.local_shape_at(coord), shape);
    EXPECT_EQ(other.local_offsets_at(coord), offsets);
  }
  // Tiling: count how often each global element is owned, over the
  // coordinates whose non-Shard mesh entries are 0.
  const int64_t numel =
      std::accumulate(global.begin(), global.end(), int64_t{1}, std::multiplies<int64_t>());
  std::vector<int> owned(numel, 0);
  ShardSpec spec(DeviceMesh::abstract(mesh_shape, Shape(mesh_shape.size(), 0)), placements, global,
                 sizes);
  for (const auto& coord : all_coordinates(mesh_shape)) {
    bool canonical = true;
    for (size_t m = 0; m < placements.size(); ++m) {
      canonical = canonical && (st::is_shard(placements[m]) || coord[m] == 0);
    }
    if (!canonical) {
      continue;
    }
    const auto shape = spec.local_shape_at(coord);
    const auto off = spec.local_offsets_at(coord);
    for (const auto& idx : all_coordinates(shape)) {  // every local element
      int64_t flat = 0;
      for (int64_t d = 0; d < ndim; ++d) {
        ASSERT_LT(off[d] + idx[d], global[d]);
        flat = flat * global[d] + off[d] + idx[d];
      }
      ++owned[flat];
    }
  }
  for (int64_t i = 0; i < numel; ++i) {
    EXPECT_EQ(owned[i], 1) << "element " << i;
  }
}

TEST(ShardSpec, OneDimMeshBalanced) {
  for (int64_t p = 1; p <= 5; ++p) {
    for (int64_t n : {0, 1, 2, 3, 7, 10, 12}) {
      check_every_coordinate({p}, {Shard{1}}, {2, n, 3}, std::nullopt);  // n<P, n%P!=0, n=0
      check_every_coordinate({p}, {Shard{-1}}, {3, n}, std::nullopt);    // negative dim
    }
    check_every_coordinate({p}, {Replicate{}}, {4, 5}, std::nullopt);
    check_every_coordinate({p}, {Partial{}}, {4, 5}, std::nullopt);
  }
}

TEST(ShardSpec, TwoDimMeshBalanced) {
  for (const Shape& mesh : {Shape{2, 2}, Shape{2, 3}, Shape{3, 1}, Shape{1, 4}}) {
    check_every_coordinate(mesh, {Shard{2}, Shard{3}}, {1, 2, 7, 5}, std::nullopt);
    check_every_coordinate(mesh, {Shard{3}, Shard{2}}, {1, 2, 7, 1}, std::nullopt);
    check_every_coordinate(mesh, {Shard{0}, Replicate{}}, {5, 3}, std::nullopt);
    check_every_coordinate(mesh, {Replicate{}, Shard{-2}}, {5, 3}, std::nullopt);
    check_every_coordinate(mesh, {Partial{}, Shard{1}}, {2, 0}, std::nullopt);
  }
}

TEST(ShardSpec, ExplicitSizesWithZeros) {
  check_every_coordinate({4}, {Shard{0}}, {6, 2}, ShardSizes{{0, 4, 0, 2}});
  check_every_coordinate({3}, {Shard{1}}, {2, 5}, ShardSizes{{5, 0, 0}});
  check_every_coordinate({3}, {Shard{1}}, {2, 0}, ShardSizes{{0, 0, 0}});
  check_every_coordinate({2, 3}, {Shard{0}, Shard{1}}, {3, 4}, ShardSizes{{3, 0}, {1, 0, 3}});
  check_every_coordinate({2, 2}, {Replicate{}, Shard{1}}, {3, 4}, ShardSizes{{}, {4, 0}});
}

TEST(ShardSpec, ExplicitSizesAreKept) {
  auto mesh = DeviceMesh::abstract({3}, {1});
  ShardSpec spec(mesh, {Shard{0}}, {6}, ShardSizes{{1, 4, 1}});
  EXPECT_EQ(spec.shard_sizes(0), (Shape{1, 4, 1}));
  EXPECT_EQ(spec.shard_sizes(-1), (Shape{1, 4, 1}));
  EXPECT_THROW(spec.shard_sizes(1), c10::Error);
  EXPECT_EQ(spec.all_shard_sizes(), (ShardSizes{{1, 4, 1}}));
  EXPECT_EQ(spec.local_shape(), (Shape{4}));
  EXPECT_EQ(spec.local_offsets(), (Shape{1}));
  EXPECT_FALSE(spec.is_balanced());
  // Explicit sizes that happen to be balanced count as balanced.
  EXPECT_TRUE(ShardSpec(mesh, {Shard{0}}, {7}, ShardSizes{{3, 2, 2}}).is_balanced());
  EXPECT_TRUE(ShardSpec(mesh, {Shard{0}}, {7}).is_balanced());
  EXPECT_TRUE(ShardSpec(mesh, {Replicate{}}, {7}).is_balanced());
}

TEST(ShardSpec, NormalizesNegativeShardDims) {
  auto mesh = DeviceMesh::abstract({2, 2}, {0, 0});
  ShardSpec spec(mesh, {Shard{-1}, Shard{-3}}, {4, 6, 8});
  EXPECT_EQ(spec.placements(), (Placements{Shard{2}, Shard{0}}));
  EXPECT_EQ(spec.mesh_dim_of(2), 0);
  EXPECT_EQ(spec.mesh_dim_of(-1), 0);
  EXPECT_EQ(spec.mesh_dim_of(0), 1);
  EXPECT_EQ(spec.mesh_dim_of(1), -1);
  EXPECT_THROW(spec.mesh_dim_of(3), c10::Error);
  EXPECT_EQ(spec, ShardSpec(mesh, {Shard{2}, Shard{0}}, {4, 6, 8}));
}

TEST(ShardSpec, Queries) {
  auto mesh = DeviceMesh::abstract({2, 2}, {1, 0});
  ShardSpec s(mesh, {Shard{0}, Partial{}}, {4, 3});
  EXPECT_EQ(s.ndim(), 2);
  EXPECT_EQ(s.numel(), 12);
  EXPECT_EQ(s.global_shape(), (Shape{4, 3}));
  EXPECT_TRUE(s.is_sharded());
  EXPECT_TRUE(s.has_partial());
  EXPECT_FALSE(s.is_replicated());
  EXPECT_TRUE(s.mesh() == mesh);
  ShardSpec r(mesh, {Replicate{}, Replicate{}}, {4, 3});
  EXPECT_TRUE(r.is_replicated());
  EXPECT_FALSE(r.is_sharded());
  EXPECT_FALSE(r.has_partial());
  EXPECT_EQ(r.local_shape(), (Shape{4, 3}));
  EXPECT_EQ(r.local_offsets(), (Shape{0, 0}));
  ShardSpec empty(mesh, {Shard{1}, Replicate{}}, {0, 3});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.local_shape(), (Shape{0, 1}));
  ShardSpec scalar(mesh, {Replicate{}, Partial{}}, {});
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.local_shape(), Shape{});
  EXPECT_THROW(s.local_shape_at({2, 0}), c10::Error);
  EXPECT_THROW(s.local_offsets_at({0}), c10::Error);
}

TEST(ShardSpec, ValidationErrors) {
  auto mesh = DeviceMesh::abstract({2, 3}, {0, 0});
  auto mesh1 = DeviceMesh::abstract({4}, {0});
  // Wrong number of placements.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{0}}, {4, 6});
      },
      {"[4, 6]", "[Shard(0)]", "[2, 3]", "expected 2 placements"});
  expect_error_mentions(
      [&] {
        ShardSpec(mesh1, {Shard{0}, Replicate{}}, {4, 6});
      },
      {"[4, 6]", "[Shard(0), Replicate()]", "[4]"});
  // Shard dim out of range, both signs, and on a 0-d tensor.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{2}, Replicate{}}, {4, 6});
      },
      {"[4, 6]", "[Shard(2), Replicate()]", "out of range"});
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Replicate{}, Shard{-3}}, {4, 6});
      },
      {"[4, 6]", "[Replicate(), Shard(-3)]", "out of range"});
  expect_error_mentions([&] { ShardSpec(mesh1, {Shard{0}}, {}); }, {"[]", "[Shard(0)]"});
  // Two mesh dims shard the same tensor dim (also through a negative dim).
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{1}, Shard{1}}, {4, 6});
      },
      {"[4, 6]", "[Shard(1), Shard(1)]", "tensor dim 1"});
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{1}, Shard{-1}}, {4, 6});
      },
      {"[4, 6]", "[Shard(1), Shard(-1)]", "tensor dim 1"});
  // Negative global extent.
  expect_error_mentions([&] { ShardSpec(mesh1, {Replicate{}}, {4, -1}); }, {"[4, -1]"});
  // sizes: wrong length.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{0}, Replicate{}}, {4, 6}, ShardSizes{{2, 2}});
      },
      {"[4, 6]", "[Shard(0), Replicate()]", "sizes [[2, 2]]"});
  // sizes: wrong number of coordinates for a Shard dim.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{0}, Replicate{}}, {4, 6}, ShardSizes{{1, 1, 2}, {}});
      },
      {"[4, 6]", "sizes [[1, 1, 2], []]", "expected 2"});
  // sizes: negative entry.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh1, {Shard{1}}, {4, 6}, ShardSizes{{3, 4, -1, 0}});
      },
      {"[4, 6]", "[Shard(1)]", "[[3, 4, -1, 0]]", "negative"});
  // sizes: non-empty entry for a non-Shard mesh dim.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Shard{0}, Replicate{}}, {4, 6}, ShardSizes{{2, 2}, {2, 2, 2}});
      },
      {"[4, 6]", "[Shard(0), Replicate()]", "Replicate()", "must be empty"});
  expect_error_mentions(
      [&] {
        ShardSpec(mesh, {Partial{}, Shard{1}}, {4, 6}, ShardSizes{{1, 1}, {2, 2, 2}});
      },
      {"[4, 6]", "[Partial(), Shard(1)]", "must be empty"});
  // sizes: wrong sum.
  expect_error_mentions(
      [&] {
        ShardSpec(mesh1, {Shard{1}}, {4, 6}, ShardSizes{{1, 1, 1, 1}});
      },
      {"[4, 6]", "[Shard(1)]", "[[1, 1, 1, 1]]", "sum to 4", "extent 6"});
  // Undefined mesh.
  EXPECT_THROW(ShardSpec(DeviceMesh(), {}, {4}), c10::Error);
}

TEST(ShardSpec, Equality) {
  auto mesh = DeviceMesh::abstract({3}, {1});
  ShardSpec a(mesh, {Shard{0}}, {7});
  EXPECT_EQ(a, ShardSpec(mesh, {Shard{0}}, {7}));
  EXPECT_EQ(a, ShardSpec(mesh, {Shard{0}}, {7}, ShardSizes{{3, 2, 2}}));  // explicit == balanced
  EXPECT_NE(a, ShardSpec(mesh, {Shard{0}}, {7}, ShardSizes{{2, 2, 3}}));
  EXPECT_NE(a, ShardSpec(mesh, {Replicate{}}, {7}));
  EXPECT_NE(a, ShardSpec(mesh, {Shard{0}}, {8}));
  EXPECT_NE(a, ShardSpec(mesh, {Shard{0}}, {7, 1}));
  // Another mesh: not equal, but the same layout if the mesh shape agrees.
  ShardSpec b(DeviceMesh::abstract({3}, {2}), {Shard{0}}, {7});
  EXPECT_NE(a, b);
  EXPECT_TRUE(a.same_layout(b));
  ShardSpec c(DeviceMesh::abstract({1, 3}, {0, 2}), {Replicate{}, Shard{0}}, {7});
  EXPECT_FALSE(a.same_layout(c));
  EXPECT_FALSE(a.same_layout(ShardSpec(mesh, {Shard{0}}, {7}, ShardSizes{{7, 0, 0}})));
}

TEST(ShardSpec, Printing) {
  auto mesh = DeviceMesh::abstract({4}, {0});
  ShardSpec s(mesh, {Shard{2}}, {1, 8, 1024, 1024});
  EXPECT_EQ(s.to_string(),
            "ShardSpec(global=[1, 8, 1024, 1024], placements=[Shard(2)], mesh=[4], "
            "sizes={0: [256, 256, 256, 256]})");
  auto mesh2 = DeviceMesh::abstract({2, 3}, {0, 0});
  ShardSpec t(mesh2, {Partial{}, Shard{-1}}, {5, 7}, ShardSizes{{}, {0, 7, 0}});
  EXPECT_EQ(t.to_string(),
            "ShardSpec(global=[5, 7], placements=[Partial(), Shard(1)], mesh=[2, 3], "
            "sizes={1: [0, 7, 0]})");
  ShardSpec r(mesh, {Replicate{}}, {3});
  EXPECT_EQ(r.to_string(), "ShardSpec(global=[3], placements=[Replicate()], mesh=[4], sizes={})");
  std::ostringstream os;
  os << s;
  EXPECT_EQ(os.str(), s.to_string());
}
