#pragma once
// Test utilities shared by the MPI test binaries.
#include <gtest/gtest.h>
#include <shardtensor/shardtensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace shardtensor::testing {

/// Placements the tests spell over and over.
using P = Placements;
inline const Placement S0 = Shard{0}, S1 = Shard{1}, S2 = Shard{2}, S3 = Shard{3}, S4 = Shard{4};
inline const Placement R = Replicate{};

/// Local. A float32 standard-normal tensor from a generator seeded with
/// `seed`, times `scale` plus `shift`: identical on every rank (libtorch seeds
/// its default generator differently in every process).
at::Tensor rnd(c10::IntArrayRef shape, uint64_t seed, double scale = 1.0, double shift = 0.0);

/// Collective over MPI_COMM_WORLD. The mesh a test should use: 1-D over all
/// ranks, or 2x2 when SHARDTENSOR_TEST_MESH=2x2.
DeviceMesh test_mesh();
/// Local. True when the test run uses the 2x2 mesh.
bool is_mesh_2x2();

/// Local. The first mesh.ndim() entries of `wanted` (so one list serves 1-D and 2-D meshes).
Placements fit_placements(const DeviceMesh& mesh, const Placements& wanted);

/// Collective over the whole job (MPI_COMM_WORLD or the c10d world), not
/// counted in comm_stats: the maximum of `value` over every rank.
int64_t max_over_ranks(int64_t value);

/// Collective over the whole job, not counted: element-wise reduction of a
/// copy of `t` (contiguous, CPU) over every rank.
at::Tensor reduce_over_ranks(const at::Tensor& t, ReduceOp op);

/// Collective over MPI_COMM_WORLD: true on every rank iff `ok` on every rank.
bool all_ranks(bool ok);

/// Collective over MPI_COMM_WORLD. Compares two plain tensors (shape and
/// values, |a-b| <= atol + rtol*|b|); the verdict and the message are the
/// same on every rank (the worst rank's error is reported).
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     double rtol = 1e-5, double atol = 1e-6);

/// Input to reference_check: a full tensor and how to shard it (std::nullopt: stays plain).
struct RefInput {
  at::Tensor full;
  std::optional<Placements> placements;
  bool requires_grad = true;
  /// Explicit shard sizes (e.g. with an empty shard); default balanced.
  std::optional<ShardSizes> sizes = std::nullopt;
};

/// Local. The one home for splits with an empty piece: `n` elements over
/// `parts` coordinates, coordinate `empty_at` (0 <= empty_at < parts) gets
/// nothing and the others a balanced split of all `n`. One part: {n}.
/// Throws (TORCH_CHECK) if `empty_at` is out of range.
std::vector<int64_t> split_with_empty(int64_t n, int64_t parts, int64_t empty_at);

/// Which coordinate of a mesh dim gets the empty piece: the first, a middle
/// one (size / 2) or the last; with two coordinates middle and last coincide.
enum class EmptyAt { kFirst, kMiddle, kLast };
/// Local. The coordinate `where` names on a mesh dim of `parts` coordinates.
int64_t empty_coordinate(EmptyAt where, int64_t parts);

/// Local. Sizes for `mesh` that give coordinate 0 of every Shard mesh dim an
/// empty piece and split the rest balanced (for the empty-shard cases); the
/// same as balanced when a mesh dim has one coordinate.
ShardSizes sizes_with_empty_first(const DeviceMesh& mesh, const Placements& placements,
                                  c10::IntArrayRef global_shape);
/// Local. Like sizes_with_empty_first, with the empty piece at the first, a
/// middle or the last coordinate of every Shard mesh dim.
ShardSizes sizes_with_empty_at(const DeviceMesh& mesh, const Placements& placements,
                               c10::IntArrayRef global_shape, EmptyAt where);

/// Local. An input sharded as `wanted` (fitted to the mesh), balanced split.
RefInput sharded_input(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                       bool requires_grad = true);
/// Local. Like sharded_input, with the first piece along every Shard mesh dim empty.
RefInput empty_first_input(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                           bool requires_grad = true);
/// Local. Like sharded_input, with the piece at `where` along every Shard mesh dim empty.
RefInput empty_input_at(const DeviceMesh& mesh, const at::Tensor& full, const Placements& wanted,
                        EmptyAt where, bool requires_grad = true);

/// Collective over MPI_COMM_WORLD. Runs `fn`; success on every rank iff `fn`
/// threw a c10::Error whose message contains every one of `needles` on every
/// rank (the final all-reduce also shows no rank was left waiting).
::testing::AssertionResult throws_everywhere(const std::function<void()>& fn,
                                             const std::vector<std::string>& needles);

/// Collective. Runs `fn` once on plain tensors (the reference) and once on the
/// sharded inputs, then compares: the output (gathered), the gradient of every
/// input that requires grad, and the gradient of every parameter, after a
/// backward pass from a fixed random cotangent. `params` are cloned for each
/// run, so `fn` must use the vector it is given.
/// Returns AssertionResult with every mismatch described.
using RefFn = std::function<at::Tensor(const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& params)>;
::testing::AssertionResult reference_check(const RefFn& fn, const std::vector<RefInput>& inputs,
                                           const DeviceMesh& mesh,
                                           const std::vector<at::Tensor>& params = {},
                                           double rtol = 1e-5, double atol = 1e-6,
                                           bool check_backward = true);

/// Note [precision check]. Collective. The reduced-precision form of
/// reference_check: the float inputs and `params` are rounded to `dtype`
/// (kHalf, kBFloat16, or kFloat where an op's float32 result depends on summation
/// order), then `fn` runs three times: on plain `dtype` tensors
/// (single-process libtorch in that dtype), on plain float64 tensors holding
/// the same rounded values (the exact answer), and on the sharded `dtype`
/// inputs. For the output and every gradient (input grads, then param grads;
/// the cotangent is rounded to `dtype` too), with E_single and E_sharded the
/// largest |result - exact| where the single-process result is finite:
///   E_sharded <= factor * E_single + unit * max|exact|,
/// where `unit` is the dtype's unit roundoff (2^-8 bf16, 2^-11 f16, 2^-24 f32): `factor`
/// allows another, equally valid order of roundings, the unit one extra
/// rounding of an intermediate (a partial result rounded to the dtype before
/// it is combined). Where the single-process result is Inf/NaN and the exact
/// one is finite (an overflow of the dtype), the sharded value must be the
/// same non-finite value or within that bound; where the exact one is
/// non-finite, the same non-finite value as single-process. The sharded
/// result must also have single-process's dtype and shape. With
/// SHARDTENSOR_PRECISION_REPORT set, rank 0 prints E_sharded / E_single.
::testing::AssertionResult precision_check(const RefFn& fn, const std::vector<RefInput>& inputs,
                                           const DeviceMesh& mesh, at::ScalarType dtype,
                                           const std::vector<at::Tensor>& params = {},
                                           double factor = 2.0, bool check_backward = true);

/// Collective for ShardTensors. Gathered value of any tensor: full_tensor() of a ShardTensor, the
/// tensor itself otherwise.
at::Tensor gathered(const at::Tensor& t);

}  // namespace shardtensor::testing
