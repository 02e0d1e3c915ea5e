#include "core/process_groups.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <shardtensor/core/comm.h>
#include <shardtensor/core/error.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/mesh/device_mesh.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace shardtensor {

namespace detail {

// Defined in core/runtime.cpp: work to do in shardtensor::finalize() while MPI is usable.
void register_finalize_hook(std::function<void()> hook);

/// Shared by all copies of one DeviceMesh. Owns the library's communicators:
/// the Cartesian communicator, one sub-communicator per mesh dim, and the
/// cache of sub-communicators per keep-mask.
struct MeshState {
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<int64_t> coordinate;
  int rank = 0;
  bool is_abstract = true;
  c10::DeviceType device_type = c10::DeviceType::CPU;  // where the pieces live

  std::mutex mutex;  // guards the fields below
  bool freed = false;
  Comm cart = comm_null();
  std::vector<Comm> dim_comms;
  std::map<std::vector<bool>, Comm> sub_comms;

  MeshState() = default;
  MeshState(const MeshState&) = delete;
  MeshState& operator=(const MeshState&) = delete;
  ~MeshState();

  /// Frees every communicator (no-op if already freed or MPI is gone). Never throws.
  void free_comms() noexcept;
};

}  // namespace detail

namespace {

using detail::MeshState;

bool mpi_usable() {
  if (detail::pg::active()) return true;  // the c10d transport (Note [c10d handles])
  int initialized = 0;
  int finalized = 0;
#if SHARDTENSOR_WITH_MPI
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
#endif
  return initialized != 0 && finalized == 0;
}

// Live meshes with communicators, in creation order, so that finalize() can
// free them while MPI is still usable.
struct Registry {
  std::mutex mutex;
  std::vector<MeshState*> states;
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: usable during static destruction
  return *r;
}

void free_all_meshes() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (MeshState* s : r.states) {
    s->free_comms();
  }
}

void register_mesh(MeshState* s) {
  static std::once_flag hook_once;
  std::call_once(hook_once, [] { detail::register_finalize_hook(free_all_meshes); });
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.states.push_back(s);
}

}  // namespace

namespace detail {
// Declared in src/mesh/live_comms.h (private; tests use it).
int64_t live_mesh_communicators() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  int64_t n = 0;
  for (MeshState* s : r.states) {
    n += (s->cart != comm_null()) + static_cast<int64_t>(s->dim_comms.size()) +
         static_cast<int64_t>(s->sub_comms.size());
  }
  return n;
}
}  // namespace detail

namespace {

void unregister_mesh(MeshState* s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.states.erase(std::remove(r.states.begin(), r.states.end(), s), r.states.end());
}

template <typename T>
std::string list_string(const std::vector<T>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    os << (i ? ", " : "") << v[i];
  }
  os << "]";
  return os.str();
}

std::vector<std::string> default_names(size_t ndim) {
  std::vector<std::string> names;
  for (size_t i = 0; i < ndim; ++i) {
    names.push_back("dim" + std::to_string(i));
  }
  return names;
}

// Checks the dim names (empty or one distinct, non-empty name per dim).
// Returns an empty string if valid, else the reason.
std::string names_problem(const std::vector<std::string>& names, size_t ndim) {
  if (names.empty()) {
    return {};
  }
  if (names.size() != ndim) {
    return "expected " + std::to_string(ndim) + " dim names (one per mesh dim), got " +
           std::to_string(names.size());
  }
  std::set<std::string> seen;
  for (const auto& n : names) {
    if (n.empty()) {
      return "dim names must not be empty";
    }
    if (!seen.insert(n).second) {
      return "duplicate dim name '" + n + "'";
    }
  }
  return {};
}

int64_t row_major_rank(const std::vector<int64_t>& shape, const std::vector<int64_t>& coord) {
  int64_t r = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    r = r * shape[i] + coord[i];
  }
  return r;
}

std::vector<int64_t> row_major_coordinate(const std::vector<int64_t>& shape, int64_t rank) {
  std::vector<int64_t> coord(shape.size(), 0);
  for (size_t i = shape.size(); i-- > 0;) {
    coord[i] = rank % shape[i];
    rank /= shape[i];
  }
  return coord;
}

}  // namespace

namespace detail {

MeshState::~MeshState() {
  if (!is_abstract) {
    unregister_mesh(this);
    free_comms();
  }
}

void MeshState::free_comms() noexcept {
  std::lock_guard<std::mutex> lock(mutex);
  if (freed) {
    return;
  }
  freed = true;
  if (!mpi_usable()) {
    return;  // MPI already finalized: its communicators are gone with it.
  }
  // Failures here cannot be reported (destructor / finalize path); ignore them.
  auto release = [](Comm& c) {
    if (c == comm_null()) return;
    if (detail::pg::owns(c)) {
      detail::pg::free_group(c);
    } else if (!detail::pg::active()) {
#if SHARDTENSOR_WITH_MPI
      MPI_Comm_free(&c);
#endif
    }
    c = comm_null();
  };
  for (auto& kv : sub_comms) release(kv.second);
  sub_comms.clear();
  for (auto& c : dim_comms) release(c);
  dim_comms.clear();
  release(cart);
}

}  // namespace detail

DeviceMesh DeviceMesh::create(std::vector<int64_t> shape, std::vector<std::string> dim_names,
                              Comm comm) {
  TORCH_CHECK(mpi_usable(),
              "DeviceMesh::create: MPI is not initialized (call shardtensor::init() first) "
              "or has already been finalized");
  TORCH_CHECK(comm != comm_null(), "DeviceMesh::create: the base communicator is comm_null()");
  // Under the c10d transport MPI_COMM_WORLD names the c10d world (Note [c10d handles]).
  if (detail::pg::active() && comm == comm_world()) comm = detail::pg::world();
  const bool c10d = detail::pg::owns(comm);
  int comm_size = 0;
  if (c10d) {
    comm_size = detail::pg::size(comm);
  } else {
    TORCH_CHECK(!detail::pg::active(),
                "DeviceMesh::create: under the c10d transport the base communicator must be "
                "MPI_COMM_WORLD (the c10d world) or a mesh's communicator");
#if SHARDTENSOR_WITH_MPI
    SHARDTENSOR_MPI_CHECK(MPI_Comm_size(comm, &comm_size));
#endif
  }

  // Validation uses only local, rank-independent information (the shape, the
  // names and the communicator size), so every rank reaches the same verdict
  // before any communication.
  const std::string what = "DeviceMesh::create: invalid mesh shape " + list_string(shape) +
                           " with dim names " + list_string(dim_names) +
                           " for a communicator of size " + std::to_string(comm_size) + ": ";
  TORCH_CHECK(!shape.empty(), what, "the mesh needs at least one dim");
  int64_t inferred = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      TORCH_CHECK(inferred < 0, what, "at most one entry may be -1");
      inferred = static_cast<int64_t>(i);
    } else {
      TORCH_CHECK(shape[i] >= 1, what, "entry ", i, " is ", shape[i],
                  " (entries must be positive, or -1 to infer one)");
      known *= shape[i];
      TORCH_CHECK(known <= comm_size, what, "the product of the entries exceeds the ",
                  "communicator size");
    }
  }
  if (inferred >= 0) {
    TORCH_CHECK(comm_size % known == 0, what, "the communicator size is not divisible by ", known,
                " (the product of the other entries)");
    shape[inferred] = comm_size / known;
  } else {
    TORCH_CHECK(known == comm_size, what, "the product of the entries is ", known,
                ", not the communicator size");
  }
  const std::string names_error = names_problem(dim_names, shape.size());
  TORCH_CHECK(names_error.empty(), what, names_error);
  if (dim_names.empty()) {
    dim_names = default_names(shape.size());
  }

  auto state = std::make_shared<MeshState>();
  state->shape = shape;
  state->names = std::move(dim_names);
  state->is_abstract = false;

  const int ndims = static_cast<int>(shape.size());
  if (c10d) {
    // The same grid as MPI_Cart_create(reorder = 0): row-major ranks, one
    // group per mesh dim whose rank is the coordinate on that dim.
    std::vector<int> all(static_cast<size_t>(comm_size));
    for (int r = 0; r < comm_size; ++r) all[r] = r;
    state->cart = detail::pg::split(comm, all, "whole mesh " + list_string(state->shape));
    register_mesh(state.get());
    const int rank = detail::pg::rank(state->cart);
    state->rank = rank;
    state->coordinate = row_major_coordinate(state->shape, rank);
    for (int d = 0; d < ndims; ++d) {
      std::vector<int> members;
      std::vector<int64_t> c = state->coordinate;
      for (int64_t i = 0; i < state->shape[d]; ++i) {
        c[d] = i;
        members.push_back(static_cast<int>(row_major_rank(state->shape, c)));
      }
      const std::string comm_name = "mesh dim " + std::to_string(d) + " ('" + state->names[d] +
                                    "') of mesh " + list_string(state->shape);
      state->dim_comms.push_back(detail::pg::split(state->cart, members, comm_name));
      TORCH_INTERNAL_ASSERT(detail::pg::rank(state->dim_comms.back()) == state->coordinate[d]);
    }
    DeviceMesh mesh;
    mesh.state_ = std::move(state);
    return mesh;
  }
#if !SHARDTENSOR_WITH_MPI
  TORCH_INTERNAL_ASSERT(false, "DeviceMesh::create: an MPI communicator in a c10d-only build");
#else
  std::vector<int> dims(shape.begin(), shape.end());
  std::vector<int> periods(ndims, 0);
  Comm dup = comm_null();
  SHARDTENSOR_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  // From here on the library's communicators report errors instead of aborting.
  SHARDTENSOR_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  const int rc =
      MPI_Cart_create(dup, ndims, dims.data(), periods.data(), /*reorder=*/0, &state->cart);
  MPI_Comm_free(&dup);
  SHARDTENSOR_MPI_CHECK(rc);
  {
    const std::string comm_name = "whole mesh " + list_string(state->shape);
    SHARDTENSOR_MPI_CHECK(MPI_Comm_set_name(state->cart, comm_name.c_str()));
  }
  // The state owns the communicators from here, so an error below frees them.
  register_mesh(state.get());

  int rank = 0;
  SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(state->cart, &rank));
  std::vector<int> coords(ndims, 0);
  SHARDTENSOR_MPI_CHECK(MPI_Cart_coords(state->cart, rank, ndims, coords.data()));
  state->rank = rank;
  state->coordinate.assign(coords.begin(), coords.end());
  TORCH_INTERNAL_ASSERT(row_major_rank(state->shape, state->coordinate) == rank,
                        "Cartesian rank is not row-major");

  for (int d = 0; d < ndims; ++d) {
    std::vector<int> remain(ndims, 0);
    remain[d] = 1;
    Comm sub = comm_null();
    SHARDTENSOR_MPI_CHECK(MPI_Cart_sub(state->cart, remain.data(), &sub));
    state->dim_comms.push_back(sub);
    // Named for the watchdog's messages (Note [watchdog]).
    const std::string comm_name = "mesh dim " + std::to_string(d) + " ('" + state->names[d] +
                                  "') of mesh " + list_string(state->shape);
    SHARDTENSOR_MPI_CHECK(MPI_Comm_set_name(sub, comm_name.c_str()));
    int sub_rank = -1;
    SHARDTENSOR_MPI_CHECK(MPI_Comm_rank(sub, &sub_rank));
    TORCH_INTERNAL_ASSERT(sub_rank == coords[d], "sub-communicator rank ", sub_rank,
                          " differs from the coordinate ", coords[d], " on mesh dim ", d);
  }

  DeviceMesh mesh;
  mesh.state_ = std::move(state);
  return mesh;
#endif
}

DeviceMesh DeviceMesh::abstract(std::vector<int64_t> shape, std::vector<int64_t> coordinate,
                                std::vector<std::string> dim_names) {
  const std::string what = "DeviceMesh::abstract: invalid mesh shape " + list_string(shape) +
                           " with coordinate " + list_string(coordinate) + " and dim names " +
                           list_string(dim_names) + ": ";
  TORCH_CHECK(!shape.empty(), what, "the mesh needs at least one dim");
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(shape[i] >= 1, what, "entry ", i, " is ", shape[i],
                " (entries must be positive; -1 is not inferred on an abstract mesh)");
  }
  TORCH_CHECK(coordinate.size() == shape.size(), what, "the coordinate needs ", shape.size(),
              " entries");
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(coordinate[i] >= 0 && coordinate[i] < shape[i], what, "coordinate entry ", i,
                " is out of range [0, ", shape[i], ")");
  }
  const std::string names_error = names_problem(dim_names, shape.size());
  TORCH_CHECK(names_error.empty(), what, names_error);
  if (dim_names.empty()) {
    dim_names = default_names(shape.size());
  }
  auto state = std::make_shared<MeshState>();
  state->rank = static_cast<int>(row_major_rank(shape, coordinate));
  state->shape = std::move(shape);
  state->coordinate = std::move(coordinate);
  state->names = std::move(dim_names);
  state->is_abstract = true;
  DeviceMesh mesh;
  mesh.state_ = std::move(state);
  return mesh;
}

#define SHARDTENSOR_CHECK_MESH_DEFINED() \
  TORCH_CHECK(state_ != nullptr, "DeviceMesh is undefined (default-constructed)")

int64_t DeviceMesh::ndim() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return static_cast<int64_t>(state_->shape.size());
}

const std::vector<int64_t>& DeviceMesh::shape() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->shape;
}

int64_t DeviceMesh::size() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  int64_t n = 1;
  for (int64_t s : state_->shape) {
    n *= s;
  }
  return n;
}

namespace {
int64_t wrap_mesh_dim(int64_t mesh_dim, int64_t ndim, const char* fn) {
  TORCH_CHECK(mesh_dim >= -ndim && mesh_dim < ndim, "DeviceMesh::", fn, ": mesh dim ", mesh_dim,
              " is out of range for a mesh with ", ndim, " dims");
  return mesh_dim < 0 ? mesh_dim + ndim : mesh_dim;
}
}  // namespace

int64_t DeviceMesh::size(int64_t mesh_dim) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->shape[wrap_mesh_dim(mesh_dim, ndim(), "size")];
}

const std::vector<std::string>& DeviceMesh::dim_names() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->names;
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  const auto& names = state_->names;
  auto it = std::find(names.begin(), names.end(), name);
  TORCH_CHECK(it != names.end(), "DeviceMesh::dim_index: no mesh dim is named '", name,
              "'; the dims are ", list_string(names));
  return static_cast<int64_t>(it - names.begin());
}

std::vector<int64_t> DeviceMesh::coordinate() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->coordinate;
}

int DeviceMesh::rank() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->rank;
}

int DeviceMesh::rank_of(const std::vector<int64_t>& coordinate) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  const auto& shape = state_->shape;
  TORCH_CHECK(coordinate.size() == shape.size(), "DeviceMesh::rank_of: coordinate ",
              list_string(coordinate), " does not match the mesh shape ", list_string(shape));
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(coordinate[i] >= 0 && coordinate[i] < shape[i], "DeviceMesh::rank_of: coordinate ",
                list_string(coordinate), " is out of range for the mesh shape ",
                list_string(shape));
  }
  // MPI Cartesian topologies number ranks in row-major order, and the mesh is
  // created without reordering.
  return static_cast<int>(row_major_rank(shape, coordinate));
}

std::vector<int64_t> DeviceMesh::coordinate_of(int rank) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  TORCH_CHECK(rank >= 0 && rank < size(), "DeviceMesh::coordinate_of: rank ", rank,
              " is out of range for a mesh of ", size(), " ranks");
  return row_major_coordinate(state_->shape, rank);
}

bool DeviceMesh::is_abstract() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->is_abstract;
}

namespace {
void check_device_type(c10::DeviceType type, const char* fn) {
  TORCH_CHECK(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA, "DeviceMesh::", fn,
              ": device type ", c10::DeviceTypeName(type, /*lower_case=*/true),
              " is not supported (cpu or cuda)");
  TORCH_CHECK(type != c10::DeviceType::CUDA || (at::hasCUDA() && at::getNumGPUs() > 0),
              "DeviceMesh::", fn,
              ": a cuda mesh needs a CUDA device, but this process sees none (torch built "
              "without CUDA, no GPU, or CUDA_VISIBLE_DEVICES empty)");
}
}  // namespace

DeviceMesh DeviceMesh::create(c10::DeviceType device_type, std::vector<int64_t> shape,
                              std::vector<std::string> dim_names, Comm comm) {
  check_device_type(device_type, "create");
  DeviceMesh mesh = create(std::move(shape), std::move(dim_names), comm);
  mesh.state_->device_type = device_type;  // before anyone else sees the new mesh
  return mesh;
}

c10::DeviceType DeviceMesh::device_type() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  return state_->device_type;
}

c10::Device DeviceMesh::device() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  if (state_->device_type == c10::DeviceType::CPU) return c10::Device(c10::DeviceType::CPU);
  check_device_type(state_->device_type, "device");
  const auto count = static_cast<int>(at::getNumGPUs());
  return c10::Device(state_->device_type, static_cast<c10::DeviceIndex>(local_rank() % count));
}

namespace {
void check_comm_available(const MeshState& s, const char* fn) {
  TORCH_CHECK(!s.is_abstract, "DeviceMesh::", fn,
              ": an abstract mesh (DeviceMesh::abstract) has no communicators");
  TORCH_CHECK(!s.freed, "DeviceMesh::", fn,
              ": the mesh's communicators were freed by shardtensor::finalize()");
}
}  // namespace

Comm DeviceMesh::comm() const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  std::lock_guard<std::mutex> lock(state_->mutex);
  check_comm_available(*state_, "comm");
  return state_->cart;
}

Comm DeviceMesh::comm(int64_t mesh_dim) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  const int64_t d = wrap_mesh_dim(mesh_dim, ndim(), "comm");
  std::lock_guard<std::mutex> lock(state_->mutex);
  check_comm_available(*state_, "comm");
  return state_->dim_comms[d];
}

Comm DeviceMesh::comm(const std::vector<bool>& keep_dims) const {
  SHARDTENSOR_CHECK_MESH_DEFINED();
  TORCH_CHECK(static_cast<int64_t>(keep_dims.size()) == ndim(), "DeviceMesh::comm: keep_dims has ",
              keep_dims.size(), " entries for a mesh with ", ndim(), " dims");
  std::lock_guard<std::mutex> lock(state_->mutex);
  check_comm_available(*state_, "comm");
  if (std::all_of(keep_dims.begin(), keep_dims.end(), [](bool b) { return b; })) {
    return state_->cart;
  }
  auto it = state_->sub_comms.find(keep_dims);
  if (it != state_->sub_comms.end()) {
    return it->second;
  }
  Comm sub = comm_null();
  if (detail::pg::owns(state_->cart)) {
    // Every rank whose coordinate agrees with this one on the dropped dims.
    std::vector<int> members;
    const int64_t n = detail::pg::size(state_->cart);
    for (int64_t r = 0; r < n; ++r) {
      const auto c = row_major_coordinate(state_->shape, r);
      bool same = true;
      for (size_t d = 0; d < keep_dims.size(); ++d) {
        same = same && (keep_dims[d] || c[d] == state_->coordinate[d]);
      }
      if (same) members.push_back(static_cast<int>(r));
    }
    sub = detail::pg::split(state_->cart, members, "sub-mesh of " + list_string(state_->shape));
    state_->sub_comms.emplace(keep_dims, sub);
    return sub;
  }
#if SHARDTENSOR_WITH_MPI
  std::vector<int> remain(keep_dims.begin(), keep_dims.end());
  SHARDTENSOR_MPI_CHECK(MPI_Cart_sub(state_->cart, remain.data(), &sub));
  state_->sub_comms.emplace(keep_dims, sub);
#endif
  return sub;
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  if (state_ == other.state_) {
    return true;
  }
  if (state_ == nullptr || other.state_ == nullptr) {
    return false;
  }
  if (state_->is_abstract && other.state_->is_abstract) {
    return state_->shape == other.state_->shape && state_->names == other.state_->names &&
           state_->coordinate == other.state_->coordinate;
  }
  return false;
}

std::string DeviceMesh::to_string() const {
  if (state_ == nullptr) {
    return "DeviceMesh(undefined)";
  }
  std::ostringstream os;
  os << "DeviceMesh(shape=" << list_string(state_->shape)
     << ", names=" << list_string(state_->names)
     << ", coordinate=" << list_string(state_->coordinate) << ", rank=" << state_->rank;
  if (state_->is_abstract) {
    os << ", abstract";
  }
  if (state_->device_type != c10::DeviceType::CPU) {
    os << ", device_type=" << c10::DeviceTypeName(state_->device_type, /*lower_case=*/true);
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh) {
  return os << mesh.to_string();
}

}  // namespace shardtensor
