// Differentiable communication primitives on local tensors (see
// shardtensor/comm/primitives.h). Each is a torch::autograd::Function whose
// backward is the adjoint communication; all data movement goes through the
// transport (comm/transport.h).
//
// Note [replicated gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gradients follow the placement of the value they belong to, so that every
// rank can run ordinary libtorch backward on its local tensors:
//  - Shard: the gradient is sharded like the value (each rank holds the
//    gradient of its own piece).
//  - Replicate: the gradient of a replicated value is the *full* gradient,
//    identical on every rank. A replicated value consumed by per-rank
//    different (sharded) compute collects a different partial gradient on each
//    rank, so such a use goes through use_replicated(), whose backward sums
//    them (all-reduce).
//  - Partial: the value is the pending sum of the ranks' summands; the
//    gradient with respect to each summand is the gradient of the sum, hence
//    identical on every rank (all_reduce() backward is the identity).
// The matching inner products, used by the adjoint (dot-product) tests: a
// replicated space counts once, <x, g>; a sharded space sums local dots over
// the ranks; a partial value pairs with its replicated gradient as
// sum_r <x_r, g> = <sum_r x_r, g>. With these, every backward below is the
// exact adjoint of its forward: <A x, y> == <x, A^T y>.
//
// Note [collective discipline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Arguments are validated before any communication. Checks that depend only
// on arguments that are identical on every rank (sizes, ranges, dims) throw
// alike everywhere. Checks of the local tensor (its extent along the sharded
// dim) can fail on one rank only; that rank throws and the others would wait.
// With SHARDTENSOR_DEBUG=1 every primitive first all-reduces (uncounted) a
// fingerprint of its arguments plus a "my checks failed" flag over the
// participating communicator, and throws on every rank, naming the primitive,
// when the fingerprints differ or any rank's checks failed: a mismatch is an
// error, not a hang. Backward passes communicate only if every rank reaches
// them: a primitive whose output takes part in the loss on some ranks and not
// on others hangs in backward (as any collective called by a subset would).
#include <shardtensor/comm/primitives.h>

#include <ATen/ATen.h>
#include <shardtensor/core/error.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/grad_sink.h"
#include "comm/transport.h"

namespace shardtensor::comm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

// ---- bookkeeping ------------------------------------------------------------

enum class Prim : int64_t {
  AllReduce = 1,
  AllReduceNograd,
  UseReplicated,
  AllGather,
  ShardSlice,
  ReduceScatter,
  ReplicateToPartial,
  AllToAll,
  Repartition,
  GatherRange,
  HaloExchange,
};

const char* prim_name(Prim p) {
  switch (p) {
    case Prim::AllReduce:
      return "all_reduce";
    case Prim::AllReduceNograd:
      return "all_reduce_nograd";
    case Prim::UseReplicated:
      return "use_replicated";
    case Prim::AllGather:
      return "all_gather";
    case Prim::ShardSlice:
      return "shard_slice";
    case Prim::ReduceScatter:
      return "reduce_scatter";
    case Prim::ReplicateToPartial:
      return "replicate_to_partial";
    case Prim::AllToAll:
      return "all_to_all";
    case Prim::Repartition:
      return "repartition";
    case Prim::GatherRange:
      return "gather_range";
    case Prim::HaloExchange:
      return "halo_exchange";
  }
  return "?";
}

std::string prefix(Prim p) { return std::string("shardtensor::comm::") + prim_name(p) + ": "; }

/// Arguments that backward needs, kept in ctx->saved_data as an opaque capsule
/// (IValue cannot hold a DeviceMesh or a plan directly).
template <class T>
struct Boxed : torch::CustomClassHolder {
  explicit Boxed(T v) : value(std::move(v)) {}
  T value;
};

template <class T>
void save_args(AutogradContext* ctx, T value) {
  ctx->saved_data["shardtensor_args"] =
      c10::IValue::make_capsule(c10::make_intrusive<Boxed<T>>(std::move(value)));
}

template <class T>
const T& saved_args(AutogradContext* ctx) {
  auto holder = ctx->saved_data.at("shardtensor_args").toCapsule();
  // The capsule stays alive in ctx->saved_data.
  return static_cast<Boxed<T>*>(holder.get())->value;
}

/// FNV-1a over 64-bit words: deterministic on every rank (unlike std::hash).
class Fingerprint {
 public:
  Fingerprint& add(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) {
      h_ ^= (u >> (8 * i)) & 0xffu;
      h_ *= 1099511628211ull;
    }
    return *this;
  }
  Fingerprint& add(const std::vector<int64_t>& v) {
    add(static_cast<int64_t>(v.size()));
    for (int64_t x : v) {
      add(x);
    }
    return *this;
  }
  Fingerprint& add(double d) {
    int64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    return add(bits);
  }
  /// Shape with the entries in `masked` left out (they may differ per rank).
  Fingerprint& add_shape(const at::Tensor& t, std::initializer_list<int64_t> masked) {
    add(static_cast<int64_t>(t.scalar_type()));
    add(static_cast<int64_t>(t.dim()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      bool skip = std::find(masked.begin(), masked.end(), d) != masked.end();
      add(skip ? int64_t{-1} : t.size(d));
    }
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

bool debug_enabled() {
  const char* env = std::getenv("SHARDTENSOR_DEBUG");
  return env != nullptr && env[0] != '\0' && std::strcmp(env, "0") != 0;
}

/// Collects the first failed argument check instead of throwing at once, so
/// that in debug mode every rank can first agree (see Note [collective discipline]).
class Checks {
 public:
  explicit Checks(Prim p) : prim_(p) {}
  template <class... Args>
  bool require(bool cond, const Args&... args) {
    if (!cond && error_.empty()) {
      error_ = prefix(prim_) + c10::str(args...);
    }
    return cond;
  }
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  Prim prim_;
  std::string error_;
};

/// Collective over `comm` when SHARDTENSOR_DEBUG is set, local otherwise.
/// Throws c10::Error (on every rank in debug mode) if a check failed here or,
/// in debug mode, on another rank, or if the fingerprints differ.
void agree_or_throw(Prim p, MPI_Comm comm, Fingerprint fp, const Checks& checks) {
  if (!debug_enabled() || transport::comm_size(comm) == 1) {
    TORCH_CHECK(checks.ok(), checks.error());
    return;
  }
  fp.add(static_cast<int64_t>(p));
  const uint64_t h = fp.value();
  const int64_t hi = static_cast<int64_t>(h >> 32), lo = static_cast<int64_t>(h & 0xffffffffu);
  // max of (hi, lo) and of (-hi, -lo) gives both max and min: equal iff all agree.
  std::vector<int64_t> v = {hi, lo, -hi, -lo, checks.ok() ? 0 : 1};
  transport::diagnostic_max_(v, comm);
  TORCH_CHECK(checks.ok(), checks.error(), " [SHARDTENSOR_DEBUG: reported on every rank]");
  TORCH_CHECK(v[4] == 0, prefix(p),
              "the arguments failed validation on another rank (see that rank's error) "
              "[SHARDTENSOR_DEBUG]");
  TORCH_CHECK(v[0] == -v[2] && v[1] == -v[3], prefix(p),
              "ranks disagree on the call (primitive, dims, sizes, ranges, dtype or shape "
              "differ between the ranks of the communicator) [SHARDTENSOR_DEBUG]");
}

/// One mesh dim as seen from this rank.
struct Axis {
  DeviceMesh mesh;
  int64_t mesh_dim = 0;
  MPI_Comm comm = MPI_COMM_NULL;
  int64_t size = 1;  // number of coordinates along the mesh dim
  int64_t me = 0;    // this rank's coordinate
};

void check_mesh(Prim p, const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.defined(), prefix(p), "the mesh is undefined");
  TORCH_CHECK(!mesh.is_abstract(), prefix(p), "the mesh is abstract (it has no communicators)");
}

/// Throws at once (identically on every rank) when mesh_dim is invalid: without
/// it there is no communicator to agree on.
Axis axis(Prim p, const DeviceMesh& mesh, int64_t mesh_dim) {
  check_mesh(p, mesh);
  const int64_t nd = mesh.ndim();
  TORCH_CHECK(mesh_dim >= -nd && mesh_dim < nd, prefix(p), "mesh_dim ", mesh_dim,
              " is out of range for a mesh with ", nd, " dims");
  Axis a;
  a.mesh = mesh;
  a.mesh_dim = mesh_dim < 0 ? mesh_dim + nd : mesh_dim;
  a.comm = mesh.comm(a.mesh_dim);
  a.size = mesh.size(a.mesh_dim);
  a.me = mesh.coordinate()[a.mesh_dim];
  return a;
}

/// The communicator over several mesh dims (sorted, deduplicated, wrapped).
struct Group {
  MPI_Comm comm = MPI_COMM_NULL;  // MPI_COMM_NULL: no dims, nothing to do
  std::vector<int64_t> dims;
};

Group group(Prim p, const DeviceMesh& mesh, const std::vector<int64_t>& mesh_dims) {
  check_mesh(p, mesh);
  const int64_t nd = mesh.ndim();
  Group g;
  std::vector<bool> keep(nd, false);
  for (int64_t d : mesh_dims) {
    TORCH_CHECK(d >= -nd && d < nd, prefix(p), "mesh dim ", d, " is out of range for a mesh with ",
                nd, " dims");
    const int64_t w = d < 0 ? d + nd : d;
    TORCH_CHECK(!keep[w], prefix(p), "mesh dim ", w, " is listed twice");
    keep[w] = true;
  }
  for (int64_t d = 0; d < nd; ++d) {
    if (keep[d]) {
      g.dims.push_back(d);
    }
  }
  if (g.dims.empty()) {
    return g;
  }
  g.comm = g.dims.size() == 1 ? mesh.comm(g.dims[0]) : mesh.comm(keep);
  return g;
}

/// Wraps a tensor dim; records an error instead of throwing.
int64_t wrap_dim(Checks& checks, int64_t dim, const at::Tensor& t, const char* what) {
  const int64_t nd = t.dim();
  if (!checks.require(dim >= -nd && dim < nd, what, " ", dim, " is out of range for a local tensor",
                      " with ", nd, " dims")) {
    return 0;
  }
  return dim < 0 ? dim + nd : dim;
}

/// Checks a partition vector: one non-negative entry per coordinate.
bool check_sizes(Checks& checks, const std::vector<int64_t>& sizes, const Axis& a,
                 const char* what) {
  if (!checks.require(static_cast<int64_t>(sizes.size()) == a.size, what, " has ", sizes.size(),
                      " entries but mesh dim ", a.mesh_dim, " has ", a.size, " coordinates")) {
    return false;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!checks.require(sizes[i] >= 0, what, "[", i, "] = ", sizes[i], " is negative")) {
      return false;
    }
  }
  return true;
}

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) {
    out[i] = out[i - 1] + sizes[i - 1];
  }
  return out;
}

std::vector<int64_t> shape_with(at::IntArrayRef shape, int64_t dim, int64_t extent) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out[dim] = extent;
  return out;
}

/// Number of elements in one index of `dim` (product of the other extents).
int64_t row_numel(at::IntArrayRef shape, int64_t dim) {
  int64_t n = 1;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    n *= d == dim ? 1 : shape[d];
  }
  return n;
}

/// Shape of a row buffer: `rows` indices of `dim`, which is moved to the front.
std::vector<int64_t> rows_shape(at::IntArrayRef shape, int64_t dim, int64_t rows) {
  std::vector<int64_t> out = {rows};
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (d != dim) {
      out.push_back(shape[d]);
    }
  }
  return out;
}

// ---- forward kernels (no autograd) -------------------------------------------

at::Tensor gather_along(const at::Tensor& local, MPI_Comm comm, int64_t dim,
                        const std::vector<int64_t>& sizes) {
  at::Tensor send = local.movedim(dim, 0).contiguous();
  const int64_t row_bytes = row_numel(local.sizes(), dim) * local.element_size();
  at::Tensor recv = at::empty(rows_shape(local.sizes(), dim, sum_of(sizes)), local.options());
  std::vector<int64_t> bytes(sizes.size());
  for (size_t c = 0; c < sizes.size(); ++c) {
    bytes[c] = sizes[c] * row_bytes;
  }
  transport::all_gatherv(send, recv, bytes, comm);
  return recv.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_along(const at::Tensor& t, MPI_Comm comm, int64_t dim,
                                const std::vector<int64_t>& sizes, int64_t me) {
  at::Tensor send = t.movedim(dim, 0).contiguous();
  const int64_t row = row_numel(t.sizes(), dim);
  at::Tensor recv = at::empty(rows_shape(t.sizes(), dim, sizes[me]), t.options());
  std::vector<int64_t> numel(sizes.size());
  for (size_t c = 0; c < sizes.size(); ++c) {
    numel[c] = sizes[c] * row;
  }
  transport::reduce_scatter(send, recv, numel, ReduceOp::Sum, comm);
  return recv.movedim(0, dim).contiguous();
}

at::Tensor reduce_over(const at::Tensor& t, MPI_Comm comm, ReduceOp op) {
  at::Tensor out = t.clone(at::MemoryFormat::Contiguous);
  if (comm != MPI_COMM_NULL) {
    transport::all_reduce_(out, op, comm);
  }
  return out;
}

/// Shard(src_dim) -> Shard(dst_dim) with src_dim != dst_dim (all-to-allv).
at::Tensor all_to_all_kernel(const at::Tensor& local, const Axis& a, int64_t src_dim,
                             const std::vector<int64_t>& src_sizes, int64_t dst_dim,
                             const std::vector<int64_t>& dst_sizes) {
  const int64_t P = a.size, me = a.me;
  const auto src_off = exclusive_offsets(src_sizes);
  const auto dst_off = exclusive_offsets(dst_sizes);
  const int64_t elem = local.element_size();
  // Piece for/from coordinate c: (src extent, dst extent) = (src_sizes[me], dst_sizes[c]) out,
  // (src_sizes[c], dst_sizes[me]) in; the other dims are shared.
  int64_t common = 1;
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (d != src_dim && d != dst_dim) {
      common *= local.size(d);
    }
  }
  std::vector<int64_t> send_numel(P), recv_numel(P);
  for (int64_t c = 0; c < P; ++c) {
    send_numel[c] = c == me ? 0 : common * src_sizes[me] * dst_sizes[c];
    recv_numel[c] = c == me ? 0 : common * src_sizes[c] * dst_sizes[me];
  }
  const auto send_displ = exclusive_offsets(send_numel);
  const auto recv_displ = exclusive_offsets(recv_numel);
  at::Tensor send = at::empty({sum_of(send_numel)}, local.options());
  at::Tensor recv = at::empty({sum_of(recv_numel)}, local.options());
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || send_numel[c] == 0) {
      continue;
    }
    at::Tensor piece = local.narrow(dst_dim, dst_off[c], dst_sizes[c]);
    send.narrow(0, send_displ[c], send_numel[c]).view(piece.sizes()).copy_(piece);
  }
  at::Tensor out = at::empty(
      shape_with(shape_with(local.sizes(), src_dim, sum_of(src_sizes)), dst_dim, dst_sizes[me]),
      local.options());
  // Own piece: a local copy.
  out.narrow(src_dim, src_off[me], src_sizes[me])
      .copy_(local.narrow(dst_dim, dst_off[me], dst_sizes[me]));
  std::vector<int64_t> sb(P), sd(P), rb(P), rd(P);
  for (int64_t c = 0; c < P; ++c) {
    sb[c] = send_numel[c] * elem;
    sd[c] = send_displ[c] * elem;
    rb[c] = recv_numel[c] * elem;
    rd[c] = recv_displ[c] * elem;
  }
  transport::all_to_allv(send, sb, sd, recv, rb, rd, a.comm);
  for (int64_t c = 0; c < P; ++c) {
    if (c == me || recv_numel[c] == 0) {
      continue;
    }
    at::Tensor dst = out.narrow(src_dim, src_off[c], src_sizes[c]);
    dst.copy_(recv.narrow(0, recv_displ[c], recv_numel[c]).view(dst.sizes()));
  }
  return out;
}

// ---- repartition: general run remap ------------------------------------------

using Layout = std::vector<std::vector<Segment>>;  // per coordinate, runs in local order

/// Global index run shared by a source and a destination layout.
struct Piece {
  int64_t global = 0;
  int64_t len = 0;
  int64_t src_local = 0;
  int64_t dst_local = 0;
};

/// Intersections of `src` and `dst` runs, in increasing global order (so that
/// the sender and the receiver, computing this independently, agree).
std::vector<Piece> intersect(const std::vector<Segment>& src, const std::vector<Segment>& dst) {
  std::vector<Piece> out;
  int64_t s_loc = 0;
  for (const auto& s : src) {
    int64_t d_loc = 0;
    for (const auto& d : dst) {
      const int64_t a = std::max(s.start, d.start);
      const int64_t b = std::min(s.start + s.length, d.start + d.length);
      if (a < b) {
        out.push_back({a, b - a, s_loc + a - s.start, d_loc + a - d.start});
      }
      d_loc += d.length;
    }
    s_loc += s.length;
  }
  std::sort(out.begin(), out.end(),
            [](const Piece& x, const Piece& y) { return x.global < y.global; });
  return out;
}

int64_t layout_extent(const std::vector<Segment>& runs) {
  int64_t n = 0;
  for (const auto& s : runs) {
    n += s.length;
  }
  return n;
}

/// Every rank: rows of `local` along `dim` laid out per `src`, rearranged per `dst`.
at::Tensor remap_kernel(const at::Tensor& local, const Axis& a, int64_t dim, const Layout& src,
                        const Layout& dst) {
  const int64_t P = a.size, me = a.me;
  const int64_t row_bytes = row_numel(local.sizes(), dim) * local.element_size();
  at::Tensor in_rows = local.movedim(dim, 0);
  at::Tensor out =
      at::empty(shape_with(local.sizes(), dim, layout_extent(dst[me])), local.options());
  at::Tensor out_rows = out.movedim(dim, 0);
  std::vector<std::vector<Piece>> sends(P), recvs(P);
  std::vector<int64_t> send_rows(P, 0), recv_rows(P, 0);
  for (int64_t c = 0; c < P; ++c) {
    sends[c] = intersect(src[me], dst[c]);
    recvs[c] = intersect(src[c], dst[me]);
    if (c == me) {
      continue;  // local copies below
    }
    for (const auto& p : sends[c]) {
      send_rows[c] += p.len;
    }
    for (const auto& p : recvs[c]) {
      recv_rows[c] += p.len;
    }
  }
  const auto send_displ = exclusive_offsets(send_rows);
  const auto recv_displ = exclusive_offsets(recv_rows);
  at::Tensor send = at::empty(rows_shape(local.sizes(), dim, sum_of(send_rows)), local.options());
  at::Tensor recv = at::empty(rows_shape(local.sizes(), dim, sum_of(recv_rows)), local.options());
  for (int64_t c = 0; c < P; ++c) {
    if (c == me) {
      continue;
    }
    int64_t at_row = send_displ[c];
    for (const auto& p : sends[c]) {
      send.narrow(0, at_row, p.len).copy_(in_rows.narrow(0, p.src_local, p.len));
      at_row += p.len;
    }
  }
  for (const auto& p : sends[me]) {
    out_rows.narrow(0, p.dst_local, p.len).copy_(in_rows.narrow(0, p.src_local, p.len));
  }
  std::vector<int64_t> sb(P), sd(P), rb(P), rd(P);
  for (int64_t c = 0; c < P; ++c) {
    sb[c] = send_rows[c] * row_bytes;
    sd[c] = send_displ[c] * row_bytes;
    rb[c] = recv_rows[c] * row_bytes;
    rd[c] = recv_displ[c] * row_bytes;
  }
  transport::all_to_allv(send, sb, sd, recv, rb, rd, a.comm);
  for (int64_t c = 0; c < P; ++c) {
    if (c == me) {
      continue;
    }
    int64_t at_row = recv_displ[c];
    for (const auto& p : recvs[c]) {
      out_rows.narrow(0, p.dst_local, p.len).copy_(recv.narrow(0, at_row, p.len));
      at_row += p.len;
    }
  }
  return out;
}

/// Records an error unless the runs of all coordinates tile [0, n) exactly.
bool check_tiling(Checks& checks, const Layout& layout, int64_t n, const char* what) {
  std::vector<Segment> all;
  for (size_t c = 0; c < layout.size(); ++c) {
    for (const auto& s : layout[c]) {
      if (!checks.require(s.start >= 0 && s.length >= 0, what, " of coordinate ", c, " has a run [",
                          s.start, ", +", s.length, ") with a negative start or length")) {
        return false;
      }
      if (s.length > 0) {
        all.push_back(s);
      }
    }
  }
  std::sort(all.begin(), all.end(),
            [](const Segment& x, const Segment& y) { return x.start < y.start; });
  int64_t next = 0;
  for (const auto& s : all) {
    if (!checks.require(s.start == next, what, " do not tile [0, ", n,
                        ") exactly: ", s.start < next ? "overlap" : "gap", " at global index ",
                        std::min(s.start, next))) {
      return false;
    }
    next = s.start + s.length;
  }
  return checks.require(next == n, what, " cover [0, ", next, ") but the destination sizes sum to ",
                        n);
}

// ---- gather_range: the general halo -----------------------------------------

/// A run of the wanted range: `len` positions from `dst` (relative to the range
/// start) come from coordinate `owner` at its local index `src`, going up
/// (dir = +1), down (dir = -1, reflect), or repeating one element (dir = 0,
/// replicate: one row travels, it is expanded on arrival). owner = -1 is a
/// constant fill.
struct Run {
  int64_t dst = 0;
  int64_t owner = -1;
  int64_t src = 0;
  int64_t len = 0;
  int dir = 1;
};

int64_t run_rows(const Run& r) { return r.dir == 0 ? 1 : r.len; }

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/// The owner of global index g in [0, n): the coordinate c with a non-empty
/// block [offsets[c], offsets[c] + sizes[c]) containing g.
int64_t owner_of(int64_t g, const std::vector<int64_t>& offsets,
                 const std::vector<int64_t>& sizes) {
  // Last c with offsets[c] <= g; skip back over nothing: empty blocks share the
  // offset of the next block, so take the last one, which is non-empty.
  auto it = std::upper_bound(offsets.begin(), offsets.end(), g);
  int64_t c = static_cast<int64_t>(it - offsets.begin()) - 1;
  while (sizes[c] == 0) {
    --c;  // unreachable for g < n: the last c with offsets[c] <= g owns g
  }
  return c;
}

/// Splits the source run "global indices src, src+dir, ... (len of them)
/// feeding positions dst, dst+1, ..." by owner and appends the pieces.
void split_by_owner(int64_t dst, int64_t gsrc, int64_t len, int dir,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                    std::vector<Run>& out) {
  if (len == 0) {
    return;
  }
  if (dir == 0) {
    const int64_t c = owner_of(gsrc, offsets, sizes);
    out.push_back({dst, c, gsrc - offsets[c], len, 0});
    return;
  }
  // Covered global interval [lo, hi).
  const int64_t lo = dir > 0 ? gsrc : gsrc - len + 1;
  const int64_t hi = lo + len;
  int64_t c = owner_of(lo, offsets, sizes);
  const int64_t P = static_cast<int64_t>(sizes.size());
  for (; c < P && offsets[c] < hi; ++c) {
    const int64_t a = std::max(lo, offsets[c]);
    const int64_t b = std::min(hi, offsets[c] + sizes[c]);
    if (a >= b) {
      continue;
    }
    if (dir > 0) {
      out.push_back({dst + (a - gsrc), c, a - offsets[c], b - a, 1});
    } else {
      // Highest index b-1 comes first in the output.
      out.push_back({dst + (gsrc - (b - 1)), c, (b - 1) - offsets[c], b - a, -1});
    }
  }
}

/// Every run of the range [lo, hi) (validated), in a deterministic order.
std::vector<Run> plan_range(int64_t lo, int64_t hi, const std::vector<int64_t>& sizes,
                            const std::vector<int64_t>& offsets, int64_t n, PadMode mode) {
  std::vector<Run> runs;
  auto outside = [&](int64_t a, int64_t b) {  // [a, b) lies entirely outside [0, n)
    if (a >= b) {
      return;
    }
    const bool left = b <= 0;
    switch (mode) {
      case PadMode::Constant:
        runs.push_back({a - lo, -1, 0, b - a, 1});
        break;
      case PadMode::Replicate:
        split_by_owner(a - lo, left ? 0 : n - 1, b - a, 0, offsets, sizes, runs);
        break;
      case PadMode::Reflect:
        // g < 0 mirrors to -g; g >= n mirrors to 2(n-1) - g. Both go down as g goes up.
        split_by_owner(a - lo, left ? -a : 2 * (n - 1) - a, b - a, -1, offsets, sizes, runs);
        break;
      case PadMode::Circular:
        for (int64_t k = floor_div(a, n); a < b; ++k) {
          const int64_t e = std::min(b, (k + 1) * n);
          split_by_owner(a - lo, a - k * n, e - a, 1, offsets, sizes, runs);
          a = e;
        }
        break;
    }
  };
  outside(lo, std::min(hi, int64_t{0}));
  const int64_t mid_lo = std::max(lo, int64_t{0}), mid_hi = std::min(hi, n);
  if (mid_lo < mid_hi) {
    split_by_owner(mid_lo - lo, mid_lo, mid_hi - mid_lo, 1, offsets, sizes, runs);
  }
  outside(std::max(lo, n), hi);
  return runs;
}

/// Who sends what to whom for one gather_range call, from this rank's view.
struct RangePlan {
  int64_t dim = 0;
  std::vector<int64_t> in_shape;   // this rank's local shape
  std::vector<int64_t> out_shape;  // this rank's result shape
  std::vector<Run> fills;          // constant fills of my range
  std::vector<Run> local;          // runs of my range that I own
  // Runs of my range owned by `peer`, and runs of `peer`'s range owned by me.
  std::vector<std::pair<int, std::vector<Run>>> recv, send;
};

const char* mode_name(PadMode m) {
  switch (m) {
    case PadMode::Constant:
      return "Constant";
    case PadMode::Reflect:
      return "Reflect";
    case PadMode::Replicate:
      return "Replicate";
    case PadMode::Circular:
      return "Circular";
  }
  return "?";
}

bool check_ranges(Checks& checks, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                  const Axis& a, int64_t n, PadMode mode) {
  if (!checks.require(static_cast<int64_t>(ranges.size()) == a.size, "ranges has ", ranges.size(),
                      " entries but mesh dim ", a.mesh_dim, " has ", a.size, " coordinates")) {
    return false;
  }
  for (size_t c = 0; c < ranges.size(); ++c) {
    const auto [lo, hi] = ranges[c];
    if (!checks.require(lo <= hi, "the range of coordinate ", c, " is [", lo, ", ", hi,
                        "), which has negative length")) {
      return false;
    }
    if (lo == hi || (lo >= 0 && hi <= n) || mode == PadMode::Constant) {
      continue;
    }
    const char* m = mode_name(mode);
    if (mode == PadMode::Reflect) {
      if (!checks.require(n >= 2, "PadMode::", m, " needs at least 2 elements, the dim has ", n,
                          " (range of coordinate ", c, " is [", lo, ", ", hi, "))") ||
          !checks.require(lo >= -(n - 1) && hi <= 2 * n - 1, "PadMode::", m,
                          " reaches at most n - 1 = ", n - 1,
                          " beyond the domain, but the range of coordinate ", c, " is [", lo, ", ",
                          hi, ") for n = ", n)) {
        return false;
      }
    } else if (!checks.require(n >= 1, "PadMode::", m, " cannot fill [", lo, ", ", hi,
                               ") of coordinate ", c, " from an empty dim")) {
      return false;
    }
  }
  return true;
}

RangePlan make_plan(const at::Tensor& local, const Axis& a, int64_t dim,
                    const std::vector<int64_t>& sizes,
                    const std::vector<std::pair<int64_t, int64_t>>& ranges, PadMode mode) {
  const int64_t n = sum_of(sizes);
  const auto offsets = exclusive_offsets(sizes);
  RangePlan plan;
  plan.dim = dim;
  plan.in_shape = local.sizes().vec();
  plan.out_shape = shape_with(local.sizes(), dim, ranges[a.me].second - ranges[a.me].first);
  std::vector<std::vector<Run>> recv(a.size);
  for (const Run& r :
       plan_range(ranges[a.me].first, ranges[a.me].second, sizes, offsets, n, mode)) {
    if (r.owner < 0) {
      plan.fills.push_back(r);
    } else if (r.owner == a.me) {
      plan.local.push_back(r);
    } else {
      recv[r.owner].push_back(r);
    }
  }
  for (int64_t c = 0; c < a.size; ++c) {
    if (!recv[c].empty()) {
      plan.recv.emplace_back(static_cast<int>(c), std::move(recv[c]));
    }
  }
  if (sizes[a.me] == 0) {
    return plan;  // owns nothing, sends nothing
  }
  for (int64_t c = 0; c < a.size; ++c) {
    if (c == a.me) {
      continue;
    }
    std::vector<Run> mine;
    for (const Run& r : plan_range(ranges[c].first, ranges[c].second, sizes, offsets, n, mode)) {
      if (r.owner == a.me) {
        mine.push_back(r);
      }
    }
    if (!mine.empty()) {
      plan.send.emplace_back(static_cast<int>(c), std::move(mine));
    }
  }
  return plan;
}

/// The rows a run reads from its owner's local tensor (dim moved to the front).
at::Tensor source_rows(const at::Tensor& rows, const Run& r) {
  switch (r.dir) {
    case 1:
      return rows.narrow(0, r.src, r.len);
    case -1:
      return rows.narrow(0, r.src - r.len + 1, r.len).flip(0);
    default:
      return rows.narrow(0, r.src, 1);
  }
}

/// Adjoint of source_rows: adds `g` (the run's gradient, dst order; for dir = 0
/// already summed to one row) into the owner's gradient rows.
void accumulate_rows(const at::Tensor& grad_rows, const Run& r, const at::Tensor& g) {
  switch (r.dir) {
    case 1:
      grad_rows.narrow(0, r.src, r.len).add_(g);
      break;
    case -1:
      grad_rows.narrow(0, r.src - r.len + 1, r.len).add_(g.flip(0));
      break;
    default:
      grad_rows.narrow(0, r.src, 1).add_(g);
      break;
  }
}

/// The gradient of a run's output positions as it travels back: dir = 0 sums
/// the repeated positions into the one row that was sent.
at::Tensor run_grad(const at::Tensor& grad_out_rows, const Run& r) {
  at::Tensor g = grad_out_rows.narrow(0, r.dst, r.len);
  return r.dir == 0 ? g.sum(0, /*keepdim=*/true) : g;
}

int64_t total_rows(const std::vector<Run>& runs) {
  int64_t n = 0;
  for (const auto& r : runs) {
    n += run_rows(r);
  }
  return n;
}

at::Tensor gather_range_forward(const at::Tensor& local, const RangePlan& plan, MPI_Comm comm,
                                double value) {
  const int64_t dim = plan.dim;
  at::Tensor in_rows = local.movedim(dim, 0);
  std::vector<transport::PeerBuffer> sends, recvs;
  for (const auto& [peer, runs] : plan.send) {
    at::Tensor buf = at::empty(rows_shape(local.sizes(), dim, total_rows(runs)), local.options());
    int64_t at_row = 0;
    for (const Run& r : runs) {
      buf.narrow(0, at_row, run_rows(r)).copy_(source_rows(in_rows, r));
      at_row += run_rows(r);
    }
    sends.push_back({peer, buf});
  }
  for (const auto& [peer, runs] : plan.recv) {
    recvs.push_back(
        {peer, at::empty(rows_shape(local.sizes(), dim, total_rows(runs)), local.options())});
  }
  auto pending = transport::start_exchange(sends, recvs, comm);
  // Overlap: fills and own runs while the messages travel.
  at::Tensor out = at::empty(plan.out_shape, local.options());
  at::Tensor out_rows = out.movedim(dim, 0);
  for (const Run& r : plan.fills) {
    out_rows.narrow(0, r.dst, r.len).fill_(value);
  }
  for (const Run& r : plan.local) {
    out_rows.narrow(0, r.dst, r.len).copy_(source_rows(in_rows, r));
  }
  pending.finish();
  for (size_t i = 0; i < plan.recv.size(); ++i) {
    int64_t at_row = 0;
    for (const Run& r : plan.recv[i].second) {
      // copy_ broadcasts the single row of a dir = 0 run over its positions.
      out_rows.narrow(0, r.dst, r.len).copy_(recvs[i].buffer.narrow(0, at_row, run_rows(r)));
      at_row += run_rows(r);
    }
  }
  return out;
}

/// Halo accumulate: the adjoint of gather_range_forward.
at::Tensor gather_range_backward(const at::Tensor& grad_out, const RangePlan& plan, MPI_Comm comm) {
  const int64_t dim = plan.dim;
  at::Tensor g_rows = grad_out.movedim(dim, 0);
  std::vector<transport::PeerBuffer> sends, recvs;
  for (const auto& [peer, runs] : plan.recv) {  // back to the owners
    at::Tensor buf =
        at::empty(rows_shape(plan.in_shape, dim, total_rows(runs)), grad_out.options());
    int64_t at_row = 0;
    for (const Run& r : runs) {
      buf.narrow(0, at_row, run_rows(r)).copy_(run_grad(g_rows, r));
      at_row += run_rows(r);
    }
    sends.push_back({peer, buf});
  }
  for (const auto& [peer, runs] : plan.send) {
    recvs.push_back(
        {peer, at::empty(rows_shape(plan.in_shape, dim, total_rows(runs)), grad_out.options())});
  }
  auto pending = transport::start_exchange(sends, recvs, comm);
  at::Tensor grad_in = at::zeros(plan.in_shape, grad_out.options());
  at::Tensor gin_rows = grad_in.movedim(dim, 0);
  for (const Run& r : plan.local) {
    accumulate_rows(gin_rows, r, run_grad(g_rows, r));
  }
  pending.finish();
  for (size_t i = 0; i < plan.send.size(); ++i) {
    int64_t at_row = 0;
    for (const Run& r : plan.send[i].second) {
      accumulate_rows(gin_rows, r, recvs[i].buffer.narrow(0, at_row, run_rows(r)));
      at_row += run_rows(r);
    }
  }
  return grad_in;
}

// ---- autograd functions ------------------------------------------------------

struct GroupArgs {
  MPI_Comm comm = MPI_COMM_NULL;
};

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, GroupArgs args) {
    return reduce_over(t, args.comm, ReduceOp::Sum);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], Variable()};  // Note [replicated gradients]
  }
};

struct UseReplicatedFn : torch::autograd::Function<UseReplicatedFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, GroupArgs args) {
    save_args(ctx, args);
    return t;  // returned input: autograd makes it a view with this node as grad_fn
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& args = saved_args<GroupArgs>(ctx);
    return {reduce_over(grads[0], args.comm, ReduceOp::Sum), Variable()};
  }
};

/// use_replicated() of a leaf registered with a gradient sink (Note [gradient
/// buckets]): the backward hands this rank's partial gradient to the sink,
/// which sums it over the mesh in buckets, and passes nothing on to autograd.
struct SinkArgs {
  std::shared_ptr<detail::ReplicatedGradSink> sink;
  const at::TensorImpl* leaf = nullptr;
  MPI_Comm comm = MPI_COMM_NULL;  // for the fallback under create_graph
};

struct UseReplicatedSinkFn : torch::autograd::Function<UseReplicatedSinkFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, SinkArgs args) {
    save_args(ctx, std::move(args));
    return t;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& args = saved_args<SinkArgs>(ctx);
    if (!grads[0].defined()) return {Variable(), Variable()};
    if (at::GradMode::is_enabled()) {
      // create_graph: the sink's reduction is not differentiable; all-reduce here.
      return {reduce_over(grads[0], args.comm, ReduceOp::Sum), Variable()};
    }
    args.sink->add_partial(args.leaf, grads[0]);
    return {Variable(), Variable()};
  }
};

struct AxisArgs {
  Axis axis;
  int64_t dim = 0;
  std::vector<int64_t> sizes;
};

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, AxisArgs args) {
    at::Tensor out = gather_along(local, args.axis.comm, args.dim, args.sizes);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<AxisArgs>(ctx);
    const auto off = exclusive_offsets(a.sizes);
    return {grads[0].narrow(a.dim, off[a.axis.me], a.sizes[a.axis.me]), Variable()};
  }
};

struct ShardSliceFn : torch::autograd::Function<ShardSliceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& full, AxisArgs args) {
    const auto off = exclusive_offsets(args.sizes);
    at::Tensor out = full.narrow(args.dim, off[args.axis.me], args.sizes[args.axis.me])
                         .clone(at::MemoryFormat::Contiguous);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<AxisArgs>(ctx);
    return {gather_along(grads[0], a.axis.comm, a.dim, a.sizes), Variable()};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, AxisArgs args) {
    at::Tensor out = reduce_scatter_along(t, args.axis.comm, args.dim, args.sizes, args.axis.me);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<AxisArgs>(ctx);
    return {gather_along(grads[0], a.axis.comm, a.dim, a.sizes), Variable()};
  }
};

struct ReplicateToPartialFn : torch::autograd::Function<ReplicateToPartialFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, int64_t coordinate) {
    return coordinate == 0 ? t.clone(at::MemoryFormat::Contiguous) : at::zeros_like(t);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], Variable()};  // Note [replicated gradients]
  }
};

struct AllToAllArgs {
  Axis axis;
  int64_t src_dim = 0, dst_dim = 0;
  std::vector<int64_t> src_sizes, dst_sizes;
};

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, AllToAllArgs args) {
    at::Tensor out = all_to_all_kernel(local, args.axis, args.src_dim, args.src_sizes, args.dst_dim,
                                       args.dst_sizes);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<AllToAllArgs>(ctx);
    return {all_to_all_kernel(grads[0].contiguous(), a.axis, a.dst_dim, a.dst_sizes, a.src_dim,
                              a.src_sizes),
            Variable()};
  }
};

struct RemapArgs {
  Axis axis;
  int64_t dim = 0;
  Layout src, dst;
};

struct RemapFn : torch::autograd::Function<RemapFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, RemapArgs args) {
    at::Tensor out = remap_kernel(local, args.axis, args.dim, args.src, args.dst);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<RemapArgs>(ctx);
    return {remap_kernel(grads[0], a.axis, a.dim, a.dst, a.src), Variable()};
  }
};

struct RangeArgs {
  MPI_Comm comm = MPI_COMM_NULL;
  std::shared_ptr<const RangePlan> plan;
  double value = 0.0;
};

struct GatherRangeFn : torch::autograd::Function<GatherRangeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, RangeArgs args) {
    at::Tensor out = gather_range_forward(local, *args.plan, args.comm, args.value);
    save_args(ctx, std::move(args));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& a = saved_args<RangeArgs>(ctx);
    return {gather_range_backward(grads[0], *a.plan, a.comm), Variable()};
  }
};

/// Shared by gather_range and halo_exchange (which names itself in errors).
at::Tensor gather_range_impl(Prim prim, const at::Tensor& local, const DeviceMesh& mesh,
                             int64_t mesh_dim, int64_t dim, const std::vector<int64_t>& sizes,
                             const std::vector<std::pair<int64_t, int64_t>>& ranges, PadMode mode,
                             double value, int64_t left, int64_t right) {
  const Axis a = axis(prim, mesh, mesh_dim);
  Checks checks(prim);
  TORCH_CHECK(local.defined(), prefix(prim), "the local tensor is undefined");
  const int64_t d = wrap_dim(checks, dim, local, "dim");
  if (check_sizes(checks, sizes, a, "sizes") &&
      check_ranges(checks, ranges, a, sum_of(sizes), mode) && checks.ok()) {
    checks.require(local.size(d) == sizes[a.me], "the local tensor has extent ", local.size(d),
                   " along dim ", d, " but sizes[", a.me, "] = ", sizes[a.me], " (coordinate ",
                   a.me, " of mesh dim ", a.mesh_dim, ")");
  }
  Fingerprint fp;
  fp.add(a.mesh_dim).add(dim).add(sizes).add(static_cast<int64_t>(mode)).add(value);
  fp.add(left).add(right).add_shape(local, {d});
  for (const auto& [lo, hi] : ranges) {
    fp.add(lo).add(hi);
  }
  agree_or_throw(prim, a.comm, fp, checks);
  RangeArgs args;
  args.comm = a.comm;
  args.plan = std::make_shared<const RangePlan>(make_plan(local, a, d, sizes, ranges, mode));
  args.value = value;
  return GatherRangeFn::apply(local, std::move(args));
}

}  // namespace

// ---- public API ----------------------------------------------------------------

at::Tensor all_reduce(const at::Tensor& t, const DeviceMesh& mesh,
                      const std::vector<int64_t>& mesh_dims) {
  const Prim p = Prim::AllReduce;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  if (g.comm == MPI_COMM_NULL) {
    return AllReduceFn::apply(t, GroupArgs{});
  }
  Checks checks(p);
  Fingerprint fp;
  fp.add(g.dims).add_shape(t, {});
  agree_or_throw(p, g.comm, fp, checks);
  return AllReduceFn::apply(t, GroupArgs{g.comm});
}

at::Tensor all_reduce_nograd(const at::Tensor& t, const DeviceMesh& mesh,
                             const std::vector<int64_t>& mesh_dims, ReduceOp op) {
  const Prim p = Prim::AllReduceNograd;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  at::Tensor in = t.detach();
  if (g.comm == MPI_COMM_NULL) {
    return in.clone(at::MemoryFormat::Contiguous);
  }
  Checks checks(p);
  Fingerprint fp;
  fp.add(g.dims).add(static_cast<int64_t>(op)).add_shape(t, {});
  agree_or_throw(p, g.comm, fp, checks);
  return reduce_over(in, g.comm, op);
}

at::Tensor use_replicated(const at::Tensor& t, const DeviceMesh& mesh,
                          const std::vector<int64_t>& mesh_dims) {
  const Prim p = Prim::UseReplicated;
  const Group g = group(p, mesh, mesh_dims);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  if (g.comm != MPI_COMM_NULL) {
    Checks checks(p);
    Fingerprint fp;
    fp.add(g.dims).add_shape(t, {});
    agree_or_throw(p, g.comm, fp, checks);
  }
  if (auto sink = detail::grad_sink_for(t, mesh, g.dims)) {
    return UseReplicatedSinkFn::apply(t,
                                      SinkArgs{std::move(sink), t.unsafeGetTensorImpl(), g.comm});
  }
  if (t.is_view() && t.requires_grad()) {
    // A view of a registered leaf (linear's w.t()): route the leaf itself to
    // its sink and take the same view again, so that autograd maps the
    // view's gradient back onto the leaf's shape.
    const at::Tensor base(t._base());
    if (auto sink = detail::grad_sink_for(base, mesh, g.dims)) {
      at::Tensor marked = UseReplicatedSinkFn::apply(
          base, SinkArgs{std::move(sink), base.unsafeGetTensorImpl(), g.comm});
      return marked.as_strided(t.sizes(), t.strides(), t.storage_offset());
    }
  }
  return UseReplicatedFn::apply(t, GroupArgs{g.comm});
}

// ---- gradient sinks (Note [gradient buckets]) ----------------------------------

namespace detail {
namespace {
struct SinkEntry {
  c10::weak_intrusive_ptr<at::TensorImpl> leaf;
  DeviceMesh mesh;
  std::shared_ptr<ReplicatedGradSink> sink;
};
std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const at::TensorImpl*, SinkEntry>& sink_registry() {
  static auto* r = new std::unordered_map<const at::TensorImpl*, SinkEntry>();  // never destroyed
  return *r;
}
}  // namespace

void set_grad_sink(const at::Tensor& leaf, const DeviceMesh& mesh,
                   std::shared_ptr<ReplicatedGradSink> sink) {
  TORCH_CHECK(leaf.defined(), "set_grad_sink: undefined tensor");
  std::lock_guard<std::mutex> lock(sink_mutex());
  auto& reg = sink_registry();
  // Drop entries whose tensors are gone (their address may be reused).
  for (auto it = reg.begin(); it != reg.end();) {
    it = it->second.leaf.expired() ? reg.erase(it) : std::next(it);
  }
  const at::TensorImpl* key = leaf.unsafeGetTensorImpl();
  if (!sink) {
    reg.erase(key);
    return;
  }
  reg.erase(key);
  reg.emplace(key, SinkEntry{c10::weak_intrusive_ptr<at::TensorImpl>(leaf.getIntrusivePtr()), mesh,
                             std::move(sink)});
}

std::shared_ptr<ReplicatedGradSink> grad_sink_for(const at::Tensor& t, const DeviceMesh& mesh,
                                                  const std::vector<int64_t>& mesh_dims) {
  if (!t.defined() || !t.requires_grad() || !t.is_leaf()) return nullptr;
  if (static_cast<int64_t>(mesh_dims.size()) != mesh.ndim()) return nullptr;
  std::lock_guard<std::mutex> lock(sink_mutex());
  auto& reg = sink_registry();
  if (reg.empty()) return nullptr;
  auto it = reg.find(t.unsafeGetTensorImpl());
  if (it == reg.end() || it->second.leaf.expired() || it->second.mesh != mesh) return nullptr;
  return it->second.sink;
}

}  // namespace detail

namespace {

/// Validation shared by all_gather, shard_slice and reduce_scatter. `local_is_piece`:
/// the local extent along dim must be sizes[me] (else the full extent).
AxisArgs axis_args(Prim p, const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim,
                   int64_t dim, const std::vector<int64_t>& sizes, bool local_is_piece) {
  AxisArgs args;
  args.axis = axis(p, mesh, mesh_dim);
  TORCH_CHECK(t.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  args.dim = wrap_dim(checks, dim, t, "dim");
  if (check_sizes(checks, sizes, args.axis, "sizes") && checks.ok()) {
    const int64_t want = local_is_piece ? sizes[args.axis.me] : sum_of(sizes);
    checks.require(t.size(args.dim) == want, "the local tensor has extent ", t.size(args.dim),
                   " along dim ", args.dim, " but ",
                   local_is_piece ? "sizes[coordinate]" : "sum(sizes)", " = ", want,
                   " (coordinate ", args.axis.me, " of mesh dim ", args.axis.mesh_dim, ")");
  }
  Fingerprint fp;
  fp.add(args.axis.mesh_dim).add(dim).add(sizes).add_shape(t, {args.dim});
  agree_or_throw(p, args.axis.comm, fp, checks);
  args.sizes = sizes;
  return args;
}

}  // namespace

at::Tensor all_gather(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t dim, const std::vector<int64_t>& sizes) {
  return AllGatherFn::apply(local,
                            axis_args(Prim::AllGather, local, mesh, mesh_dim, dim, sizes, true));
}

at::Tensor shard_slice(const at::Tensor& full, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<int64_t>& sizes) {
  return ShardSliceFn::apply(full,
                             axis_args(Prim::ShardSlice, full, mesh, mesh_dim, dim, sizes, false));
}

at::Tensor reduce_scatter(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim,
                          int64_t dim, const std::vector<int64_t>& sizes) {
  return ReduceScatterFn::apply(
      t, axis_args(Prim::ReduceScatter, t, mesh, mesh_dim, dim, sizes, false));
}

at::Tensor replicate_to_partial(const at::Tensor& t, const DeviceMesh& mesh, int64_t mesh_dim) {
  const Prim p = Prim::ReplicateToPartial;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(t.defined(), prefix(p), "the tensor is undefined");
  Checks checks(p);
  Fingerprint fp;
  fp.add(a.mesh_dim).add_shape(t, {});
  agree_or_throw(p, a.comm, fp, checks);
  return ReplicateToPartialFn::apply(t, a.me);
}

at::Tensor repartition(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                       int64_t dim, const std::vector<std::vector<Segment>>& segments,
                       const std::vector<int64_t>& dst_sizes) {
  const Prim p = Prim::Repartition;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(local.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  const int64_t d = wrap_dim(checks, dim, local, "dim");
  if (check_sizes(checks, dst_sizes, a, "dst_sizes") &&
      checks.require(static_cast<int64_t>(segments.size()) == a.size, "segments has ",
                     segments.size(), " entries but mesh dim ", a.mesh_dim, " has ", a.size,
                     " coordinates") &&
      check_tiling(checks, segments, sum_of(dst_sizes), "the segments") && checks.ok()) {
    checks.require(local.size(d) == layout_extent(segments[a.me]), "the local tensor has extent ",
                   local.size(d), " along dim ", d, " but the segments of coordinate ", a.me,
                   " hold ", layout_extent(segments[a.me]), " elements");
  }
  Fingerprint fp;
  fp.add(a.mesh_dim).add(dim).add(dst_sizes).add_shape(local, {d});
  for (const auto& runs : segments) {
    fp.add(static_cast<int64_t>(runs.size()));
    for (const auto& s : runs) {
      fp.add(s.start).add(s.length);
    }
  }
  agree_or_throw(p, a.comm, fp, checks);
  RemapArgs args;
  args.axis = a;
  args.dim = d;
  args.src = segments;
  const auto off = exclusive_offsets(dst_sizes);
  for (size_t c = 0; c < dst_sizes.size(); ++c) {
    args.dst.push_back({Segment{off[c], dst_sizes[c]}});
  }
  return RemapFn::apply(local, std::move(args));
}

at::Tensor all_to_all(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                      int64_t src_dim, const std::vector<int64_t>& src_sizes, int64_t dst_dim,
                      const std::vector<int64_t>& dst_sizes) {
  const Prim p = Prim::AllToAll;
  const Axis a = axis(p, mesh, mesh_dim);
  TORCH_CHECK(local.defined(), prefix(p), "the local tensor is undefined");
  Checks checks(p);
  const int64_t sd = wrap_dim(checks, src_dim, local, "src_dim");
  const int64_t dd = wrap_dim(checks, dst_dim, local, "dst_dim");
  if (check_sizes(checks, src_sizes, a, "src_sizes") &&
      check_sizes(checks, dst_sizes, a, "dst_sizes") && checks.ok()) {
    if (sd == dd) {
      checks.require(sum_of(src_sizes) == sum_of(dst_sizes),
                     "rebalancing (src_dim == dst_dim) needs sum(src_sizes) = ", sum_of(src_sizes),
                     " to equal sum(dst_sizes) = ", sum_of(dst_sizes));
    }
    if (checks.ok()) {
      checks.require(local.size(sd) == src_sizes[a.me], "the local tensor has extent ",
                     local.size(sd), " along src_dim ", sd, " but src_sizes[", a.me,
                     "] = ", src_sizes[a.me]);
    }
    if (checks.ok() && sd != dd) {
      checks.require(local.size(dd) == sum_of(dst_sizes), "the local tensor has extent ",
                     local.size(dd), " along dst_dim ", dd,
                     " but sum(dst_sizes) = ", sum_of(dst_sizes));
    }
  }
  Fingerprint fp;
  fp.add(a.mesh_dim).add(src_dim).add(src_sizes).add(dst_dim).add(dst_sizes);
  fp.add_shape(local, {sd, dd});
  agree_or_throw(p, a.comm, fp, checks);
  if (sd == dd) {
    // Rebalancing is the repartition of contiguous blocks to contiguous blocks.
    RemapArgs args;
    args.axis = a;
    args.dim = sd;
    const auto off = exclusive_offsets(src_sizes);
    for (size_t c = 0; c < src_sizes.size(); ++c) {
      args.src.push_back({Segment{off[c], src_sizes[c]}});
    }
    const auto doff = exclusive_offsets(dst_sizes);
    for (size_t c = 0; c < dst_sizes.size(); ++c) {
      args.dst.push_back({Segment{doff[c], dst_sizes[c]}});
    }
    return RemapFn::apply(local, std::move(args));
  }
  AllToAllArgs args;
  args.axis = a;
  args.src_dim = sd;
  args.dst_dim = dd;
  args.src_sizes = src_sizes;
  args.dst_sizes = dst_sizes;
  return AllToAllFn::apply(local.contiguous(), std::move(args));
}

at::Tensor gather_range(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                        int64_t dim, const std::vector<int64_t>& sizes,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges, PadMode mode,
                        double value) {
  return gather_range_impl(Prim::GatherRange, local, mesh, mesh_dim, dim, sizes, ranges, mode,
                           value, 0, 0);
}

at::Tensor halo_exchange(const at::Tensor& local, const DeviceMesh& mesh, int64_t mesh_dim,
                         int64_t dim, const std::vector<int64_t>& sizes, int64_t left,
                         int64_t right, PadMode mode, double value) {
  const Prim p = Prim::HaloExchange;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const auto off = exclusive_offsets(sizes);
  for (size_t c = 0; c < sizes.size(); ++c) {
    // Validated in gather_range_impl (a negative total width is a negative length).
    ranges.emplace_back(off[c] - left, off[c] + sizes[c] + right);
  }
  return gather_range_impl(p, local, mesh, mesh_dim, dim, sizes, ranges, mode, value, left, right);
}

}  // namespace shardtensor::comm
