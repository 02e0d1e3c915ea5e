// Index halos (Note [ghost plans], shardtensor/comm/ghost.h): plan building
// and the two adjoint exchanges, on the transport's all-to-allv (plan) and
// split-phase point-to-point exchange (data).
#include "comm/ghost.h"
#include "comm/function_output.h"

#include <ATen/ATen.h>
#include <shardtensor/core/error.h>
#include <torch/csrc/autograd/custom_function.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "comm/agree.h"
#include "comm/transport.h"

namespace shardtensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

constexpr int kGhostTag = 7043;

const char* kBuild = "shardtensor::GhostPlan::build: ";

std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i];
  return off;
}

const detail::GhostPlanData& checked(const GhostPlan& plan, const char* what) {
  TORCH_CHECK(plan.defined(), "shardtensor::", what, ": the GhostPlan is undefined");
  return plan.data();
}

std::vector<int64_t> row_shape(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  s[0] = rows;
  return s;
}

/// Owned rows + received ghost rows combined into `out` (owned rows, cloned
/// by the caller): every rank sends its ghost rows to their owners and
/// combines what it receives with `op`.
at::Tensor accumulate_kernel(const at::Tensor& extended, const detail::GhostPlanData& d,
                             ReduceOp op) {
  const int64_t n = d.sizes[d.me];
  at::Tensor ext = comm::transport::send_buffer(extended);
  at::Tensor out = ext.narrow(0, 0, n).clone(at::MemoryFormat::Contiguous);
  std::vector<comm::transport::PeerBuffer> sends, recvs;
  for (size_t i = 0; i < d.recv_peer.size(); ++i)
    sends.push_back(
        {static_cast<int>(d.recv_peer[i]), ext.narrow(0, n + d.recv_start[i], d.recv_count[i])});
  for (size_t i = 0; i < d.send_peer.size(); ++i)
    recvs.push_back({static_cast<int>(d.send_peer[i]),
                     at::empty(row_shape(ext, d.send_rows[i].numel()), ext.options())});
  auto pending = comm::transport::start_exchange(sends, recvs, d.comm, kGhostTag);
  pending.finish();
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (op == ReduceOp::Sum) {
      out.index_add_(0, d.send_rows[i], recvs[i].buffer);
    } else {
      const char* r = op == ReduceOp::Max ? "amax" : op == ReduceOp::Min ? "amin" : "prod";
      out.index_reduce_(0, d.send_rows[i], recvs[i].buffer, r, /*include_self=*/true);
    }
  }
  return out;
}

at::Tensor exchange_kernel(const at::Tensor& owned, const detail::GhostPlanData& d) {
  const int64_t n = d.sizes[d.me];
  at::Tensor own = comm::transport::send_buffer(owned);
  at::Tensor ext = at::empty(row_shape(own, n + d.ghost_ids.numel()), own.options());
  ext.narrow(0, 0, n).copy_(own);
  std::vector<comm::transport::PeerBuffer> sends, recvs;
  for (size_t i = 0; i < d.send_peer.size(); ++i)
    sends.push_back({static_cast<int>(d.send_peer[i]), own.index_select(0, d.send_rows[i])});
  for (size_t i = 0; i < d.recv_peer.size(); ++i)
    recvs.push_back(
        {static_cast<int>(d.recv_peer[i]), ext.narrow(0, n + d.recv_start[i], d.recv_count[i])});
  auto pending = comm::transport::start_exchange(sends, recvs, d.comm, kGhostTag);
  pending.finish();
  return ext;
}

void check_rows(const at::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.defined() && t.dim() >= 1, "shardtensor::", what,
              ": expected a tensor with at least one dim");
  TORCH_CHECK(t.size(0) == rows, "shardtensor::", what, ": expected ", rows,
              " rows on this rank, got a tensor of shape ", t.sizes());
}

template <class T>
struct Boxed : torch::CustomClassHolder {
  explicit Boxed(T v) : value(std::move(v)) {}
  T value;
};

void save_plan(AutogradContext* ctx, const GhostPlan& plan) {
  ctx->saved_data["ghost_plan"] =
      c10::IValue::make_capsule(c10::make_intrusive<Boxed<GhostPlan>>(plan));
}

const GhostPlan& saved_plan(AutogradContext* ctx) {
  auto holder = ctx->saved_data.at("ghost_plan").toCapsule();
  return static_cast<Boxed<GhostPlan>*>(holder.get())->value;
}

struct GhostExchangeFn : torch::autograd::Function<GhostExchangeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& owned, GhostPlan plan) {
    at::Tensor out = exchange_kernel(owned, plan.data());
    save_plan(ctx, plan);
    return comm::function_output(out, {owned});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The differentiable adjoint, so that double backward works.
    return {ghost_accumulate(grads[0], saved_plan(ctx)), Variable()};
  }
};

struct GhostAccumulateFn : torch::autograd::Function<GhostAccumulateFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& extended, GhostPlan plan) {
    at::Tensor out = accumulate_kernel(extended, plan.data(), ReduceOp::Sum);
    save_plan(ctx, plan);
    return comm::function_output(out, {extended});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ghost_exchange(grads[0], saved_plan(ctx)), Variable()};
  }
};

}  // namespace

// ---- GhostPlan -----------------------------------------------------------------

GhostPlan GhostPlan::build(const DeviceMesh& mesh, int64_t mesh_dim, std::vector<int64_t> sizes,
                           const at::Tensor& needed_ids) {
  // Arguments identical on every rank: throw alike everywhere.
  TORCH_CHECK(mesh.defined() && !mesh.is_abstract(), kBuild,
              "the mesh is undefined or abstract (it has no communicators)");
  const int64_t nd = mesh.ndim();
  TORCH_CHECK(mesh_dim >= -nd && mesh_dim < nd, kBuild, "mesh_dim ", mesh_dim,
              " is out of range for a mesh with ", nd, " dims");
  if (mesh_dim < 0) mesh_dim += nd;
  const int64_t P = mesh.size(mesh_dim);
  TORCH_CHECK(static_cast<int64_t>(sizes.size()) == P, kBuild, "sizes has ", sizes.size(),
              " entries but mesh dim ", mesh_dim, " has ", P, " coordinates");
  for (int64_t s : sizes)
    TORCH_CHECK(s >= 0, kBuild, "negative entry in sizes ", at::IntArrayRef(sizes));
  const auto off = exclusive_offsets(sizes);
  const int64_t N = off.back();

  // This rank's data: agree before communicating.
  bool ok = true;
  std::string msg;
  if (!needed_ids.defined() || needed_ids.dim() != 1 || needed_ids.scalar_type() != at::kLong) {
    ok = false;
    std::ostringstream os;
    os << "needed_ids must be a 1-D int64 tensor, got "
       << (needed_ids.defined() ? needed_ids.toString() + " of shape " : std::string("undefined"))
       << (needed_ids.defined() ? needed_ids.sizes() : at::IntArrayRef{});
    msg = os.str();
  } else if (needed_ids.numel() > 0) {
    const int64_t lo = needed_ids.min().item<int64_t>(), hi = needed_ids.max().item<int64_t>();
    if (lo < 0 || hi >= N) {
      ok = false;
      std::ostringstream os;
      os << "needed_ids holds ids in [" << lo << ", " << hi << "] but only " << N
         << " items exist (sizes " << at::IntArrayRef(sizes) << ")";
      msg = os.str();
    }
  }
  comm::check_all(mesh, ok, "shardtensor::GhostPlan::build", msg);

  auto d = std::make_shared<detail::GhostPlanData>();
  d->mesh = mesh;
  d->mesh_dim = mesh_dim;
  d->comm = mesh.comm(mesh_dim);
  d->P = P;
  d->me = mesh.coordinate()[mesh_dim];
  d->sizes = std::move(sizes);
  d->offsets.assign(off.begin(), off.end() - 1);
  const int64_t my_lo = off[d->me], my_hi = off[d->me + 1];

  at::Tensor ids = needed_ids.to(at::kCPU).contiguous();
  if (ids.numel() > 0) {
    ids = std::get<0>(at::sort(ids));
    ids = std::get<0>(at::unique_consecutive(ids));
    ids = ids.masked_select(ids.lt(my_lo).logical_or(ids.ge(my_hi))).contiguous();
  } else {
    ids = at::empty({0}, at::kLong);
  }
  d->ghost_ids = ids;

  // Ghosts per owner (ids are sorted, so each owner's ghosts are one run).
  at::Tensor bounds = at::searchsorted(ids, at::tensor(off, at::kLong));
  auto b = bounds.accessor<int64_t, 1>();
  std::vector<int64_t> want(P), want_displ(P);
  for (int64_t c = 0; c < P; ++c) {
    want[c] = b[c + 1] - b[c];
    want_displ[c] = b[c];
    if (want[c] > 0) {
      d->recv_peer.push_back(c);
      d->recv_count.push_back(want[c]);
      d->recv_start.push_back(b[c]);
    }
  }

  // How many of my rows each peer wants, then which.
  std::vector<int64_t> eight(P, 8), displ8(P);
  for (int64_t c = 0; c < P; ++c) displ8[c] = 8 * c;
  at::Tensor want_t = at::tensor(want, at::kLong);
  at::Tensor give_t = at::empty({P}, at::kLong);
  comm::transport::all_to_allv(want_t, eight, displ8, give_t, eight, displ8, d->comm);
  std::vector<int64_t> give(give_t.data_ptr<int64_t>(), give_t.data_ptr<int64_t>() + P);
  std::vector<int64_t> give_displ(P, 0);
  for (int64_t c = 1; c < P; ++c) give_displ[c] = give_displ[c - 1] + give[c - 1];
  const int64_t total_give = P > 0 ? give_displ[P - 1] + give[P - 1] : 0;
  at::Tensor asked = at::empty({total_give}, at::kLong);
  auto bytes = [](std::vector<int64_t> v) {
    for (auto& x : v) x *= 8;
    return v;
  };
  comm::transport::all_to_allv(ids, bytes(want), bytes(want_displ), asked, bytes(give),
                               bytes(give_displ), d->comm);
  for (int64_t c = 0; c < P; ++c) {
    if (give[c] == 0) continue;
    d->send_peer.push_back(c);
    d->send_rows.push_back(asked.narrow(0, give_displ[c], give[c]).sub(my_lo).contiguous());
    d->num_send_rows += give[c];
  }
  GhostPlan plan;
  plan.data_ = std::move(d);
  return plan;
}

const detail::GhostPlanData& GhostPlan::data() const {
  TORCH_CHECK(data_ != nullptr, "shardtensor::GhostPlan: the plan is undefined");
  return *data_;
}
const DeviceMesh& GhostPlan::mesh() const { return data().mesh; }
int64_t GhostPlan::mesh_dim() const { return data().mesh_dim; }
const std::vector<int64_t>& GhostPlan::sizes() const { return data().sizes; }
int64_t GhostPlan::num_global() const {
  int64_t n = 0;
  for (int64_t s : data().sizes) n += s;
  return n;
}
int64_t GhostPlan::owned_offset() const { return data().offsets[data().me]; }
int64_t GhostPlan::num_owned() const { return data().sizes[data().me]; }
int64_t GhostPlan::num_ghost() const { return data().ghost_ids.numel(); }
const at::Tensor& GhostPlan::ghost_ids() const { return data().ghost_ids; }
int64_t GhostPlan::num_send_rows() const { return data().num_send_rows; }
std::vector<int64_t> GhostPlan::recv_peers() const { return data().recv_peer; }

at::Tensor GhostPlan::local_index(const at::Tensor& global_ids) const {
  const auto& d = data();
  TORCH_CHECK(global_ids.defined() && global_ids.scalar_type() == at::kLong,
              "shardtensor::GhostPlan::local_index: expected int64 global ids");
  const int64_t lo = d.offsets[d.me], n = d.sizes[d.me];
  at::Tensor g = global_ids.contiguous();
  at::Tensor owned = g.ge(lo).logical_and(g.lt(lo + n));
  at::Tensor out = g - lo;
  if (d.ghost_ids.numel() > 0) {
    at::Tensor pos = at::searchsorted(d.ghost_ids, g).clamp_max(d.ghost_ids.numel() - 1);
    at::Tensor found = d.ghost_ids.index_select(0, pos.flatten()).view(g.sizes()).eq(g);
    TORCH_CHECK(owned.logical_or(found).all().item<bool>(),
                "shardtensor::GhostPlan::local_index: some ids are neither owned by this rank "
                "(rows [",
                lo, ", ", lo + n, ")) nor among the plan's ghosts");
    out = at::where(owned, out, pos + n);
  } else {
    TORCH_CHECK(owned.all().item<bool>(),
                "shardtensor::GhostPlan::local_index: some ids are not owned by this rank (rows [",
                lo, ", ", lo + n, ")) and the plan has no ghosts");
  }
  return out;
}

// ---- the exchanges ---------------------------------------------------------------

at::Tensor ghost_exchange(const at::Tensor& owned, const GhostPlan& plan) {
  const auto& d = checked(plan, "ghost_exchange");
  check_rows(owned, d.sizes[d.me], "ghost_exchange");
  return GhostExchangeFn::apply(owned, plan);
}

at::Tensor ghost_accumulate(const at::Tensor& extended, const GhostPlan& plan,
                            const GhostOptions& options) {
  const auto& d = checked(plan, "ghost_accumulate");
  check_rows(extended, d.sizes[d.me] + d.ghost_ids.numel(), "ghost_accumulate");
  auto dt = options.accumulate_dtype();
  if (dt && *dt != extended.scalar_type()) {
    return GhostAccumulateFn::apply(extended.to(*dt), plan).to(extended.scalar_type());
  }
  return GhostAccumulateFn::apply(extended, plan);
}

at::Tensor ghost_accumulate_nograd(const at::Tensor& extended, const GhostPlan& plan, ReduceOp op) {
  const auto& d = checked(plan, "ghost_accumulate_nograd");
  // The same verdict on every rank: op is an argument of the collective call.
  TORCH_CHECK(
      op == ReduceOp::Sum || op == ReduceOp::Max || op == ReduceOp::Min || op == ReduceOp::Product,
      "shardtensor::ghost_accumulate_nograd: unsupported reduce op");
  check_rows(extended, d.sizes[d.me] + d.ghost_ids.numel(), "ghost_accumulate_nograd");
  at::NoGradGuard guard;
  return accumulate_kernel(extended.detach(), d, op);
}

}  // namespace shardtensor
