#include "tensor/shard_tensor_impl.h"

#include "comm/plain.h"

#include <ATen/ATen.h>
#include <shardtensor/comm/primitives.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <sstream>

namespace shardtensor {
namespace detail {

namespace {
// Note [autocast and ShardTensors]: libtorch gives the AutocastCPU key only
// to tensors with the CPU backend bit, which a ShardTensor (PrivateUse1) does
// not have. Without it, an op whose arguments are all ShardTensors would skip
// autocast's wrapper, and its rule's local ops would then be cast one by one
// by the still-enabled autocast. With it (for CPU pieces) every op sees the
// same autocast policy as on plain tensors: the wrapper casts the arguments,
// ShardTensors included (autocast's eligibility test is device-based, and the
// cast is the ShardTensor's own `to` rule), and runs the rule with autocast
// off, as libtorch's kernels run. The key is masked out unless autocast is
// enabled, so it costs nothing otherwise.
c10::DispatchKeySet shard_keys(const at::Tensor& local) {
  c10::DispatchKeySet ks({c10::DispatchKey::PrivateUse1, c10::DispatchKey::AutogradPrivateUse1});
  if (local.device().is_cpu()) ks = ks | c10::DispatchKeySet(c10::DispatchKey::AutocastCPU);
  return ks;
}
}  // namespace

ShardTensorImpl::ShardTensorImpl(at::Tensor local, std::shared_ptr<const ShardSpec> spec)
    : c10::TensorImpl(shard_keys(local), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  set_sizes_contiguous(spec_->global_shape());
}

c10::intrusive_ptr<c10::TensorImpl> ShardTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<ShardTensorImpl>(local_.detach(), spec_);
  impl->set_global_strides(strides());  // Note [wrapper strides]
  impl->set_version_counter(version_counter);
  impl->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> ShardTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<ShardTensorImpl>(local_.detach(), spec_);
  impl->set_global_strides(strides());  // Note [wrapper strides]
  impl->set_version_counter(std::move(version_counter));
  impl->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  return impl;
}

void ShardTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  auto* other = dynamic_cast<ShardTensorImpl*>(impl.get());
  TORCH_CHECK(other != nullptr, "ShardTensor: cannot set_data() from a plain tensor");
  local_ = other->local_;
  spec_ = other->spec_;
  set_sizes_contiguous(spec_->global_shape());
  set_global_strides(other->strides());  // Note [wrapper strides]
  data_type_ = other->data_type_;
}

void ShardTensorImpl::set_global_strides(c10::IntArrayRef strides) {
  TORCH_CHECK(static_cast<int64_t>(strides.size()) == dim(), "ShardTensor: ", strides.size(),
              " strides for a tensor of ", dim(), " dims");
  // Not set_sizes_and_strides: that refuses tensors made by detach(), whose
  // metadata a view rule (squeeze_, t_) may still change.
  sizes_and_strides_.set_strides(strides);
  refresh_contiguous();
}

ShardTensorImpl* shard_impl(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  return dynamic_cast<ShardTensorImpl*>(t.unsafeGetTensorImpl());
}

int64_t alias_version(const at::Tensor& t) {
  const auto* impl = shard_impl(t);
  if (impl == nullptr) return 0;
  const auto& vc = impl->version_counter();
  int64_t v = vc.enabled() ? static_cast<int64_t>(vc.current_version()) : 0;
  const auto& wb = impl->write_back();
  if (wb && wb->refreshes) v += *wb->refreshes;
  return v;
}

void bump_alias_version(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (impl != nullptr && impl->version_counter().enabled()) impl->bump_version();
}

void refresh_copy_view(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  if (impl && impl->write_back() && impl->write_back()->refresh) impl->write_back()->refresh(t);
}

bool stale_copy_view(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  return impl && impl->write_back() && impl->write_back()->stale && impl->write_back()->stale(t);
}

at::Tensor make_shard_tensor(at::Tensor local, std::shared_ptr<const ShardSpec> spec) {
  TORCH_CHECK(local.defined(), "ShardTensor: the local tensor is undefined");
  TORCH_CHECK(!shard_impl(local), "ShardTensor: the local tensor is itself a ShardTensor");
  TORCH_CHECK(local.sizes().vec() == spec->local_shape(), "ShardTensor: local shape ",
              local.sizes(), " does not match ", spec->to_string(), " whose local shape here is ",
              c10::IntArrayRef(spec->local_shape()));
  // Note [no lazy bits in pieces]: the transport moves raw bytes, so a piece
  // must not carry libtorch's lazy conjugate / negative bits (ihfft's result is
  // a conj view): resolve them here, once, where every piece is wrapped.
  if (local.is_conj()) local = local.resolve_conj();
  if (local.is_neg()) local = local.resolve_neg();
  const bool grad = local.requires_grad();
  at::Tensor t = at::detail::make_tensor<ShardTensorImpl>(std::move(local), std::move(spec));
  if (grad) mirror_requires_grad(t);
  return t;
}

at::Tensor local_slice(const at::Tensor& full, const ShardSpec& spec) {
  TORCH_CHECK(full.sizes().vec() == spec.global_shape(), "local_slice: tensor of shape ",
              full.sizes(), " does not match ", spec.to_string());
  at::Tensor out = full;
  const auto shape = spec.local_shape();
  const auto offs = spec.local_offsets();
  for (int64_t d = 0; d < spec.ndim(); ++d) {
    if (spec.mesh_dim_of(d) >= 0) {
      out = out.narrow(d, offs[d], shape[d]);
    }
  }
  return out;
}

namespace {

bool valid_placements(const Placements& p, int64_t ndim) {
  std::vector<int> count(ndim, 0);
  for (const auto& pl : p) {
    if (is_shard(pl) && ++count[shard_dim(pl)] > 1) return false;
  }
  return true;
}

// One mesh dim's transition; `cur` and `cur_sizes` are updated.
at::Tensor transition(const at::Tensor& local, const DeviceMesh& mesh, int64_t m, Placements& cur,
                      ShardSizes& cur_sizes, const Placement& to,
                      const std::vector<int64_t>& to_sizes) {
  const Placement from = cur[m];
  at::Tensor out;
  if (is_shard(from) && is_replicate(to)) {
    out = comm::all_gather(local, mesh, m, shard_dim(from), cur_sizes[m]);
  } else if (is_shard(from) && is_shard(to)) {
    out = comm::all_to_all(local, mesh, m, shard_dim(from), cur_sizes[m], shard_dim(to), to_sizes);
  } else if (is_replicate(from) && is_shard(to)) {
    out = comm::shard_slice(local, mesh, m, shard_dim(to), to_sizes);
  } else if (is_replicate(from) && is_partial(to)) {
    out = comm::replicate_to_partial(local, mesh, m);
  } else if (is_partial(from) && is_replicate(to)) {
    out = comm::all_reduce(local, mesh, {m});
  } else if (is_partial(from) && is_shard(to)) {
    out = comm::reduce_scatter(local, mesh, m, shard_dim(to), to_sizes);
  } else {
    TORCH_CHECK(false, "redistribute: cannot go from ", to_string(from), " to ", to_string(to),
                " on mesh dim ", m, " (Shard -> Partial is not supported)");
  }
  cur[m] = to;
  cur_sizes[m] = is_shard(to) ? to_sizes : std::vector<int64_t>{};
  return out;
}

// Note [shard-dim swap]
// ~~~~~~~~~~~~~~~~~~~~~
// A redistribution whose pending mesh dims all move Shard(a) -> Shard(b)
// with each target dim held by another pending mesh dim (a cycle: on a 2x2
// mesh [S0, S1] -> [S1, S0]; on a 3-D mesh [S0, S1, S2] -> [S1, S2, S0])
// has no valid single-mesh-dim step: any one of them would shard a tensor
// dim twice. Such a cycle used to go through Replicate on one mesh dim (an
// all-gather, a visible gather refused in strict mode). It is now one direct
// exchange over the cycle's mesh dims (comm::box_exchange, Note [box
// exchange]): with the other mesh dims' coordinates fixed, every coordinate
// of the cycle's mesh dims holds the box given by the current placements and
// sizes and gets the box given by the target ones, and sends each peer the
// intersection of the two. Cost per rank: it sends its piece less what it
// keeps (at most the piece; for [S0, S1] -> [S1, S0] with even splits on a
// 2x2 mesh, the whole piece off the diagonal and nothing on it) and receives
// at most its new piece, in one all-to-allv over the cycle's mesh dims, with
// no tensor larger than a piece. Through Replicate it was an all-gather (the
// piece to each of the mesh dim's peers, and a tensor that many times larger)
// followed by an all-to-all. Measured (ShardDimSwapSendsAtMostThePiece in
// tests/test_tensor.cpp), [64, 64, 64] float32 [S0, S1] -> [S1, S0] on 2x2:
// 262144 bytes sent by each off-diagonal rank and 0 by the diagonal ones,
// against 524288 bytes sent by every rank through Replicate (which also
// counted 262144 gathered bytes per rank). Not a gather: nothing is counted
// in gathered_bytes, and strict mode allows it. Backward: the inverse exchange.
// Transitions that are valid on their own (e.g. a Replicate -> Shard slice)
// run first, one mesh dim at a time, as before, except gathers (Shard ->
// Replicate) that no later step waits for: they run after the exchange, so
// that it moves pieces rather than gathered blocks (on a 3-D mesh,
// [S0, S1, S2] -> [S1, S0, R] swaps, then gathers dim 2).
at::Tensor swap_shard_dims(const at::Tensor& local, const DeviceMesh& mesh,
                           const std::vector<int64_t>& cycle, Placements& cur,
                           ShardSizes& cur_sizes, const ShardSpec& dst) {
  const auto& shape = dst.global_shape();
  const int64_t ndim = static_cast<int64_t>(shape.size());
  // The box of the rank at `coord` under (placements, sizes).
  auto box_at = [&](const Placements& pl, const ShardSizes& sizes,
                    const std::vector<int64_t>& coord) {
    comm::Box box(ndim);
    for (int64_t d = 0; d < ndim; ++d) box[d] = comm::Segment{0, shape[d]};
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      if (!is_shard(pl[m])) continue;
      const int64_t d = shard_dim(pl[m]);
      const auto off = offsets_of(sizes[m]);
      box[d] = comm::Segment{off[coord[m]], sizes[m][coord[m]]};
    }
    return box;
  };
  Placements to = cur;
  ShardSizes to_sizes = cur_sizes;
  int64_t P = 1;
  for (int64_t m : cycle) {
    to[m] = dst.placements()[m];
    to_sizes[m] = dst.shard_sizes(m);
    P *= mesh.size(m);
  }
  // Coordinates of the cycle's mesh dims, row-major over them (ascending),
  // mine on the other mesh dims.
  std::vector<comm::Box> src_boxes, dst_boxes;
  for (int64_t c = 0; c < P; ++c) {
    std::vector<int64_t> coord = mesh.coordinate();
    int64_t rest = c;
    for (auto it = cycle.rbegin(); it != cycle.rend(); ++it) {
      coord[*it] = rest % mesh.size(*it);
      rest /= mesh.size(*it);
    }
    src_boxes.push_back(box_at(cur, cur_sizes, coord));
    dst_boxes.push_back(box_at(to, to_sizes, coord));
  }
  at::Tensor out = comm::box_exchange(local, mesh, cycle, src_boxes, dst_boxes);
  cur = std::move(to);
  cur_sizes = std::move(to_sizes);
  return out;
}

}  // namespace

namespace {
at::Tensor redistribute_piece(const at::Tensor& local, const ShardSpec& src, const ShardSpec& dst);
}  // namespace

at::Tensor redistribute_local(const at::Tensor& local_in, const ShardSpec& src,
                              const ShardSpec& dst) {
  // libtorch's ZeroTensor (at::_efficientzerotensor: sgn's or norm(p=0)'s
  // gradient, ...) has no storage, so no data pointer for the transport: every
  // rank materialises its own piece (clone keeps the autograd history) and
  // takes part in the communication as usual. Without history the result is a
  // ZeroTensor again, so that autograd still sees "no gradient" where libtorch
  // does (x.norm(0).backward() leaves x.grad None).
  if (!local_in._is_zerotensor()) return redistribute_piece(local_in, src, dst);
  at::Tensor out = redistribute_piece(local_in.clone(), src, dst);
  if (local_in.requires_grad()) return out;
  return at::_efficientzerotensor(out.sizes(), out.options());
}

namespace {
at::Tensor redistribute_piece(const at::Tensor& local, const ShardSpec& src, const ShardSpec& dst) {
  TORCH_CHECK(src.mesh() == dst.mesh(), "redistribute: the meshes differ: ", src.to_string(),
              " vs ", dst.to_string());
  TORCH_CHECK(src.global_shape() == dst.global_shape(),
              "redistribute: global shapes differ: ", src.to_string(), " vs ", dst.to_string());
  const DeviceMesh& mesh = src.mesh();
  const int64_t nd = mesh.ndim();
  // Reject Shard -> Partial up front, before any communication.
  for (int64_t m = 0; m < nd; ++m) {
    TORCH_CHECK(!(is_shard(src.placements()[m]) && is_partial(dst.placements()[m])),
                "redistribute: Shard -> Partial is not supported (mesh dim ", m, "): from ",
                src.to_string(), " to ", dst.to_string());
  }
  Placements cur = src.placements();
  ShardSizes cur_sizes = src.all_shard_sizes();
  std::vector<int64_t> pending;
  for (int64_t m = 0; m < nd; ++m) {
    if (!(cur[m] == dst.placements()[m]) || cur_sizes[m] != dst.shard_sizes(m)) {
      pending.push_back(m);
    }
  }
  // Plan the transitions on metadata first: apply transitions whose
  // intermediate layout is valid (no tensor dim sharded twice), one mesh dim
  // at a time; when none is, the pending mesh dims form cycles of
  // Shard -> Shard transitions, done together by one box exchange (Note
  // [shard-dim swap]).
  struct Step {
    int64_t m;
    Placement to;
    std::vector<int64_t> sizes;
  };
  std::vector<Step> steps;
  std::vector<int64_t> cycle;  // mesh dims left for the box exchange (ascending)
  {
    Placements sim = cur;
    while (!pending.empty()) {
      bool progressed = false;
      for (auto it = pending.begin(); it != pending.end();) {
        const int64_t m = *it;
        Placements trial = sim;
        trial[m] = dst.placements()[m];
        if (valid_placements(trial, src.ndim())) {
          steps.push_back({m, dst.placements()[m], dst.shard_sizes(m)});
          sim = trial;
          it = pending.erase(it);
          progressed = true;
        } else {
          ++it;
        }
      }
      if (!progressed) {
        for (int64_t m : pending) {
          TORCH_INTERNAL_ASSERT(is_shard(sim[m]) && is_shard(dst.placements()[m]),
                                "redistribute: a blocked transition on mesh dim ", m,
                                " is not Shard -> Shard (from ", src.to_string(), " to ",
                                dst.to_string(), ")");
        }
        cycle = pending;
        pending.clear();
      }
    }
  }
  // With a cycle, a gather (Shard(d) -> Replicate; each mesh dim steps at
  // most once) that no later step needs (none shards d) runs after the
  // exchange, so that the exchange moves pieces, not gathered blocks.
  std::vector<Step> after;
  if (!cycle.empty()) {
    std::vector<Step> before;
    for (size_t i = 0; i < steps.size(); ++i) {
      const Placement& from = src.placements()[steps[i].m];
      bool deferred = false;
      if (is_shard(from) && is_replicate(steps[i].to)) {
        deferred = std::none_of(steps.begin() + i + 1, steps.end(), [&](const Step& later) {
          return is_shard(later.to) && shard_dim(later.to) == shard_dim(from);
        });
      }
      (deferred ? after : before).push_back(steps[i]);
    }
    steps = std::move(before);
  }
  at::Tensor out = local;
  for (const auto& st : steps) {
    out = transition(out, mesh, st.m, cur, cur_sizes, st.to, st.sizes);
  }
  if (!cycle.empty()) {
    out = swap_shard_dims(out, mesh, cycle, cur, cur_sizes, dst);
  }
  for (const auto& st : after) {
    out = transition(out, mesh, st.m, cur, cur_sizes, st.to, st.sizes);
  }
  return out;
}
}  // namespace

}  // namespace detail

// ---------------------------------------------------------------- ShardTensor

ShardTensor::ShardTensor(at::Tensor t) : at::Tensor(std::move(t)) {
  TORCH_CHECK(!defined() || detail::shard_impl(*this) != nullptr,
              "ShardTensor: the tensor is not a ShardTensor (sizes ", sizes(), ")");
}

bool ShardTensor::is_shard_tensor(const at::Tensor& t) { return detail::shard_impl(t) != nullptr; }

const at::Tensor& ShardTensor::local() const {
  auto* impl = detail::shard_impl(*this);
  TORCH_CHECK(impl, "ShardTensor::local(): undefined ShardTensor");
  // Note [stale copy views]: local() never communicates, so it cannot make a
  // stale copy anew; its old values would be a silently wrong answer.
  TORCH_CHECK(!detail::stale_copy_view(*this), "ShardTensor::local(): this ", spec().to_string(),
              " is a copy (libtorch's result would be a view) and its source was written after "
              "it was made, so its piece holds old values (Note [stale copy views]). Any op "
              "brings it up to date (collective, on every rank): use x.clone().local() (Python: "
              "x.clone().to_local()), or take the view again");
  return impl->local();
}

const ShardSpec& ShardTensor::spec() const { return *spec_ptr(); }

std::shared_ptr<const ShardSpec> ShardTensor::spec_ptr() const {
  auto* impl = detail::shard_impl(*this);
  TORCH_CHECK(impl, "ShardTensor::spec(): undefined ShardTensor");
  return impl->spec();
}

ShardTensor ShardTensor::from_local_unchecked(at::Tensor local,
                                              std::shared_ptr<const ShardSpec> spec) {
  return ShardTensor(detail::make_shard_tensor(std::move(local), std::move(spec)));
}

at::Tensor ShardTensor::full_tensor() const {
  detail::refresh_copy_view(*this);  // Note [stale copy views]
  const ShardSpec& s = spec();
  ShardSpec dst(s.mesh(), Placements(s.mesh().ndim(), Replicate{}), s.global_shape());
  return detail::redistribute_local(local(), s, dst);
}

at::Tensor ShardTensor::redistribute(Placements placements, std::optional<ShardSizes> sizes) const {
  const ShardSpec& s = spec();
  auto dst = std::make_shared<const ShardSpec>(s.mesh(), std::move(placements), s.global_shape(),
                                               std::move(sizes));
  if (*dst == s) return *this;
  detail::refresh_copy_view(*this);  // Note [stale copy views]
  return from_local_unchecked(detail::redistribute_local(local(), s, *dst), dst);
}

namespace {

// The spec of the gradient of a value laid out as `s`: every summand of a
// Partial value receives the whole gradient (Note [replicated gradients]), so
// the gradient is Replicate on those mesh dims.
std::shared_ptr<const ShardSpec> gradient_spec(const std::shared_ptr<const ShardSpec>& s) {
  if (!s->has_partial()) return s;
  Placements p = s->placements();
  for (auto& pl : p) {
    if (is_partial(pl)) pl = Replicate{};
  }
  return std::make_shared<const ShardSpec>(s->mesh(), p, s->global_shape(), s->all_shard_sizes());
}

}  // namespace

ShardTensor ShardTensor::grad() const {
  const at::Tensor& g = local().grad();
  if (!g.defined()) return ShardTensor();
  return from_local_unchecked(g, gradient_spec(spec_ptr()));
}

bool ShardTensor::requires_grad() const { return local().requires_grad(); }

std::string ShardTensor::to_string() const {
  if (!defined()) return "ShardTensor(undefined)";
  std::ostringstream os;
  os << "ShardTensor(global=" << sizes() << ", placements=" << shardtensor::to_string(placements())
     << ", local=" << local().sizes() << ", dtype=" << scalar_type() << ", mesh=" << mesh() << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const ShardTensor& t) {
  os << t.to_string();
  if (t.defined()) os << "\nlocal values:\n" << t.local();
  return os;
}

// ---------------------------------------------------------------- factories

namespace {

constexpr int64_t kMaxDims = 16;

// Local metadata record exchanged by from_local / scatter_tensor:
// [ok, ndim, dtype, requires_grad, shape[0..kMaxDims)].
constexpr int64_t kMetaHeader = 4;

std::vector<int64_t> meta_of(const at::Tensor& t) {
  std::vector<int64_t> m(kMetaHeader + kMaxDims, 0);
  const bool ok = t.defined() && !ShardTensor::is_shard_tensor(t) && t.dim() <= kMaxDims &&
                  t.layout() == at::kStrided;
  m[0] = ok ? 1 : 0;
  if (ok) {
    m[1] = t.dim();
    m[2] = static_cast<int64_t>(t.scalar_type());
    m[3] = t.requires_grad() ? 1 : 0;
    for (int64_t d = 0; d < t.dim(); ++d) m[kMetaHeader + d] = t.size(d);
  }
  return m;
}

std::vector<int64_t> shape_of(const int64_t* meta) {
  return std::vector<int64_t>(meta + kMetaHeader, meta + kMetaHeader + meta[1]);
}

}  // namespace

at::Tensor ShardTensor::from_local(at::Tensor local, DeviceMesh mesh, Placements placements,
                                   std::optional<ShardSizes> sizes) {
  TORCH_CHECK(mesh.defined(), "from_local: the mesh is undefined");
  // Every rank learns every rank's local shape, so that every rank reaches the
  // same verdict (Note [collective discipline]).
  const int64_t p = mesh.size();
  const int64_t rec = kMetaHeader + kMaxDims;
  auto mine = at::tensor(meta_of(local), at::kLong);
  auto all = at::empty({p * rec}, at::kLong);
  comm::all_gather_same(mine, all, mesh);
  const int64_t* meta = all.data_ptr<int64_t>();
  for (int64_t r = 0; r < p; ++r) {
    TORCH_CHECK(meta[r * rec] == 1, "from_local: the local tensor on mesh rank ", r,
                " is undefined, a ShardTensor, not strided or has more than ", kMaxDims,
                " dims (placements ", shardtensor::to_string(placements), ")");
  }
  const int64_t ndim = meta[1];
  for (int64_t r = 0; r < p; ++r) {
    TORCH_CHECK(meta[r * rec + 1] == ndim && meta[r * rec + 2] == meta[2],
                "from_local: ranks disagree on ndim or dtype: mesh rank 0 has shape ",
                c10::IntArrayRef(shape_of(meta)), ", mesh rank ", r, " has shape ",
                c10::IntArrayRef(shape_of(meta + r * rec)));
    // requires_grad is part of the agreement: a rank whose piece does not
    // require grad would skip the backward's collectives that the others make.
    TORCH_CHECK(meta[r * rec + 3] == meta[3],
                "from_local: ranks disagree on requires_grad: the local tensor on mesh rank 0 ",
                meta[3] ? "requires" : "does not require", " grad, on mesh rank ", r, " it ",
                meta[r * rec + 3] ? "does" : "does not", " (placements ",
                shardtensor::to_string(placements), ")");
  }
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(),
              "from_local: ", placements.size(), " placements ", shardtensor::to_string(placements),
              " for a mesh of ", mesh.ndim(), " dims");
  // Extents per mesh dim, read off the ranks along each Shard mesh dim.
  std::vector<int64_t> global = shape_of(meta);
  ShardSizes gathered(mesh.ndim());
  std::vector<int64_t> owner(ndim, -1);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!is_shard(placements[m])) continue;
    int64_t d = shard_dim(placements[m]);
    if (d < 0) d += ndim;
    TORCH_CHECK(d >= 0 && d < ndim, "from_local: ", shardtensor::to_string(placements[m]),
                " is out of range for local tensors of ", ndim, " dims");
    TORCH_CHECK(owner[d] < 0, "from_local: tensor dim ", d, " is sharded by two mesh dims in ",
                shardtensor::to_string(placements));
    owner[d] = m;
    gathered[m].assign(mesh.size(m), -1);
  }
  for (int64_t r = 0; r < p; ++r) {
    const auto coord = mesh.coordinate_of(static_cast<int>(r));
    const auto shape = shape_of(meta + r * rec);
    for (int64_t d = 0; d < ndim; ++d) {
      const int64_t m = owner[d];
      if (m < 0) {
        TORCH_CHECK(shape[d] == global[d], "from_local: tensor dim ", d, " is not sharded by ",
                    shardtensor::to_string(placements), " but mesh rank 0 holds ", global[d],
                    " and mesh rank ", r, " holds ", shape[d], " elements along it");
      } else {
        auto& slot = gathered[m][coord[m]];
        TORCH_CHECK(slot < 0 || slot == shape[d], "from_local: ranks at coordinate ", coord[m],
                    " of mesh dim ", m, " disagree on the extent of tensor dim ", d, " (", slot,
                    " vs ", shape[d], ")");
        slot = shape[d];
      }
    }
  }
  for (int64_t d = 0; d < ndim; ++d) {
    if (owner[d] >= 0) {
      const auto& v = gathered[owner[d]];
      global[d] = std::accumulate(v.begin(), v.end(), int64_t{0});
    }
  }
  if (sizes) {
    // Validate the given sizes against what the ranks hold.
    TORCH_CHECK(static_cast<int64_t>(sizes->size()) == mesh.ndim(), "from_local: sizes has ",
                sizes->size(), " entries for a mesh of ", mesh.ndim(), " dims");
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      if (is_shard(placements[m])) {
        TORCH_CHECK((*sizes)[m] == gathered[m], "from_local: sizes for mesh dim ", m, " are ",
                    c10::IntArrayRef((*sizes)[m]), " but the ranks hold ",
                    c10::IntArrayRef(gathered[m]));
      }
    }
  }
  auto spec = std::make_shared<const ShardSpec>(mesh, std::move(placements), global,
                                                sizes ? std::move(sizes) : std::move(gathered));
  return from_local_unchecked(std::move(local), std::move(spec));
}

at::Tensor scatter_tensor(const at::Tensor& full, int src, const DeviceMesh& mesh,
                          Placements placements, bool requires_grad,
                          std::optional<c10::Device> device) {
  TORCH_CHECK(mesh.defined(), "scatter_tensor: the mesh is undefined");
  TORCH_CHECK(src >= 0 && src < mesh.size(), "scatter_tensor: src ", src,
              " is not a rank of the mesh ", mesh.to_string());
  const int me = mesh.rank();
  // Shape and dtype travel from src first, so every rank can validate alike.
  auto meta = at::tensor(
      me == src ? meta_of(full) : std::vector<int64_t>(kMetaHeader + kMaxDims, 0), at::kLong);
  comm::broadcast_(meta, src, mesh);
  const int64_t* m = meta.data_ptr<int64_t>();
  TORCH_CHECK(m[0] == 1, "scatter_tensor: the tensor on src rank ", src,
              " is undefined, a ShardTensor, not strided or has more than ", kMaxDims, " dims");
  const auto dtype = static_cast<at::ScalarType>(m[2]);
  auto spec = std::make_shared<const ShardSpec>(mesh, std::move(placements), shape_of(m));
  auto zero_piece = [&](const std::vector<int64_t>& coord) {
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      if (is_partial(spec->placements()[d]) && coord[d] != 0) return true;
    }
    return false;
  };
  const int64_t p = mesh.size();
  const int64_t elem = c10::elementSize(dtype);
  std::vector<int64_t> send_bytes(p, 0);
  at::Tensor send;
  if (me == src) {
    std::vector<at::Tensor> pieces;
    at::Tensor f = full.detach();
    for (int64_t r = 0; r < p; ++r) {
      const auto coord = mesh.coordinate_of(static_cast<int>(r));
      if (zero_piece(coord)) continue;
      at::Tensor piece = f;
      const auto offs = spec->local_offsets_at(coord);
      const auto shape = spec->local_shape_at(coord);
      for (int64_t d = 0; d < spec->ndim(); ++d) {
        if (spec->mesh_dim_of(d) >= 0) piece = piece.narrow(d, offs[d], shape[d]);
      }
      pieces.push_back(piece.reshape({-1}));
      send_bytes[r] = piece.numel() * elem;
    }
    send = pieces.empty() ? at::empty({0}, f.options()) : at::cat(pieces);
  }
  at::Tensor local = at::empty(
      spec->local_shape(), at::TensorOptions().dtype(dtype).device(device.value_or(mesh.device())));
  const bool zero = zero_piece(mesh.coordinate());
  comm::scatter_(send, send_bytes, zero ? at::empty({0}, local.options()) : local, src, mesh);
  if (zero) local.zero_();
  if (requires_grad) local.requires_grad_(true);
  return ShardTensor::from_local_unchecked(std::move(local), std::move(spec));
}

at::Tensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, Placements placements,
                             bool requires_grad, std::optional<ShardSizes> sizes,
                             std::optional<c10::Device> device) {
  TORCH_CHECK(full.defined(), "distribute_tensor: the input tensor is undefined");
  TORCH_CHECK(!ShardTensor::is_shard_tensor(full),
              "distribute_tensor: the input is already a ShardTensor; use redistribute()");
  auto spec = std::make_shared<const ShardSpec>(mesh, std::move(placements), full.sizes().vec(),
                                                std::move(sizes));
  const at::Tensor slice = detail::local_slice(full.detach(), *spec);
  at::Tensor local = slice.to(slice.options().device(device.value_or(mesh.device())),
                              /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
  const auto coord = mesh.coordinate();
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (is_partial(spec->placements()[m]) && coord[m] != 0) local.zero_();
  }
  if (requires_grad) local.requires_grad_(true);
  return ShardTensor::from_local_unchecked(std::move(local), std::move(spec));
}

namespace {

// The tensor autograd sees for `output` (its local piece if it is a
// ShardTensor) and the gradient to seed it with, laid out like that piece.
// Collective when a ShardTensor grad_output must move to the output's layout
// or a plain output gets a ShardTensor grad_output. `keep_graph`: keep the
// grad_output's own history (create_graph), else it is detached.
std::pair<at::Tensor, at::Tensor> seed(const char* what, const at::Tensor& output,
                                       const at::Tensor& grad_output, bool keep_graph) {
  TORCH_CHECK(output.defined(), "shardtensor::", what, ": an output is undefined");
  if (!ShardTensor::is_shard_tensor(output)) {
    at::Tensor g = grad_output;
    if (ShardTensor::is_shard_tensor(g)) g = ShardTensor(g).full_tensor();
    return {output, g};
  }
  ShardTensor out(output);
  const ShardSpec& spec = out.spec();
  at::Tensor g;
  if (!grad_output.defined()) {
    TORCH_CHECK(spec.numel() == 1, "shardtensor::", what,
                ": grad_output can be omitted only for a single-element output, got ",
                spec.to_string());
    g = at::ones_like(detail::shard_impl(output)->local());
  } else if (ShardTensor::is_shard_tensor(grad_output)) {
    ShardTensor go(grad_output);
    TORCH_CHECK(go.spec().global_shape() == spec.global_shape(), "shardtensor::", what,
                ": grad_output ", go.spec().to_string(), " does not match output ",
                spec.to_string());
    // The gradient of a Partial value is replicated (Note [replicated gradients]).
    g = detail::redistribute_local(go.local(), go.spec(), *gradient_spec(out.spec_ptr()));
  } else {
    TORCH_CHECK(grad_output.sizes().vec() == spec.global_shape(), "shardtensor::", what,
                ": grad_output of shape ", grad_output.sizes(), " does not match output ",
                spec.to_string());
    g = detail::local_slice(grad_output, spec);
  }
  // The piece as autograd's root (its values are not read): a stale copy
  // view is no obstacle here.
  return {detail::shard_impl(output)->local(), keep_graph ? g : g.detach()};
}

c10::optional<bool> to_c10(std::optional<bool> b) {
  return b ? c10::optional<bool>(*b) : c10::nullopt;
}

}  // namespace

void backward(const at::Tensor& output, const at::Tensor& grad_output,
              std::optional<bool> retain_graph, bool create_graph) {
  auto [out, g] = seed("backward", output, grad_output, create_graph);
  torch::autograd::backward({out}, {g}, to_c10(retain_graph), create_graph);
}

std::vector<at::Tensor> grad(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& grad_outputs,
                             std::optional<bool> retain_graph, bool create_graph,
                             bool allow_unused) {
  // Metadata only (identical on every rank): checked before any communication.
  TORCH_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
              "shardtensor::grad: got ", grad_outputs.size(), " grad_outputs for ", outputs.size(),
              " outputs");
  std::vector<at::Tensor> outs, seeds, ins;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto [o, g] = seed("grad", outputs[i], grad_outputs.empty() ? at::Tensor() : grad_outputs[i],
                       create_graph);
    outs.push_back(o);
    seeds.push_back(g);
  }
  for (const at::Tensor& t : inputs) {
    TORCH_CHECK(t.defined(), "shardtensor::grad: an input is undefined");
    auto* impl = detail::shard_impl(t);
    ins.push_back(impl ? impl->local() : t);  // graph identity only
  }
  auto local =
      torch::autograd::grad(outs, ins, seeds, to_c10(retain_graph), create_graph, allow_unused);
  std::vector<at::Tensor> result;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (local[i].defined() && ShardTensor::is_shard_tensor(inputs[i])) {
      result.push_back(ShardTensor::from_local_unchecked(
          local[i], gradient_spec(ShardTensor(inputs[i]).spec_ptr())));
    } else {
      result.push_back(local[i]);
    }
  }
  return result;
}

}  // namespace shardtensor
