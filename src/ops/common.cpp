#include "ops/common.h"

#include "comm/error_channel.h"
#include "comm/settings.h"

#include <ATen/Dispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <shardtensor/core/policy.h>
#include <shardtensor/tensor/shard_tensor.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

namespace shardtensor::ops {

at::ScalarType acc_dtype(at::ScalarType t) { return is_reduced_float(t) ? at::kFloat : t; }

bool is_reduced_float(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

at::Scalar extreme_identity(at::ScalarType t, bool is_max) {
  if (at::isFloatingType(t)) {
    const double inf = std::numeric_limits<double>::infinity();
    return is_max ? -inf : inf;
  }
  if (t == at::kBool) return at::Scalar(!is_max);
  at::Scalar r;
  AT_DISPATCH_INTEGRAL_TYPES(t, "extreme_identity", [&] {
    r = is_max ? at::Scalar(std::numeric_limits<scalar_t>::lowest())
               : at::Scalar(std::numeric_limits<scalar_t>::max());
  });
  return r;
}

bool will_backward(const at::Tensor& t) {
  return t.defined() && at::GradMode::is_enabled() && t.requires_grad();
}

at::ScalarType dtype_or_none(const at::Tensor& t) {
  return t.defined() ? t.scalar_type() : at::ScalarType::Undefined;
}

at::Tensor probe_ones(c10::IntArrayRef shape, at::ScalarType dtype, bool requires_grad) {
  if (dtype == at::ScalarType::Undefined) return at::Tensor();
  return at::ones(shape, at::TensorOptions().dtype(dtype)).requires_grad_(requires_grad);
}

std::string dtype_support_error(const char* family, std::vector<at::ScalarType> dtypes,
                                bool backward, const DtypeProbe& probe) {
  TORCH_INTERNAL_ASSERT(!dtypes.empty());
  if (!at::isFloatingType(dtypes[0])) return {};  // integer inputs: the rules' own checks
  bool plain = dtypes[0] == at::kFloat || dtypes[0] == at::kDouble;
  for (at::ScalarType t : dtypes) {
    plain = plain && (t == dtypes[0] || t == at::ScalarType::Undefined);
  }
  if (plain) return {};
  static std::mutex mu;
  static std::map<std::tuple<std::string, std::vector<at::ScalarType>, bool>, std::string> verdicts;
  auto key = std::make_tuple(std::string(family), dtypes, backward);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = verdicts.find(key);
    if (it != verdicts.end()) return it->second;
  }
  std::string why;
  try {
    // Plain tensors, no autocast (it would change the dtypes probed), grad as asked.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    at::AutoGradMode grad(backward);
    at::Tensor out = probe(dtypes, backward);
    if (backward && out.requires_grad()) out.sum().backward();
  } catch (const c10::Error& e) {
    why = e.what_without_backtrace();
    why = why.substr(0, why.find('\n'));
    if (why.empty()) why = "libtorch's kernel failed";
  }
  if (!why.empty()) {
    std::string types;
    for (at::ScalarType t : dtypes) {
      if (t == at::ScalarType::Undefined) continue;
      types += (types.empty() ? "" : ", ") + std::string(c10::toString(t));
    }
    why = std::string(family) + " on " + types + (backward ? " (with backward)" : "") +
          " has no working CPU kernel in this libtorch: " + why;
  }
  std::lock_guard<std::mutex> lock(mu);
  verdicts.emplace(std::move(key), why);
  return why;
}

void check_dtype_support(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                         const char* family, std::vector<at::ScalarType> dtypes, bool backward,
                         const DtypeProbe& probe) {
  const std::string why = dtype_support_error(family, std::move(dtypes), backward, probe);
  if (!why.empty()) fail(op, args, why);
}

bool is_written(const c10::Argument& a) { return a.alias_info() && a.alias_info()->isWrite(); }

int64_t int_arg(const c10::IValue& v) {
  if (v.isInt()) return v.toInt();
  if (v.isSymInt()) return v.toSymInt().expect_int();
  TORCH_CHECK(false, "shardtensor: expected an int argument, got ", v.tagKind());
}

std::vector<int64_t> int_list(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) out.push_back(int_arg(e));
  return out;
}

std::optional<std::vector<int64_t>> opt_int_list(const c10::IValue& v) {
  if (v.isNone()) return std::nullopt;
  return int_list(v);
}

at::Tensor opt_tensor(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }

const ShardSpec* spec_of(const at::Tensor& t) {
  auto* impl = detail::shard_impl(t);
  return impl ? impl->spec().get() : nullptr;
}

SpecPtr spec_ptr_of(const at::Tensor& t) {
  auto* impl = detail::shard_impl(t);
  return impl ? impl->spec() : nullptr;
}

at::Tensor local_of(const at::Tensor& t) {
  auto* impl = detail::shard_impl(t);
  return impl ? impl->local() : t;
}

at::Tensor wrap(at::Tensor local, SpecPtr spec) {
  return detail::make_shard_tensor(std::move(local), std::move(spec));
}

void refuse_in_place(const c10::IValue& result, const std::string& why) {
  auto mark = [&](const at::Tensor& t) {
    auto* impl = detail::shard_impl(t);
    if (!impl) return;
    auto wb = std::make_shared<detail::WriteBack>();
    wb->refusal = why;
    impl->set_write_back(std::move(wb));
  };
  if (result.isTensor()) {
    mark(result.toTensor());
  } else if (result.isTensorList()) {
    for (const at::Tensor& t : result.toTensorList()) mark(t);
  }
}

namespace {

// Note [stale copy views] for copies that are made anew by rerunning what
// made them (refuse_in_place_following).
struct Following {
  CopyOrigin origin;
  std::function<std::vector<at::Tensor>()> remake;
  // The results' local pieces, not their wrappers (which hold this through
  // their WriteBack: no cycle).
  std::vector<at::Tensor> pieces;
};

// Local. Whether elements of `t` may share memory (strides too small for
// the extents below them, e.g. unfold's overlapping windows, a zero stride).
bool may_overlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // the span of the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return true;
    extent += (size - 1) * stride;
  }
  return false;
}

// Local. Copies `fresh` (remade) into the piece `old` of a copy in place, so
// that views of it see the new values. Where `old` views a buffer made for it
// (the gathered tensor a fallback view op viewed, unfold's extended piece)
// and `fresh` views its own buffer the same way, the buffer is overwritten
// instead: a copy into a piece whose elements overlap would give the
// overlapping elements' gradient twice. `done` holds the buffers overwritten
// by this refresh already (the results of one call may view one buffer).
void copy_piece(const at::Tensor& old, const at::Tensor& fresh, const CopyOrigin& f,
                std::vector<const c10::TensorImpl*>* done) {
  TORCH_INTERNAL_ASSERT(old.sizes() == fresh.sizes(), "remade copy of ", f.what, " has shape ",
                        fresh.sizes(), ", not ", old.sizes());
  // This rank's piece is in fact a view of the source (a piece that needed
  // nothing from other ranks): up to date already.
  if (old.is_alias_of(fresh)) return;
  // The buffers the pieces view (autograd's view base).
  auto base_of = [](const at::Tensor& t) {
    return t.is_view() ? at::Tensor(at::TensorBase(t._base())) : at::Tensor();
  };
  const at::Tensor base = base_of(old), fresh_base = base_of(fresh);
  if (base.defined() && fresh_base.defined() && base.sizes() == fresh_base.sizes() &&
      base.strides() == fresh_base.strides() && old.strides() == fresh.strides() &&
      old.storage_offset() - base.storage_offset() ==
          fresh.storage_offset() - fresh_base.storage_offset() &&
      !may_overlap(base) && !base.is_alias_of(local_of(f.source))) {
    if (std::find(done->begin(), done->end(), base.unsafeGetTensorImpl()) == done->end()) {
      base.copy_(fresh_base);
      done->push_back(base.unsafeGetTensorImpl());
    }
    return;
  }
  TORCH_CHECK(!may_overlap(old), "cannot use the result of ", f.what,
              ": it is a copy (libtorch's would be a view) whose source was written since, and "
              "its piece's elements overlap, so it cannot be made anew in place (Note [stale "
              "copy views]); take the view again");
  old.copy_(fresh);
}

// Collective over the source's mesh where the source changed (every rank alike).
void follow(Following& f, const at::Tensor& used) {
  if (!f.origin.outdated(used)) return;
  const std::vector<at::Tensor> fresh = f.remake();
  TORCH_INTERNAL_ASSERT(fresh.size() == f.pieces.size(), "remade copy of ", f.origin.what, " has ",
                        fresh.size(), " pieces, not ", f.pieces.size());
  std::vector<const c10::TensorImpl*> done;
  for (size_t i = 0; i < fresh.size(); ++i) copy_piece(f.pieces[i], fresh[i], f.origin, &done);
  f.origin.remade();
}

}  // namespace

CopyOrigin::CopyOrigin(at::Tensor src, std::string what_)
    : source(std::move(src)), spec(spec_ptr_of(source)), what(std::move(what_)) {
  TORCH_INTERNAL_ASSERT(spec, "CopyOrigin: the source of ", what, " is not a ShardTensor");
  seen = detail::alias_version(source);
}

bool CopyOrigin::outdated(const at::Tensor& used) const {
  detail::refresh_copy_view(source);  // a copy of a copy: its source first
  if (detail::alias_version(source) == seen) return false;
  TORCH_CHECK(spec_ptr_of(source) == spec, "cannot use the result of ", what,
              ": it is a copy (libtorch's would be a view) and its source was changed in place "
              "to the layout ",
              spec_of(source)->to_string(),
              " (an in-place view op) after the view was taken, so the copy cannot be made "
              "anew from it (Note [stale copy views]); take the view again. The used tensor: ",
              spec_of(used)->to_string());
  return true;
}

void CopyOrigin::remade() {
  seen = detail::alias_version(source);
  ++*refreshes;
}

bool CopyOrigin::stale() const {
  return detail::stale_copy_view(source) || detail::alias_version(source) != seen;
}

void refuse_in_place_following(const std::vector<at::Tensor>& results, const std::string& why,
                               const at::Tensor& source, const std::string& what,
                               std::function<std::vector<at::Tensor>()> remake) {
  auto f = std::make_shared<Following>(Following{CopyOrigin(source, what), std::move(remake), {}});
  for (const at::Tensor& t : results) f->pieces.push_back(local_of(t));
  for (const at::Tensor& t : results) {
    auto* impl = detail::shard_impl(t);
    TORCH_INTERNAL_ASSERT(impl, "refuse_in_place_following: a result is not a ShardTensor");
    auto wb = std::make_shared<detail::WriteBack>();
    wb->refusal = why;
    wb->refresh = [f](const at::Tensor& used) { follow(*f, used); };
    // Metadata only, alike on every rank (also where a rank's piece happens
    // to view the source's).
    wb->stale = [f](const at::Tensor&) { return f->origin.stale(); };
    wb->refreshes = f->origin.refreshes;
    impl->set_write_back(std::move(wb));
  }
}

bool returns_view(const c10::FunctionSchema& schema) {
  for (const auto& r : schema.returns()) {
    if (r.alias_info() && !r.alias_info()->isWrite()) return true;
  }
  return false;
}

std::vector<c10::IValue> pop_args(const c10::OperatorHandle& op, Stack* stack) {
  const size_t n = op.schema().arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= n);
  std::vector<c10::IValue> args(std::make_move_iterator(stack->end() - n),
                                std::make_move_iterator(stack->end()));
  stack->erase(stack->end() - n, stack->end());
  return args;
}

namespace {

void describe_tensor(std::ostream& os, const at::Tensor& t) {
  if (!t.defined()) {
    os << "undefined";
  } else if (auto* s = spec_of(t)) {
    os << "ShardTensor(global=" << c10::IntArrayRef(s->global_shape())
       << ", placements=" << to_string(s->placements()) << ", local=" << local_of(t).sizes() << ")";
  } else {
    os << "Tensor" << t.sizes();
  }
}

void describe_value(std::ostream& os, const c10::IValue& v) {
  if (v.isTensor()) {
    describe_tensor(os, v.toTensor());
  } else if (v.isTensorList()) {
    os << "[";
    bool first = true;
    for (const at::Tensor& t : v.toTensorList()) {
      os << (first ? "" : ", ");
      describe_tensor(os, t);
      first = false;
    }
    os << "]";
  } else if (v.isList()) {
    os << "[";
    bool first = true;
    for (const c10::IValue& e : v.toListRef()) {
      os << (first ? "" : ", ");
      describe_value(os, e);
      first = false;
    }
    os << "]";
  } else if (v.isNone()) {
    os << "None";
  } else {
    os << v;
  }
}

}  // namespace

std::vector<c10::IValue> peek_args(const c10::OperatorHandle& op, const Stack& stack) {
  const size_t n = op.schema().arguments().size();
  return std::vector<c10::IValue>(stack.end() - n, stack.end());
}

const ShardSpec& self_spec(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  const ShardSpec* s = args[0].isTensor() ? spec_of(args[0].toTensor()) : nullptr;
  if (!s) fail(op, args, "the tensor argument `self` must be the ShardTensor");
  return *s;
}

int64_t wrap_dim(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, int64_t ndim,
                 int64_t dim) {
  const int64_t nd = std::max<int64_t>(ndim, 1);
  if (dim < -nd || dim >= nd) {
    fail(op, args,
         "dim " + std::to_string(dim) + " is out of range for a tensor of " + std::to_string(ndim) +
             " dims");
  }
  return ndim == 0 ? 0 : (dim < 0 ? dim + nd : dim);
}

ShardSpec replicated_spec(const DeviceMesh& mesh, c10::IntArrayRef shape) {
  return ShardSpec(mesh, Placements(mesh.ndim(), Replicate{}), shape.vec());
}

std::string shape_str(c10::IntArrayRef v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string describe_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  std::ostringstream os;
  os << op.operator_name() << "(";
  const auto& schema_args = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (i) os << ", ";
    if (i < schema_args.size()) os << schema_args[i].name() << "=";
    describe_value(os, args[i]);
  }
  os << ")";
  return os.str();
}

void fail(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
          const std::string& why) {
  TORCH_CHECK(false, "shardtensor: ", why, " in ", describe_call(op, args));
}

std::vector<at::Tensor> shard_args(const std::vector<c10::IValue>& args) {
  std::vector<at::Tensor> out;
  for (const auto& v : args) {
    if (v.isTensor()) {
      if (spec_of(v.toTensor())) out.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (spec_of(t)) out.push_back(t);
      }
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor() && spec_of(e.toTensor())) out.push_back(e.toTensor());
      }
    }
  }
  return out;
}

DeviceMesh common_mesh(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  auto shards = shard_args(args);
  TORCH_INTERNAL_ASSERT(!shards.empty(), "no ShardTensor argument in ", op.operator_name());
  const DeviceMesh& mesh = spec_of(shards[0])->mesh();
  for (const auto& t : shards) {
    if (spec_of(t)->mesh() != mesh) {
      fail(op, args,
           "ShardTensor arguments live on different meshes (" + mesh.to_string() + " and " +
               spec_of(t)->mesh().to_string() + ")");
    }
  }
  return mesh;
}

std::vector<int64_t> sharded_mesh_dims(const ShardSpec& spec) {
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < spec.mesh().ndim(); ++m) {
    if (is_shard(spec.placements()[m])) dims.push_back(m);
  }
  return dims;
}

ShardSpec operand_spec(const ShardSpec& out, c10::IntArrayRef shape) {
  const int64_t lead = out.ndim() - static_cast<int64_t>(shape.size());
  TORCH_INTERNAL_ASSERT(lead >= 0);
  Placements p;
  ShardSizes sizes;
  for (int64_t m = 0; m < out.mesh().ndim(); ++m) {
    const auto& pl = out.placements()[m];
    const int64_t od = shard_dim(pl) - lead;
    if (is_shard(pl) && od >= 0 && shape[od] == out.global_shape()[shard_dim(pl)]) {
      p.push_back(Shard{od});
      sizes.push_back(out.shard_sizes(m));
    } else {
      p.push_back(Replicate{});
      sizes.push_back({});
    }
  }
  return ShardSpec(out.mesh(), p, shape.vec(), sizes);
}

ShardSpec pending_operand_spec(const ShardSpec& out, c10::IntArrayRef shape) {
  ShardSpec s = operand_spec(out, shape);
  if (!out.has_partial()) return s;
  Placements p = s.placements();
  for (int64_t m = 0; m < out.mesh().ndim(); ++m) {
    if (is_partial(out.placements()[m])) p[m] = Partial{};
  }
  return ShardSpec(out.mesh(), p, shape.vec(), s.all_shard_sizes());
}

at::Tensor to_layout(const at::Tensor& operand, const ShardSpec& target, const ShardSpec& compute) {
  at::Tensor local;
  if (const ShardSpec* s = spec_of(operand)) {
    local = *s == target ? local_of(operand)
                         : detail::redistribute_local(local_of(operand), *s, target);
  } else {
    ShardSpec replicated(target.mesh(), Placements(target.mesh().ndim(), Replicate{}),
                         operand.sizes().vec());
    local =
        replicated == target ? operand : detail::redistribute_local(operand, replicated, target);
  }
  std::vector<int64_t> sum_dims;
  for (int64_t m = 0; m < target.mesh().ndim(); ++m) {
    const Placement& c = compute.placements()[m];
    const Placement& t = target.placements()[m];
    // A whole (replicated) operand used on every summand of a Partial result
    // (Note [pending partial sums]) contributed to each of them: its gradient
    // is summed over that mesh dim too.
    if ((is_shard(c) && !is_shard(t)) || (is_partial(c) && is_replicate(t))) {
      sum_dims.push_back(m);
    }
  }
  if (!sum_dims.empty() && local.requires_grad()) {
    local = comm::use_replicated(local, target.mesh(), sum_dims);
  }
  return local;
}

ShardSpec without_partial(const ShardSpec& spec) {
  if (!spec.has_partial()) return spec;
  Placements p = spec.placements();
  for (auto& pl : p) {
    if (is_partial(pl)) pl = Replicate{};
  }
  return ShardSpec(spec.mesh(), p, spec.global_shape(), spec.all_shard_sizes());
}

at::Tensor summed_partial(const at::Tensor& t) {
  const ShardSpec* s = spec_of(t);
  if (!s || !s->has_partial()) return t;
  return ShardTensor(t).redistribute(without_partial(*s).placements(), s->all_shard_sizes());
}

SpecPtr make_spec(const DeviceMesh& mesh, Placements placements, std::vector<int64_t> shape,
                  std::optional<ShardSizes> sizes) {
  return std::make_shared<const ShardSpec>(mesh, std::move(placements), std::move(shape),
                                           std::move(sizes));
}

void push_results(const c10::OperatorHandle& op, const std::vector<c10::IValue>& orig_args,
                  Stack* results, const SpecPtr& spec, Stack* stack) {
  const auto& schema = op.schema();
  const auto& rets = schema.returns();
  TORCH_INTERNAL_ASSERT(results->size() == rets.size(), "unexpected number of results of ",
                        op.operator_name());
  for (size_t j = 0; j < rets.size(); ++j) {
    c10::IValue& r = (*results)[j];
    const auto* alias = rets[j].alias_info();
    if (alias && alias->isWrite()) {
      // Find the argument written in place (same alias set) and return it.
      bool found = false;
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto* a = schema.arguments()[i].alias_info();
        if (a && a->isWrite() && a->beforeSets() == alias->beforeSets()) {
          stack->push_back(orig_args[i]);
          found = true;
          break;
        }
      }
      TORCH_INTERNAL_ASSERT(found, "no written argument for a result of ", op.operator_name());
    } else if (r.isTensor() && spec) {
      stack->push_back(wrap(r.toTensor(), spec));
    } else {
      stack->push_back(std::move(r));
    }
  }
}

bool gathers(const ShardSpec& src, const ShardSpec& dst) {
  for (int64_t m = 0; m < src.mesh().ndim(); ++m) {
    if (is_shard(src.placements()[m]) && !is_shard(dst.placements()[m])) return true;
  }
  return false;
}

int64_t gathered_bytes(const ShardSpec& src, const ShardSpec& dst, int64_t itemsize) {
  const int64_t grown =
      c10::multiply_integers(dst.local_shape()) - c10::multiply_integers(src.local_shape());
  return grown > 0 ? grown * itemsize : 0;
}

void note_gather(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                 const DeviceMesh& mesh, int64_t bytes, const std::string& what) {
  // Strict mode decides whether the gather runs (Note [agreed settings]).
  if (comm::use_setting(mesh, Setting::Strict) != 0) {
    fail(op, args,
         what + ", which strict mode (SHARDTENSOR_STRICT / shardtensor::set_strict) refuses");
  }
  std::ostringstream name;
  name << op.operator_name();
  detail::record_gather(name.str(), bytes, mesh.rank() == 0, what);
}

bool runs_plain(const ShardSpec& spec, const at::Tensor& local,
                const std::vector<int64_t>& local_dims) {
  if (local.numel() == 0) return false;
  std::vector<int> count(spec.ndim(), 0);
  const DeviceMesh& mesh = spec.mesh();
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& pl = spec.placements()[m];
    if (is_shard(pl) && ++count[shard_dim(pl)] > 1) return false;
    if (mesh.size(m) == 1 || is_replicate(pl)) continue;
    if (is_partial(pl)) return false;
    if (std::find(local_dims.begin(), local_dims.end(), shard_dim(pl)) == local_dims.end()) {
      return false;
    }
    for (int64_t n : spec.shard_sizes(m)) {
      if (n == 0) return false;
    }
  }
  return true;
}

SpecPtr plain_output_spec(const ShardSpec& in, c10::IntArrayRef out_local) {
  const DeviceMesh& mesh = in.mesh();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(out_local.size()) == in.ndim(),
                        "plain path: the result has another rank than the input");
  std::vector<int64_t> shape = out_local.vec();
  Placements pl = in.placements();
  ShardSizes sizes(mesh.ndim());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (is_partial(pl[m])) pl[m] = Replicate{};
    if (is_shard(pl[m]) && mesh.size(m) > 1) {
      shape[shard_dim(pl[m])] = in.global_shape()[shard_dim(pl[m])];
      sizes[m] = in.shard_sizes(m);
    }
  }
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (is_shard(pl[m]) && mesh.size(m) == 1) sizes[m] = {shape[shard_dim(pl[m])]};
  }
  return make_spec(mesh, std::move(pl), std::move(shape), std::move(sizes));
}

void call_plain(const c10::OperatorHandle& op, std::vector<c10::IValue> args, Stack* stack) {
  const ShardSpec& in = *spec_of(args[0].toTensor());
  const Placements rep(in.mesh().ndim(), Replicate{});
  bool shards_over_ranks = false;
  for (int64_t m = 0; m < in.mesh().ndim(); ++m) {
    shards_over_ranks =
        shards_over_ranks || (is_shard(in.placements()[m]) && in.mesh().size(m) > 1);
  }
  Stack s = std::move(args);
  s[0] = local_of(s[0].toTensor());
  for (size_t i = 1; i < s.size(); ++i) {
    if (!s[i].isTensor()) continue;
    const at::Tensor t = s[i].toTensor();
    if (!t.defined()) continue;
    // A plain parameter is used as is unless a mesh dim of size > 1 shards
    // the input (its gradient must then be summed over that dim): mesh dims
    // of size 1 sum nothing.
    if (!spec_of(t) && !shards_over_ranks) continue;
    s[i] = to_layout(t, ShardSpec(in.mesh(), rep, t.sizes().vec()), in);
  }
  op.callBoxed(&s);
  SpecPtr out;
  for (auto& v : s) {
    if (!v.isTensor()) {
      stack->push_back(std::move(v));
      continue;
    }
    if (!out) out = plain_output_spec(in, v.toTensor().sizes());
    stack->push_back(wrap(v.toTensor(), out));
  }
}

std::vector<at::Tensor> carried_backward(const char* name, torch::autograd::AutogradContext* ctx,
                                         std::vector<at::Tensor> grads, BackwardFormula formula) {
  std::vector<at::Tensor> out;
  comm::errors::run_as_op(name, [&] { out = formula(ctx, std::move(grads)); });
  return out;
}

}  // namespace shardtensor::ops
