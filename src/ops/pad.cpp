// Padding on sharded dims: pad, _pad_enum, _pad_circular, constant_pad_nd,
// reflection_pad{1,2,3}d, replication_pad{1,2,3}d (F::pad and the
// padding_mode of torch::nn::ConvNd reach these).
//
// Note [sharded pad]: along a sharded dim of extent n padded by (left, right)
// (negative = crop), the output has extent n + left + right, partitioned
// first (stencil::output_sizes); output block [o0, o1) reads the input range
// [o0 - left, o1 - left), which comm::gather_range fills across shards and,
// past the global edges, per the padding mode (reflect and circular reach
// into other shards; circular wraps to the far end of the domain). Unsharded
// padded dims are padded locally with the same mode. Arguments are validated
// by running the op on a meta tensor of the global shape, so users get
// libtorch's own messages, identically on every rank, before any
// communication.
#include <ATen/ATen.h>

#include "ops/stencil.h"

namespace shardtensor::ops {
namespace {

enum class Mode { Constant, Reflect, Replicate, Circular };

// at::padding_mode (ATen/PadNd.h): reflect, replicate, circular, constant.
Mode from_enum(int64_t m) {
  switch (m) {
    case 0:
      return Mode::Reflect;
    case 1:
      return Mode::Replicate;
    case 2:
      return Mode::Circular;
    default:
      return Mode::Constant;
  }
}

PadMode to_pad_mode(Mode m) {
  switch (m) {
    case Mode::Reflect:
      return PadMode::Reflect;
    case Mode::Replicate:
      return PadMode::Replicate;
    case Mode::Circular:
      return PadMode::Circular;
    default:
      return PadMode::Constant;
  }
}

// Local padding of the unsharded dims (pad entries of sharded dims are 0).
at::Tensor local_pad(const at::Tensor& x, const std::vector<int64_t>& pad, Mode mode,
                     double value) {
  bool any = false;
  for (int64_t v : pad) any = any || v != 0;
  if (!any) return x;
  switch (mode) {
    case Mode::Constant:
      return at::constant_pad_nd(x, pad, value);
    case Mode::Reflect:
      return at::_pad_enum(x, pad, 0, c10::nullopt);
    case Mode::Replicate:
      return at::_pad_enum(x, pad, 1, c10::nullopt);
    case Mode::Circular:
      return at::_pad_circular(x, pad);
  }
  return x;
}

void pad_rule(const c10::OperatorHandle& op, Stack* stack) {
  auto args = pop_args(op, stack);
  const std::string& name = op.operator_name().name;
  for (size_t i = 0; i < op.schema().arguments().size(); ++i) {
    const auto* a = op.schema().arguments()[i].alias_info();
    if (a && a->isWrite()) fail(op, args, "out= variants of padding are not supported");
  }
  const at::Tensor& self = args[0].toTensor();
  const ShardSpec* s = spec_of(self);
  if (!s) fail(op, args, "the input must be the ShardTensor");
  const DeviceMesh mesh = s->mesh();
  const std::vector<int64_t> pad = args[1].toIntVector();

  Mode mode = Mode::Constant;
  double value = 0.0;
  if (name == "aten::pad") {
    const std::string m = args[2].toStringRef();
    if (m == "reflect")
      mode = Mode::Reflect;
    else if (m == "replicate")
      mode = Mode::Replicate;
    else if (m == "circular")
      mode = Mode::Circular;
    else if (m != "constant")
      fail(op, args, "unknown padding mode '" + m + "'");
    if (args[3].isDouble()) value = args[3].toDouble();
  } else if (name == "aten::_pad_enum") {
    mode = from_enum(args[2].toInt());
    if (args[3].isDouble()) value = args[3].toDouble();
  } else if (name == "aten::_pad_circular") {
    mode = Mode::Circular;
  } else if (name == "aten::constant_pad_nd") {
    value = args[2].toScalar().toDouble();
  } else if (name.rfind("aten::reflection_pad", 0) == 0) {
    mode = Mode::Reflect;
  } else if (name.rfind("aten::replication_pad", 0) == 0) {
    mode = Mode::Replicate;
  }

  {
    // Note [reduced precision]: libtorch's verdict on the dtype, before any
    // communication (the halo path pads without libtorch's reflect kernels).
    static const char* const names[4] = {"constant pad", "reflection pad", "replication pad",
                                         "circular pad"};
    const int64_t npad = static_cast<int64_t>(pad.size() / 2);
    const std::string family =
        std::string(names[static_cast<int>(mode)]) + " " + std::to_string(npad) + "d";
    if (npad >= 1 && npad <= 3) {
      check_dtype_support(op, args, family.c_str(), {self.scalar_type()}, will_backward(self),
                          [npad, mode, value](c10::ArrayRef<at::ScalarType> t, bool rg) {
                            std::vector<int64_t> shape{1, 1};
                            for (int64_t i = 0; i < npad; ++i) shape.push_back(3);
                            return local_pad(probe_ones(shape, t[0], rg),
                                             std::vector<int64_t>(2 * npad, 1), mode, value);
                          });
    }
  }
  // Validation: the op itself on a meta tensor (libtorch's own messages);
  // ops without a Meta kernel (reflection_pad2d, still in torch 2.13) skip that step.
  // torch 2.x says "...with Meta tensors, but there was no fake impl or Meta kernel".
  try {
    std::vector<c10::IValue> meta_args = args;
    meta_args[0] = at::empty(self.sizes(), self.options().device(at::kMeta));
    Stack st(meta_args.begin(), meta_args.end());
    op.callBoxed(&st);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("'Meta' backend") == std::string::npos &&
        msg.find("with Meta tensors") == std::string::npos) {
      fail(op, args, msg);
    }
  }
  if (pad.size() % 2 != 0 || static_cast<int64_t>(pad.size()) > 2 * self.dim()) {
    fail(op, args, "the pad list must have an even length of at most 2 * dim");
  }
  std::vector<int64_t> out_shape = self.sizes().vec();
  for (size_t j = 0; j < pad.size() / 2; ++j) {
    const int64_t d = self.dim() - 1 - static_cast<int64_t>(j);
    out_shape[d] += pad[2 * j] + pad[2 * j + 1];
    if (out_shape[d] < 0) fail(op, args, "the padding gives a negative output extent");
  }

  // Note [plain fast path]: no padded dim is sharded over more than one rank.
  {
    std::vector<int64_t> lead;
    for (int64_t d = 0; d < self.dim() - static_cast<int64_t>(pad.size()) / 2; ++d)
      lead.push_back(d);
    if (runs_plain(*s, local_of(self), lead)) return call_plain(op, std::move(args), stack);
  }

  // Partial and Shard on the padded dims are kept; Partial is resolved.
  const ShardSpec compute = without_partial(*s);
  std::vector<stencil::DimPlan> plans;
  std::vector<int64_t> local_pads(pad.size(), 0);
  const int64_t npad = static_cast<int64_t>(pad.size()) / 2;
  for (int64_t j = 0; j < npad; ++j) {
    const int64_t d = self.dim() - 1 - j;
    const int64_t left = pad[2 * j], right = pad[2 * j + 1];
    const int64_t m = compute.mesh_dim_of(d);
    if (m < 0) {
      local_pads[2 * j] = left;
      local_pads[2 * j + 1] = right;
      continue;
    }
    if (left == 0 && right == 0) continue;
    const int64_t n = self.size(d);
    if (mode == Mode::Reflect && (left >= n || right >= n)) {
      fail(op, args, "reflect padding must be less than the input extent");
    }
    stencil::DimPlan p;
    p.dim = d;
    p.mesh_dim = m;
    p.in_sizes = compute.shard_sizes(m);
    p.out_sizes = stencil::output_sizes(p.in_sizes, n + left + right);
    p.ranges = stencil::window_ranges(p.out_sizes, 1, 1, 1, left);
    plans.push_back(std::move(p));
  }
  SpecPtr out_spec = stencil::output_spec(compute, out_shape, plans);

  at::Tensor local = to_layout(self, compute, compute);
  // Unsharded dims first (a pure local op), then the halo gather on sharded
  // ones: the gathered halos then already carry the unsharded padding.
  at::Tensor x;
  if (local.numel() == 0) {
    // An empty piece: libtorch's pad kernels reject empty inputs. Build the
    // padded piece by shape (filled with the constant: it is not empty when
    // the padding grows a zero-extent unsharded dim), still connected to
    // `local` so this rank takes part in the backward halo exchange like the
    // others (Note [collective discipline]).
    std::vector<int64_t> shape = local.sizes().vec();
    for (int64_t j = 0; j < npad; ++j) {
      shape[self.dim() - 1 - j] += local_pads[2 * j] + local_pads[2 * j + 1];
    }
    // A constant pad of a zero-extent dim yields pad values, not zeros.
    x = local.new_full(shape, mode == Mode::Constant ? value : 0.0);
    if (local.is_floating_point() || local.is_complex()) x = x + local.sum() * 0;
  } else {
    x = local_pad(local, local_pads, mode, value);
  }
  x = stencil::gather_plans(x, mesh, plans, to_pad_mode(mode), value);
  stack->push_back(wrap(x, out_spec));
}

const RuleRegistrar pad_ops({"pad", "_pad_enum", "_pad_circular", "constant_pad_nd",
                             "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
                             "replication_pad1d", "replication_pad2d", "replication_pad3d"},
                            pad_rule);

}  // namespace
}  // namespace shardtensor::ops
