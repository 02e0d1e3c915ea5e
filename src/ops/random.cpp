// Random ops on ShardTensors (Note [layout-invariant randomness]).
//
// Note [layout-invariant randomness]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A random op on a ShardTensor must give the same *global* tensor whatever the
// number of ranks and the placements, and identical values on the ranks that
// replicate a piece; drawing from each rank's generator on its local piece
// gives neither (equal-size pieces get the same noise, uneven ones put the
// generators out of step, replicas drift apart). So every value is a pure
// function of a 64-bit key and the element's **global row-major index**
// (counter-based, like Philox; here our own SplitMix64-style mixer):
//  - the key: each rank draws one random64() from the op's generator (the
//    default CPU generator unless one is passed), so every rank's generator
//    advances alike, and mesh rank 0's draw is broadcast (one small
//    collective over the whole mesh), so the ranks agree even if their
//    generators were seeded differently; torch::manual_seed(s) before the op
//    makes the result reproducible;
//  - uniform: the top `digits` bits of mix(key, index), `digits` being the
//    dtype's mantissa length, so that from + (to - from) * u < to exactly;
//  - normal: Box-Muller on two uniforms drawn at counters 2i and 2i + 1;
//  - bernoulli(p) / dropout: keep iff a 53-bit uniform < p (resp. >= p);
//  - exponential(l): -log1p(-u) / l; cauchy(m, s): m + s * tan(pi * (u - 1/2));
//    log_normal(m, s): exp(m + s * z); geometric(p): max(1, ceil(log(1 - u) /
//    log1p(-p))), u being a 53-bit uniform and z the normal above;
//  - integers (random_, randint_like): low + mix(key, index) mod range, in
//    int64 arithmetic (a range of 2^64 takes the bits as they are).
// Every op that draws follows this rule, including the in-place ones that
// the elementwise rule used to run on each piece with the rank's own
// generator (random_, exponential_, randint_like gave replicas of a
// Replicate tensor different values). Arguments are checked by running the
// op on a one-element plain tensor with a generator of its own first
// (libtorch's messages, on every rank, before the key's collective).
// Relation to single-process libtorch: the values differ from what
// `x.uniform_()` gives on a plain tensor with the same seed (libtorch's CPU
// generator is a sequential mt19937 stream over the local elements), but the
// distribution is the same, and a ShardTensor over a 1-rank mesh gives the
// same values as over any mesh. Partial inputs are resolved first; an in-place
// op on a Partial tensor writes the values on coordinate 0 of each Partial
// mesh dim and zeros elsewhere, so the (summed) value is the drawn one.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <utility>

#include "comm/agree.h"
#include "ops/common.h"

namespace shardtensor::ops {
namespace {

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// 64 random bits for counter `i` under `key` (two rounds, so that nearby keys
/// and nearby counters decorrelate).
inline uint64_t bits_at(uint64_t key, uint64_t i) {
  return mix64(mix64(key + 0x9E3779B97F4A7C15ull * (i + 1)) ^ key);
}

/// Uniform in [0, 1) with `digits` random bits (exactly representable in a
/// dtype with that many mantissa digits).
inline double uniform_at(uint64_t key, uint64_t i, int digits) {
  return static_cast<double>(bits_at(key, i) >> (64 - digits)) * std::ldexp(1.0, -digits);
}

/// Standard normal for element `i` (Box-Muller on counters 2i, 2i + 1).
inline double normal_at(uint64_t key, uint64_t i) {
  const double u1 = 1.0 - uniform_at(key, 2 * i, 53);  // (0, 1]
  const double u2 = uniform_at(key, 2 * i + 1, 53);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

int mantissa_digits(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return 53;
    case at::kFloat:
      return 24;
    case at::kHalf:
      return 11;
    case at::kBFloat16:
      return 8;
    default:
      return 53;
  }
}

/// The key of one random op: one draw from `gen` (or the default CPU
/// generator) on every rank, mesh rank 0's value on all (collective over the mesh).
uint64_t draw_key(const DeviceMesh& mesh, const c10::optional<at::Generator>& gen_arg) {
  at::Generator gen =
      gen_arg.has_value() && gen_arg->defined() ? *gen_arg : at::detail::getDefaultCPUGenerator();
  uint64_t key = 0;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    key = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }
  const auto agreed = comm::broadcast_record(mesh, {static_cast<int64_t>(key)}, 0);
  return static_cast<uint64_t>(agreed.at(0));
}

c10::optional<at::Generator> generator_arg(const std::vector<c10::IValue>& args) {
  for (const auto& a : args) {
    if (a.isGenerator()) return a.toGenerator();
  }
  return c10::nullopt;
}

/// Calls fn(flat_local_index, global_index) for every element of this rank's
/// piece of `spec`, in row-major local order.
template <typename Fn>
void for_each_global_index(const ShardSpec& spec, Fn fn) {
  const auto& g = spec.global_shape();
  const auto l = spec.local_shape();
  const auto o = spec.local_offsets();
  const int64_t nd = static_cast<int64_t>(g.size());
  int64_t numel = 1;
  for (int64_t v : l) numel *= v;
  if (numel == 0) return;
  std::vector<int64_t> stride(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * g[d + 1];
  std::vector<int64_t> j(nd, 0);
  int64_t base = 0;
  for (int64_t d = 0; d < nd; ++d) base += o[d] * stride[d];
  int64_t gi = base;
  for (int64_t k = 0; k < numel; ++k) {
    fn(k, static_cast<uint64_t>(gi));
    // advance the multi-index
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++j[d] < l[d]) {
        gi += stride[d];
        break;
      }
      gi -= (l[d] - 1) * stride[d];
      j[d] = 0;
    }
  }
}

enum class Kind { Uniform, Normal, Bernoulli, Exponential, Cauchy, LogNormal, Geometric };

/// This rank's piece of the global random tensor of `spec` (double, contiguous):
/// Uniform: a + (b - a) * u; Normal: a + b * z; Bernoulli: 1 if u < a else 0;
/// Exponential: rate a; Cauchy: median a, scale b; LogNormal: exp(N(a, b));
/// Geometric: success probability a (Note [layout-invariant randomness]).
at::Tensor draw(const ShardSpec& spec, uint64_t key, Kind kind, double a, double b,
                at::ScalarType dtype, at::Device device) {
  at::Tensor out = at::empty(spec.local_shape(), at::TensorOptions().dtype(at::kDouble));
  double* p = out.data_ptr<double>();
  const int digits = mantissa_digits(dtype);
  switch (kind) {
    case Kind::Exponential:
      for_each_global_index(
          spec, [&](int64_t k, uint64_t i) { p[k] = -std::log1p(-uniform_at(key, i, 53)) / a; });
      break;
    case Kind::Cauchy:
      for_each_global_index(spec, [&](int64_t k, uint64_t i) {
        p[k] = a + b * std::tan(M_PI * (uniform_at(key, i, 53) - 0.5));
      });
      break;
    case Kind::LogNormal:
      for_each_global_index(
          spec, [&](int64_t k, uint64_t i) { p[k] = std::exp(a + b * normal_at(key, i)); });
      break;
    case Kind::Geometric: {
      const double denom = std::log1p(-a);
      for_each_global_index(spec, [&](int64_t k, uint64_t i) {
        p[k] = std::max(1.0, std::ceil(std::log1p(-uniform_at(key, i, 53)) / denom));
      });
      break;
    }
    case Kind::Uniform:
      for_each_global_index(
          spec, [&](int64_t k, uint64_t i) { p[k] = a + (b - a) * uniform_at(key, i, digits); });
      break;
    case Kind::Normal:
      for_each_global_index(spec, [&](int64_t k, uint64_t i) { p[k] = a + b * normal_at(key, i); });
      break;
    case Kind::Bernoulli:
      for_each_global_index(
          spec, [&](int64_t k, uint64_t i) { p[k] = uniform_at(key, i, 53) < a ? 1.0 : 0.0; });
      break;
  }
  return out.to(device);  // drawn on the host (counter-based), then to the piece's device
}

/// This rank's piece of uniform integers in [low, low + range) (int64,
/// contiguous); range 0 stands for 2^64 (every int64).
at::Tensor draw_integers(const ShardSpec& spec, uint64_t key, int64_t low, uint64_t range,
                         at::Device device) {
  at::Tensor out = at::empty(spec.local_shape(), at::TensorOptions().dtype(at::kLong));
  int64_t* p = out.data_ptr<int64_t>();
  for_each_global_index(spec, [&](int64_t k, uint64_t i) {
    const uint64_t r = bits_at(key, i);
    p[k] = static_cast<int64_t>(static_cast<uint64_t>(low) + (range == 0 ? r : r % range));
  });
  return out.to(device);
}

/// The argument named `name` in op's schema (None if absent).
c10::IValue named_arg(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                      const char* name) {
  const auto& a = op.schema().arguments();
  for (size_t i = 0; i < a.size() && i < args.size(); ++i) {
    if (a[i].name() == name) return args[i];
  }
  return c10::IValue();
}

/// Runs op on a one-element plain tensor of self's dtype with a generator of
/// its own (the default generators are not advanced), so that bad arguments
/// raise libtorch's own message on every rank before any collective (the
/// arguments are the same on every rank). Not a Meta tensor: C++ libtorch has
/// no Meta kernels for the random ops (Python registers its own), and some
/// checks (exponential_'s dtype) run only on a non-empty tensor.
void check_arguments(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  std::vector<c10::IValue> sample_args = args;
  sample_args[0] = at::empty({1}, at::TensorOptions().dtype(args[0].toTensor().scalar_type()));
  const auto& a = op.schema().arguments();
  bool has_generator = false;
  for (size_t i = 0; i < a.size() && i < sample_args.size(); ++i) {
    if (a[i].name() == "generator") {
      sample_args[i] = at::make_generator<at::CPUGeneratorImpl>();
      has_generator = true;
    }
  }
  TORCH_INTERNAL_ASSERT(has_generator, op.operator_name(), " has no generator argument");
  try {
    Stack st(sample_args.begin(), sample_args.end());
    op.callBoxed(&st);
  } catch (const c10::Error& e) {
    fail(op, args, e.what_without_backtrace());
  }
}

/// Zeros the piece on ranks off coordinate 0 of a Partial mesh dim (so the sum is the value).
void zero_partial_replicas(const ShardSpec& spec, at::Tensor& local) {
  const auto coord = spec.mesh().coordinate();
  for (int64_t m = 0; m < spec.mesh().ndim(); ++m) {
    if (is_partial(spec.placements()[m]) && coord[m] != 0) {
      local.zero_();
      return;
    }
  }
}

const at::Tensor& shard_self(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  const at::Tensor& x = args.at(0).toTensor();
  if (!spec_of(x)) fail(op, args, "the first argument must be the ShardTensor");
  return x;
}

// uniform_(self, from, to, *, generator), normal_(self, mean, std, *, generator),
// bernoulli_.float(self, p, *, generator): in place, same layout.
void inplace_rule(const c10::OperatorHandle& op, Stack* stack, Kind kind) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = shard_self(op, args);
  const ShardSpec& spec = *spec_of(self);
  double a = 0.0, b = 1.0;
  if (kind == Kind::Bernoulli) {
    a = args.size() > 1 && args[1].isDouble() ? args[1].toDouble() : 0.5;
    if (!(a >= 0.0 && a <= 1.0)) fail(op, args, "bernoulli_ expects 0 <= p <= 1");
  } else {
    a = args[1].toDouble();
    b = args[2].toDouble();
    if (kind == Kind::Uniform && !(a <= b)) fail(op, args, "uniform_ expects from <= to");
    if (kind == Kind::Normal && !(b >= 0.0)) fail(op, args, "normal_ expects std >= 0");
  }
  const uint64_t key = draw_key(spec.mesh(), generator_arg(args));
  at::Tensor local = local_of(self);
  at::Tensor values =
      draw(spec, key, kind, a, b, local.scalar_type(), local.device()).to(local.scalar_type());
  zero_partial_replicas(spec, values);
  local.copy_(values);
  stack->push_back(self);
}

// bernoulli_.Tensor(self, p, *, generator) and bernoulli(self, *, generator),
// bernoulli.p(self, p, *, generator): probabilities elementwise.
void bernoulli_tensor_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const std::string overload = op.operator_name().overload_name;
  const bool inplace = op.operator_name().name == "aten::bernoulli_";
  if (!inplace && !overload.empty() && overload != "p") {
    fail(op, args, "this overload of bernoulli is not supported on ShardTensors");
  }
  const at::Tensor& self = shard_self(op, args);
  SpecPtr spec = std::make_shared<const ShardSpec>(without_partial(*spec_of(self)));
  // Probabilities: the p argument (bernoulli_.Tensor) or self (bernoulli), in self's layout.
  at::Tensor prob;
  double scalar_p = -1.0;
  if (inplace) {
    if (args[1].isTensor()) {
      const at::Tensor& p = args[1].toTensor();
      prob = to_layout(p.detach(), operand_spec(*spec, p.sizes()), *spec);
      prob = prob.expand(spec->local_shape());
    } else {
      scalar_p = args[1].toDouble();
    }
  } else if (overload == "p") {
    scalar_p = args[1].toDouble();
  } else {
    prob = to_layout(self.detach(), *spec, *spec);
  }
  const uint64_t key = draw_key(spec->mesh(), generator_arg(args));
  at::Tensor u = draw(*spec, key, Kind::Uniform, 0.0, 1.0, at::kDouble, local_of(self).device());
  at::Tensor values = scalar_p >= 0.0 ? (u < scalar_p) : (u < prob.to(at::kDouble).contiguous());
  if (inplace) {
    const ShardSpec& self_spec = *spec_of(self);
    at::Tensor local = local_of(self);
    at::Tensor v = values.to(local.scalar_type());
    zero_partial_replicas(self_spec, v);
    local.copy_(v);
    stack->push_back(self);
    return;
  }
  stack->push_back(wrap(values.to(local_of(self).scalar_type()), spec));
}

// rand_like / randn_like(self, dtype, layout, device, pin_memory, memory_format).
void like_rule(const c10::OperatorHandle& op, Stack* stack, Kind kind) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = shard_self(op, args);
  SpecPtr spec = std::make_shared<const ShardSpec>(without_partial(*spec_of(self)));
  at::ScalarType dtype = local_of(self).scalar_type();
  const c10::IValue dt = named_arg(op, args, "dtype");
  if (dt.isInt()) dtype = static_cast<at::ScalarType>(dt.toInt());
  if (!at::isFloatingType(dtype)) fail(op, args, "random *_like needs a floating-point dtype");
  const uint64_t key = draw_key(spec->mesh(), generator_arg(args));
  at::Tensor values = draw(*spec, key, kind, 0.0, 1.0, dtype, local_of(self).device()).to(dtype);
  stack->push_back(wrap(values, spec));
}

// exponential_(self, lambd), cauchy_(self, median, sigma), log_normal_(self,
// mean, std), geometric_(self, p): in place, same layout.
void inplace_dist_rule(const c10::OperatorHandle& op, Stack* stack, Kind kind) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = shard_self(op, args);
  check_arguments(op, args);
  const ShardSpec& spec = *spec_of(self);
  const double a = args[1].toDouble();
  const double b = kind == Kind::Cauchy || kind == Kind::LogNormal ? args[2].toDouble() : 0.0;
  const uint64_t key = draw_key(spec.mesh(), generator_arg(args));
  at::Tensor local = local_of(self);
  at::Tensor values =
      draw(spec, key, kind, a, b, local.scalar_type(), local.device()).to(local.scalar_type());
  zero_partial_replicas(spec, values);
  local.copy_(values);
  stack->push_back(self);
}

// [low, low + range) of libtorch's random_ for `dtype` given from/to (to
// absent: up to the dtype's largest value, 2^digits for floating dtypes,
// inclusive). range 0 stands for 2^64.
std::pair<int64_t, uint64_t> random_range(at::ScalarType dtype, int64_t from,
                                          c10::optional<int64_t> to) {
  if (to.has_value()) return {from, static_cast<uint64_t>(*to) - static_cast<uint64_t>(from)};
  uint64_t top = 0;  // inclusive upper bound
  if (at::isFloatingType(dtype)) {
    top = uint64_t{1} << mantissa_digits(dtype);
  } else if (dtype == at::kBool) {
    top = 1;
  } else {
    AT_DISPATCH_INTEGRAL_TYPES(dtype, "random_range", [&] {
      top = static_cast<uint64_t>(std::numeric_limits<scalar_t>::max());
    });
  }
  return {from, top - static_cast<uint64_t>(from) + 1};
}

// random_(self), random_.to(self, to), random_.from(self, from, to).
void random_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = shard_self(op, args);
  check_arguments(op, args);
  const ShardSpec& spec = *spec_of(self);
  at::Tensor local = local_of(self);
  const std::string& overload = op.operator_name().overload_name;
  int64_t from = 0;
  c10::optional<int64_t> to;
  if (overload == "to") {
    to = args[1].toInt();
  } else if (overload == "from") {
    from = args[1].toInt();
    if (!args[2].isNone()) to = args[2].toInt();
  }
  if (to.has_value() && !(from < *to)) {
    fail(op, args, "random_ expects 'from' to be less than 'to'");
  }
  const auto [low, range] = random_range(local.scalar_type(), from, to);
  const uint64_t key = draw_key(spec.mesh(), generator_arg(args));
  at::Tensor values = draw_integers(spec, key, low, range, local.device()).to(local.scalar_type());
  zero_partial_replicas(spec, values);
  local.copy_(values);
  stack->push_back(self);
}

// randint_like(self, high), randint_like.low_dtype(self, low, high),
// randint_like.Tensor(self, high tensor) and their generator overloads.
void randint_like_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& self = shard_self(op, args);
  const std::string& overload = op.operator_name().overload_name;
  if (overload.size() >= 4 && overload.compare(overload.size() - 4, 4, "_out") == 0) {
    fail(op, args, "out= variants of randint_like are not supported");
  }
  SpecPtr spec = std::make_shared<const ShardSpec>(without_partial(*spec_of(self)));
  at::ScalarType dtype = local_of(self).scalar_type();
  const c10::IValue dt = named_arg(op, args, "dtype");
  if (dt.isInt()) dtype = static_cast<at::ScalarType>(dt.toInt());
  int64_t low = 0, high = 0;
  const c10::IValue lo = named_arg(op, args, "low");
  const c10::IValue hi = named_arg(op, args, "high");
  if (lo.isInt()) low = lo.toInt();
  if (hi.isTensor()) {
    const at::Tensor& h = hi.toTensor();
    if (spec_of(h) || h.dim() != 0) {
      fail(op, args, "randint_like's high must be a plain 0-dim tensor");
    }
    high = h.item<int64_t>();
  } else {
    high = hi.toInt();
  }
  if (!(low < high)) {
    fail(op, args,
         "randint_like expects low < high, got low=" + std::to_string(low) +
             ", high=" + std::to_string(high));
  }
  const uint64_t key = draw_key(spec->mesh(), generator_arg(args));
  at::Tensor values =
      draw_integers(*spec, key, low, static_cast<uint64_t>(high) - static_cast<uint64_t>(low),
                    local_of(self).device())
          .to(dtype);
  stack->push_back(wrap(values, spec));
}

// dropout(input, p, train): the mask is layout-invariant, so replicas of a
// replicated piece drop the same elements.
void dropout_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const at::Tensor& x = shard_self(op, args);
  const double p = args[1].toDouble();
  const bool train = args[2].toBool();
  if (!(p >= 0.0 && p <= 1.0)) fail(op, args, "dropout probability has to be between 0 and 1");
  if (!train || p == 0.0) {
    stack->push_back(x);
    return;
  }
  const ShardSpec* s = spec_of(x);
  SpecPtr spec = std::make_shared<const ShardSpec>(without_partial(*s));
  at::Tensor local = to_layout(x, *spec, *spec);
  if (p == 1.0) {
    stack->push_back(wrap(local * 0.0, spec));
    return;
  }
  const uint64_t key = draw_key(spec->mesh(), c10::nullopt);
  at::Tensor keep = draw(*spec, key, Kind::Bernoulli, 1.0 - p, 0.0, at::kDouble, local.device());
  at::Tensor mask = keep.to(local.scalar_type()).div_(1.0 - p);
  stack->push_back(wrap(local * mask, spec));
}

const RuleRegistrar uniform_ops({"uniform_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_rule(op, s, Kind::Uniform);
});
const RuleRegistrar normal_ops({"normal_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_rule(op, s, Kind::Normal);
});
const RuleRegistrar bernoulli_float_ops({"bernoulli_.float"},
                                        [](const c10::OperatorHandle& op, Stack* s) {
                                          inplace_rule(op, s, Kind::Bernoulli);
                                        });
const RuleRegistrar bernoulli_ops({"bernoulli_.Tensor", "bernoulli", "bernoulli.p"},
                                  bernoulli_tensor_rule);
const RuleRegistrar rand_like_ops({"rand_like"}, [](const c10::OperatorHandle& op, Stack* s) {
  like_rule(op, s, Kind::Uniform);
});
const RuleRegistrar randn_like_ops({"randn_like"}, [](const c10::OperatorHandle& op, Stack* s) {
  like_rule(op, s, Kind::Normal);
});
const RuleRegistrar dropout_ops({"dropout"}, dropout_rule);
const RuleRegistrar exponential_ops({"exponential_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_dist_rule(op, s, Kind::Exponential);
});
const RuleRegistrar cauchy_ops({"cauchy_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_dist_rule(op, s, Kind::Cauchy);
});
const RuleRegistrar log_normal_ops({"log_normal_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_dist_rule(op, s, Kind::LogNormal);
});
const RuleRegistrar geometric_ops({"geometric_"}, [](const c10::OperatorHandle& op, Stack* s) {
  inplace_dist_rule(op, s, Kind::Geometric);
});
const RuleRegistrar random_ops({"random_"}, random_rule);
const RuleRegistrar randint_like_ops({"randint_like"}, randint_like_rule);

}  // namespace
}  // namespace shardtensor::ops
