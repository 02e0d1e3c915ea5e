// The distributed FFT (pencil decomposition): rules for aten::_fft_r2c,
// aten::_fft_c2r and aten::_fft_c2c, which every torch::fft function reaches
// (fft_rfft2, fft_irfftn, ... are CompositeImplicitAutograd: they arrive at the
// dispatcher whole, have no rule, and decompose into these, after resizing the
// input for s=/n= with constant_pad_nd/slice, whose rules handle sharded dims).
// Intercepting at this level keeps one implementation for the whole family and
// leaves argument handling (norm strings, s=, n=, hfft's conj) to libtorch.
//
// Note [fft pencil]: a transform over dims T runs in stages. A stage transforms,
// with the libtorch op on the local piece, every dim of T that no mesh dim
// shards. A dim d of T sharded by mesh dim m is made local by one
// comm::all_to_all over m, Shard(d) -> Shard(e), where e is a free dim chosen as
// described in Note [fft layout] (include/shardtensor/ops/fft.h). r2c transforms
// its halved (last) dim in the first stage and c2r in the last, as the
// separable multi-dim transforms do; every other stage is a c2c. A norm mode
// (none, 1/sqrt(n), 1/n) is a product over dims, so normalizing each stage by
// its own dims gives exactly the whole transform's normalization. Everything is
// a libtorch op or a differentiable comm primitive, so autograd is free.
#include <shardtensor/ops/fft.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>

#include "comm/settings.h"
#include "core/settings.h"
#include "ops/common.h"

namespace shardtensor {
// Held in the registry of Note [agreed settings] (core/settings.h), which spells the values.
static_assert(static_cast<int>(FftLayout::Spectral) == 0 &&
              static_cast<int>(FftLayout::Input) == 1);
void set_fft_layout(FftLayout layout) {
  detail::store_setting(Setting::FftLayout, static_cast<int64_t>(layout));
}
FftLayout fft_layout() { return static_cast<FftLayout>(detail::setting_value(Setting::FftLayout)); }

namespace ops {
namespace {

enum class Kind { R2C, C2R, C2C };

// A local piece and its layout, updated stage by stage.
struct Pencil {
  at::Tensor local;
  DeviceMesh mesh;
  Placements place;
  ShardSizes sizes;
  std::vector<int64_t> shape;

  int64_t nd() const { return static_cast<int64_t>(shape.size()); }
  // The mesh dim that shards tensor dim d, or -1. A mesh dim of one
  // coordinate holds the whole extent: it counts as not sharding.
  int64_t mesh_dim_of(int64_t d) const {
    for (int64_t m = 0; m < static_cast<int64_t>(place.size()); ++m) {
      if (is_shard(place[m]) && shard_dim(place[m]) == d && mesh.size(m) > 1) return m;
    }
    return -1;
  }
  bool free(int64_t d) const { return mesh_dim_of(d) < 0; }
};

struct Swap {
  int64_t mesh_dim = 0, from = 0, to = 0;
  std::vector<int64_t> from_sizes;  // the split of `from` before the swap
  int64_t from_extent = 0;          // its global extent then
};

// The swap target for tensor dim d sharded by mesh dim m (Note [fft layout]):
// -1 if no dim is free. `avoid` is never chosen (c2r's last dim).
int64_t pick_target(const Pencil& p, int64_t d, int64_t m, const std::set<int64_t>& T,
                    const std::set<int64_t>& done, int64_t avoid) {
  int64_t best = -1, best_rank = -1, best_extent = -1;
  const int64_t parts = p.mesh.size(m);
  for (int64_t e = 0; e < p.nd(); ++e) {
    if (e == d || e == avoid || !p.free(e)) continue;
    int64_t rank = 0;
    if (done.count(e)) {
      rank = 3;
    } else if (!T.count(e) && p.shape[e] >= parts) {
      rank = 2;
    } else if (T.count(e)) {
      rank = 1;
    }
    if (rank > best_rank || (rank == best_rank && p.shape[e] > best_extent)) {
      best = e;
      best_rank = rank;
      best_extent = p.shape[e];
    }
  }
  return best;
}

// Validated plan, computed from metadata only so that every rank agrees and a
// bad layout throws everywhere before any communication.
struct Step {
  bool swap = false;
  Swap s;                     // when swap
  std::vector<int64_t> dims;  // when a transform
  Kind kind = Kind::C2C;
};

// One all-to-all over s.mesh_dim: Shard(s.from) -> Shard(s.to) (balanced).
void do_swap(Pencil& p, const Swap& s, const std::vector<int64_t>& to_sizes) {
  const int64_t m = s.mesh_dim;
  p.local = comm::all_to_all(p.local, p.mesh, m, s.from, p.sizes[m], s.to, to_sizes);
  p.place[m] = Shard{s.to};
  p.sizes[m] = to_sizes;
}

// The libtorch transform of one stage on the local piece. An empty piece
// still gets an output of the right shape connected to the input, so that
// autograd runs the same collectives on every rank in backward.
at::Tensor local_transform(const at::Tensor& x, Kind kind, const std::vector<int64_t>& dims,
                           int64_t norm, bool flag, int64_t last_dim_size) {
  if (x.numel() == 0) {
    std::vector<int64_t> shape = x.sizes().vec();
    at::ScalarType dt = x.scalar_type();
    if (kind == Kind::R2C) {
      if (flag) shape[dims.back()] = shape[dims.back()] / 2 + 1;
      dt = c10::toComplexType(dt);
    } else if (kind == Kind::C2R) {
      shape[dims.back()] = last_dim_size;
      dt = c10::toRealValueType(dt);
    }
    at::Tensor z = at::zeros(shape, x.options().dtype(dt));
    at::Tensor tie = x.sum() * 0;
    if (tie.is_complex() && !z.is_complex()) tie = at::real(tie);
    return z + tie;
  }
  switch (kind) {
    case Kind::R2C:
      return at::_fft_r2c(x, dims, norm, flag);
    case Kind::C2R:
      return at::_fft_c2r(x, dims, norm, last_dim_size);
    case Kind::C2C:
      break;
  }
  return at::_fft_c2c(x, dims, norm, flag);
}

// _fft_r2c(self, dim, normalization, onesided)
// _fft_c2r(self, dim, normalization, last_dim_size)
// _fft_c2c(self, dim, normalization, forward)
void fft_rule(const c10::OperatorHandle& op, Stack* stack, Kind kind) {
  if (!op.operator_name().overload_name.empty()) {
    auto args = pop_args(op, stack);
    fail(op, args, "the out= form of the FFT has no sharding rule (use the functional form)");
  }
  auto args = pop_args(op, stack);
  const at::Tensor& x = args[0].toTensor();
  const ShardSpec* spec = spec_of(x);
  if (!spec) fail(op, args, "the input must be the ShardTensor");
  const int64_t nd = spec->ndim();
  std::vector<int64_t> dims;
  std::set<int64_t> T;
  for (int64_t d : args[1].toIntVector()) {
    int64_t w = d;
    try {
      w = c10::maybe_wrap_dim(d, nd);
    } catch (const c10::Error& e) {
      fail(op, args, e.what_without_backtrace());
    }
    if (!T.insert(w).second) fail(op, args, "a dim is transformed twice");
    dims.push_back(w);
  }
  if (dims.empty()) fail(op, args, "no dims to transform");
  const int64_t norm = args[2].toInt();
  const bool flag = kind == Kind::C2R ? false : args[3].toBool();
  const int64_t last_dim_size = kind == Kind::C2R ? args[3].toInt() : 0;
  const bool is_complex = at::isComplexType(x.scalar_type());
  if (kind == Kind::R2C && is_complex) fail(op, args, "r2c expects a real input");
  if (kind != Kind::R2C && !is_complex) fail(op, args, "c2c/c2r expect a complex input");
  if (kind == Kind::C2R && last_dim_size < 1) fail(op, args, "last_dim_size must be positive");

  Pencil p;
  p.mesh = spec->mesh();
  p.place = spec->placements();
  p.shape = spec->global_shape();
  for (int64_t m = 0; m < p.mesh.ndim(); ++m) p.sizes.push_back(spec->shard_sizes(m));
  for (int64_t d : dims) {
    if (p.shape[d] == 0) fail(op, args, "cannot transform a dim of extent 0");
  }

  // ---- plan (metadata only) ----
  const int64_t last = dims.back();
  std::vector<Step> plan;
  std::vector<Swap> swaps;
  std::set<int64_t> done;
  Pencil q = p;  // the planning copy (no local data)
  auto plan_swap = [&](int64_t d, int64_t avoid) {
    const int64_t m = q.mesh_dim_of(d);
    const int64_t e = pick_target(q, d, m, T, done, avoid);
    if (e < 0) {
      fail(op, args,
           "every dim of the tensor is sharded or transformed, so no all-to-all can make dim " +
               std::to_string(d) +
               " local (redistribute first, or add a batch dim); transformed dims " +
               shape_str(dims));
    }
    Step st;
    st.swap = true;
    st.s = Swap{m, d, e, q.sizes[m], q.shape[d]};
    plan.push_back(st);
    swaps.push_back(st.s);
    q.place[m] = Shard{e};
    q.sizes[m] = balanced_sizes(q.shape[e], q.mesh.size(m));
  };
  auto plan_transform = [&](std::vector<int64_t> ds, Kind k) {
    Step st;
    st.dims = std::move(ds);
    st.kind = k;
    for (int64_t d : st.dims) done.insert(d);
    if (k == Kind::R2C && flag) q.shape[st.dims.back()] = q.shape[st.dims.back()] / 2 + 1;
    if (k == Kind::C2R) q.shape[st.dims.back()] = last_dim_size;
    plan.push_back(std::move(st));
  };
  // Transforms every pending dim of T (except `except`) that is free, then
  // swaps the next sharded one in, until all are done.
  auto plan_c2c = [&](int64_t except, int64_t avoid) {
    while (true) {
      std::vector<int64_t> ready;
      int64_t pending = -1;
      for (int64_t d : dims) {
        if (d == except || done.count(d)) continue;
        if (q.free(d)) {
          ready.push_back(d);
        } else if (pending < 0) {
          pending = d;
        }
      }
      if (!ready.empty()) {
        plan_transform(ready, Kind::C2C);
      } else if (pending >= 0) {
        plan_swap(pending, avoid);
      } else {
        break;
      }
    }
  };
  if (kind == Kind::R2C) {
    if (!q.free(last)) plan_swap(last, -1);
    std::vector<int64_t> first;
    for (int64_t d : dims) {
      if (d != last && q.free(d)) first.push_back(d);
    }
    first.push_back(last);
    plan_transform(first, Kind::R2C);
    plan_c2c(-1, -1);
  } else if (kind == Kind::C2C) {
    plan_c2c(-1, -1);
  } else {
    plan_c2c(last, last);
    if (!q.free(last)) plan_swap(last, -1);
    plan_transform({last}, Kind::C2R);
  }
  // Note [agreed settings]: every rank has planned alike; nothing sent yet.
  const bool back =
      comm::use_setting(p.mesh, Setting::FftLayout) == static_cast<int64_t>(FftLayout::Input);

  // ---- run ----
  p.local = local_of(x).resolve_conj();  // hfft passes a conj view
  for (const Step& st : plan) {
    if (st.swap) {
      do_swap(p, st.s, balanced_sizes(p.shape[st.s.to], p.mesh.size(st.s.mesh_dim)));
      continue;
    }
    Kind k = st.kind;
    bool f = flag;
    if (k == Kind::C2C && kind == Kind::R2C) f = true;   // later stages of a forward r2c
    if (k == Kind::C2C && kind == Kind::C2R) f = false;  // earlier stages of an inverse c2r
    p.local = local_transform(p.local, k, st.dims, norm, f, last_dim_size);
    if (k == Kind::R2C && flag) p.shape[st.dims.back()] = p.shape[st.dims.back()] / 2 + 1;
    if (k == Kind::C2R) p.shape[st.dims.back()] = last_dim_size;
  }
  if (back) {
    for (auto it = swaps.rbegin(); it != swaps.rend(); ++it) {
      const int64_t m = it->mesh_dim;
      Swap undo{m, it->to, it->from, p.sizes[m], p.shape[it->to]};
      std::vector<int64_t> to_sizes = p.shape[it->from] == it->from_extent
                                          ? it->from_sizes
                                          : balanced_sizes(p.shape[it->from], p.mesh.size(m));
      do_swap(p, undo, to_sizes);
    }
  }
  for (int64_t m = 0; m < p.mesh.ndim(); ++m) {
    if (is_shard(p.place[m]) && p.mesh.size(m) == 1) p.sizes[m] = {p.shape[shard_dim(p.place[m])]};
  }
  stack->push_back(wrap(p.local, make_spec(p.mesh, p.place, p.shape, p.sizes)));
}

const RuleRegistrar r_r2c({"_fft_r2c"}, [](const c10::OperatorHandle& op, Stack* s) {
  fft_rule(op, s, Kind::R2C);
});
const RuleRegistrar r_c2r({"_fft_c2r"}, [](const c10::OperatorHandle& op, Stack* s) {
  fft_rule(op, s, Kind::C2R);
});
const RuleRegistrar r_c2c({"_fft_c2c"}, [](const c10::OperatorHandle& op, Stack* s) {
  fft_rule(op, s, Kind::C2C);
});

}  // namespace
}  // namespace ops
}  // namespace shardtensor
