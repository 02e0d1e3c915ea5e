// Concatenation: cat and stack (stack is CompositeExplicitAutograd in
// libtorch 1.13 and 2.13, with its own derivative on 2.13, so it never
// decomposes before our kernel and needs its own rule: unsqueeze every input,
// then cat).
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include "ops/common.h"

namespace shardtensor::ops {
namespace {

// libtorch's legacy rule: 1-D tensors of size 0 are skipped by cat whatever
// the other inputs' shapes.
bool legacy_empty(const at::Tensor& t) { return t.dim() == 1 && t.size(0) == 0; }

// Note [cat layout]: the result takes the layout of the first input that is
// sharded (or of the first ShardTensor input if none is), the "reference".
// Along a dim the reference does not shard, every input is brought to the
// reference's layout on its own shape (plain inputs are sliced locally,
// ShardTensors in another layout redistributed) and the pieces are
// concatenated locally. Along the dim that the reference shards (by mesh dim
// mm), the result must be globally ordered: input i occupies
// [base_i, base_i + n_i) of the result, which is split balanced-block over mm.
// Inputs sharded along that dim keep their pieces; each coordinate sends its
// runs of global indices to their owners in one comm::repartition. Inputs
// that are replicated along mm (plain tensors included) need no
// communication: each coordinate takes the part that falls in its own block
// (marked with use_replicated so that the gradient is summed over mm,
// Note [replicated gradients]).
at::Tensor cat_impl(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                    const std::vector<at::Tensor>& tensors, int64_t dim_arg) {
  // libtorch's validation, result shape and dtype, on shape-only tensors.
  std::vector<at::Tensor> metas;
  metas.reserve(tensors.size());
  for (const auto& t : tensors) {
    metas.push_back(at::empty(t.sizes(), t.options().device(at::kMeta)));
  }
  const std::vector<int64_t> out_shape = at::cat(metas, dim_arg).sizes().vec();
  const DeviceMesh mesh = common_mesh(op, args);

  const at::Tensor* first = nullptr;  // first input that is not skipped
  const ShardSpec* ref = nullptr;
  for (const auto& t : tensors) {
    if (legacy_empty(t)) continue;
    if (!first) first = &t;
    const ShardSpec* s = spec_of(t);
    if (s && (!ref || (!ref->is_sharded() && s->is_sharded()))) ref = s;
  }
  if (!first) {
    // Every input is skipped: the result is an empty 1-D tensor.
    std::vector<at::Tensor> locals;
    for (const auto& t : tensors) locals.push_back(local_of(t));
    return wrap(at::cat(locals, 0),
                make_spec(mesh, Placements(mesh.ndim(), Replicate{}), out_shape));
  }
  const int64_t dim = at::maybe_wrap_dim(dim_arg, first->dim());
  Placements ref_p(mesh.ndim(), Replicate{});
  ShardSizes ref_sizes(mesh.ndim());
  if (ref) {
    ref_p = ref->placements();
    ref_sizes = ref->all_shard_sizes();
  }
  const int64_t mm = ref ? ref->mesh_dim_of(dim) : -1;

  if (mm < 0) {
    SpecPtr out = make_spec(mesh, ref_p, out_shape, ref_sizes);
    std::vector<at::Tensor> locals;
    for (const auto& t : tensors) {
      if (legacy_empty(t)) {
        locals.push_back(local_of(t));
      } else {
        locals.push_back(to_layout(t, ShardSpec(mesh, ref_p, t.sizes().vec(), ref_sizes), *out));
      }
    }
    return wrap(at::cat(locals, dim), out);
  }

  const int64_t parts = mesh.size(mm);
  const int64_t me = mesh.coordinate()[mm];
  const auto tgt = balanced_sizes(out_shape[dim], parts);
  const auto toff = offsets_of(tgt);
  ShardSizes out_sizes = ref_sizes;
  out_sizes[mm] = tgt;
  SpecPtr out = make_spec(mesh, ref_p, out_shape, out_sizes);

  std::vector<std::vector<comm::Segment>> segments(parts);
  std::vector<at::Tensor> pieces;
  int64_t base = 0;
  for (const auto& t : tensors) {
    if (legacy_empty(t)) {
      pieces.push_back(local_of(t));  // skipped by the local cat; keeps dtype promotion
      continue;
    }
    const int64_t n = t.size(dim);
    const ShardSpec* s = spec_of(t);
    Placements p = ref_p;
    ShardSizes sizes = ref_sizes;
    if (s && !is_replicate(s->placements()[mm])) {
      // Sharded along mm: keep the pieces if already along `dim`, else balanced.
      sizes[mm] = s->mesh_dim_of(dim) == mm ? s->shard_sizes(mm) : balanced_sizes(n, parts);
      const auto off = offsets_of(sizes[mm]);
      for (int64_t c = 0; c < parts; ++c) {
        if (sizes[mm][c] > 0) segments[c].push_back({base + off[c], sizes[mm][c]});
      }
      pieces.push_back(to_layout(t, ShardSpec(mesh, p, t.sizes().vec(), sizes), *out));
    } else {
      // Replicated along mm: every coordinate takes its own part.
      p[mm] = Replicate{};
      sizes[mm] = {};
      at::Tensor local = to_layout(t, ShardSpec(mesh, p, t.sizes().vec(), sizes), *out);
      for (int64_t c = 0; c < parts; ++c) {
        const int64_t lo = std::max(base, toff[c]);
        const int64_t hi = std::min(base + n, toff[c] + tgt[c]);
        if (hi > lo) segments[c].push_back({lo, hi - lo});
        if (c == me)
          pieces.push_back(
              local.narrow(dim, hi > lo ? lo - base : 0, std::max<int64_t>(hi - lo, 0)));
      }
    }
    base += n;
  }
  at::Tensor local = at::cat(pieces, dim);
  return wrap(comm::repartition(local, mesh, mm, dim, segments, tgt), out);
}

void cat_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.schema().overload_name().empty()) {
    fail(op, args, "only cat(tensors, dim) is supported (no out= or named variants)");
  }
  const auto tensors = args[0].toTensorVector();
  stack->push_back(cat_impl(op, args, tensors, args[1].toInt()));
}

void stack_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  if (!op.schema().overload_name().empty()) {
    fail(op, args, "only stack(tensors, dim) is supported (no out= variant)");
  }
  const auto tensors = args[0].toTensorVector();
  TORCH_CHECK(!tensors.empty(), "stack expects a non-empty TensorList");
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), tensors[0].dim() + 1);
  for (size_t i = 1; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].sizes() == tensors[0].sizes(),
                "stack expects each tensor to be equal size, but got ", tensors[0].sizes(),
                " at entry 0 and ", tensors[i].sizes(), " at entry ", i);
  }
  std::vector<at::Tensor> unsqueezed;
  for (const auto& t : tensors) {
    const ShardSpec* s = spec_of(t);
    if (!s) {
      unsqueezed.push_back(t.unsqueeze(dim));
      continue;
    }
    Placements p = s->placements();
    for (auto& pl : p) {
      if (is_shard(pl) && shard_dim(pl) >= dim) pl = Shard{shard_dim(pl) + 1};
    }
    std::vector<int64_t> shape = s->global_shape();
    shape.insert(shape.begin() + dim, 1);
    unsqueezed.push_back(
        wrap(local_of(t).unsqueeze(dim), make_spec(s->mesh(), p, shape, s->all_shard_sizes())));
  }
  stack->push_back(cat_impl(op, args, unsqueezed, dim));
}

const RuleRegistrar cat_ops({"cat"}, cat_rule);
const RuleRegistrar stack_ops({"stack", "_stack"}, stack_rule);

}  // namespace
}  // namespace shardtensor::ops
