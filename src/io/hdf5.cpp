// Parallel HDF5 hyperslab reads and writes of sharded fields (io/hdf5.h).
//
// Every rank makes the same HDF5 calls in the same order: file open/create,
// dataset open/create/delete, attribute writes and the one H5Dread/H5Dwrite
// per dataset are collective under MPI-IO (a rank with nothing to move takes
// part with an empty selection). Every check that could fail on one rank only
// is agreed with comm::check_all before the next HDF5 call (Note [io errors]).
// io/ moves no data over MPI itself; mesh.comm() goes to H5Pset_fapl_mpio only.
#include "core/process_groups.h"

#include <hdf5.h>
#include <shardtensor/core/stats.h>
#include <shardtensor/io/hdf5.h>
#include <shardtensor/tensor/shard_tensor.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "comm/agree.h"
#include "comm/blocking.h"
#include "io/h5.h"

#ifndef H5_HAVE_PARALLEL
#define SHARDTENSOR_HDF5_SERIAL 1
#endif

namespace shardtensor::io {

namespace detail {

namespace {

/// Bounds one collective HDF5 call under MPI-IO with the watchdog (Note
/// [watchdog]): the call blocks inside MPI-IO, where the transport cannot
/// poll, so a rank that never joins it ends the job instead of hanging it.
/// Nothing for a file without a mesh.
class Collective {
 public:
  Collective(const std::optional<DeviceMesh>& mesh, const char* what) {
    if (mesh) scope_.emplace(what, mesh->comm());
  }

 private:
  std::optional<comm::watchdog::BlockingScope> scope_;
};

/// Silences HDF5's automatic error-stack printing for the guard's lifetime
/// (failures are reported as c10::Error with the stack's message instead).
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

/// The innermost message on HDF5's error stack (where the failure started), then clears it.
std::string h5_error() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* s = static_cast<std::string*>(data);
        if (e->desc != nullptr && e->desc[0] != '\0') {
          *s = e->desc;  // the last one visited (downward) is the innermost
        }
        return 0;
      },
      &out);
  H5Eclear2(H5E_DEFAULT);
  return out.empty() ? std::string("HDF5 error") : "HDF5: " + out;
}

/// Owns one HDF5 handle.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer close) : id_(id), close_(close) {}
  ~Hid() { reset(); }
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = -1;
    }
    return *this;
  }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  hid_t get() const { return id_; }
  hid_t release() {
    hid_t id = id_;
    id_ = -1;
    return id;
  }
  bool ok() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0 && close_ != nullptr) close_(id_);
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

/// Runs `fn`; the message of a c10::Error it throws, or "" (so that a local
/// check can be agreed over the mesh instead of throwing on one rank).
std::string capture(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

std::string strip_slash(const std::string& name) {
  size_t b = 0;
  while (b < name.size() && name[b] == '/') ++b;
  return name.substr(b);
}

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

/// HDF5 memory type of a dtype that HDF5 reads/writes directly, or -1.
hid_t mem_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return H5T_NATIVE_FLOAT;
    case at::kDouble:
      return H5T_NATIVE_DOUBLE;
    case at::kInt:
      return H5T_NATIVE_INT32;
    case at::kLong:
      return H5T_NATIVE_INT64;
    case at::kShort:
      return H5T_NATIVE_INT16;
    case at::kChar:
      return H5T_NATIVE_INT8;
    case at::kByte:
      return H5T_NATIVE_UINT8;
    default:
      return -1;
  }
}

/// The dtype HDF5 moves for a requested dtype (Half/BFloat16 through Float,
/// Bool through Byte); throws for dtypes with no HDF5 counterpart.
at::ScalarType transfer_dtype(at::ScalarType t) {
  if (t == at::kHalf || t == at::kBFloat16) return at::kFloat;
  if (t == at::kBool) return at::kByte;
  TORCH_CHECK(mem_type(t) >= 0, "dtype ", c10::toString(t), " has no HDF5 counterpart");
  return t;
}

struct FileType {
  H5T_class_t cls = H5T_NO_CLASS;
  size_t size = 0;
  bool is_signed = true;
};

FileType file_type(hid_t type) {
  FileType f;
  f.cls = H5Tget_class(type);
  f.size = H5Tget_size(type);
  if (f.cls == H5T_INTEGER) f.is_signed = H5Tget_sign(type) == H5T_SGN_2;
  return f;
}

std::string class_name(H5T_class_t c) {
  switch (c) {
    case H5T_INTEGER:
      return "integer";
    case H5T_FLOAT:
      return "float";
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ENUM:
      return "enum";
    case H5T_ARRAY:
      return "array";
    case H5T_VLEN:
      return "variable-length";
    case H5T_OPAQUE:
      return "opaque";
    case H5T_REFERENCE:
      return "reference";
    case H5T_BITFIELD:
      return "bitfield";
    case H5T_TIME:
      return "time";
    default:
      return "unknown";
  }
}

/// The dataset's default dtype; throws if its type is not an integer or float type.
at::ScalarType default_dtype(const FileType& f) {
  if (f.cls == H5T_FLOAT) {
    TORCH_CHECK(f.size == 2 || f.size == 4 || f.size == 8, "the dataset's ", 8 * f.size,
                "-bit float type cannot convert to a tensor dtype");
    return f.size == 8 ? at::kDouble : at::kFloat;
  }
  TORCH_CHECK(f.cls == H5T_INTEGER, "the dataset's type (", class_name(f.cls),
              ") cannot convert to a tensor dtype: only integer and float datasets are read");
  if (f.is_signed) {
    switch (f.size) {
      case 1:
        return at::kChar;
      case 2:
        return at::kShort;
      case 4:
        return at::kInt;
      case 8:
        return at::kLong;
    }
  } else {
    switch (f.size) {
      case 1:
        return at::kByte;
      case 2:
        return at::kInt;
      case 4:
        return at::kLong;
    }
  }
  TORCH_CHECK(false, "the dataset's ", f.is_signed ? "" : "un", "signed ", 8 * f.size,
              "-bit integer type has no tensor dtype: pass ReadOptions().dtype(...)");
}

void check_convertible(const FileType& f, at::ScalarType to) {
  default_dtype(f);  // throws for non-numeric types
  transfer_dtype(to);
  TORCH_CHECK(!(f.cls == H5T_FLOAT && !at::isFloatingType(to)),
              "the dataset's float type cannot convert to ", c10::toString(to),
              " (truncation to an integer is refused; read as a float dtype and convert)");
}

std::vector<int64_t> space_shape(hid_t space) {
  const int nd = H5Sget_simple_extent_ndims(space);
  TORCH_CHECK(nd >= 0, "cannot read the dataset's dataspace: ", h5_error());
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

Hid make_space(const std::vector<int64_t>& shape) {
  if (shape.empty()) return Hid(H5Screate(H5S_SCALAR), H5Sclose);
  std::vector<hsize_t> d(shape.begin(), shape.end());
  return Hid(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), H5Sclose);
}

Hid make_dxpl(const File& file, Transfer transfer) {
  Hid dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
#ifndef SHARDTENSOR_HDF5_SERIAL
  if (file.mesh()) {
    H5Pset_dxpl_mpio(dxpl.get(), transfer == Transfer::Collective ? H5FD_MPIO_COLLECTIVE
                                                                  : H5FD_MPIO_INDEPENDENT);
  }
#endif
  return dxpl;
}

/// Sorted maximal runs [begin, end) of the sorted unique values in `u`.
std::vector<std::pair<int64_t, int64_t>> runs_of(const std::vector<int64_t>& u) {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (int64_t v : u) {
    if (!r.empty() && r.back().second == v) {
      ++r.back().second;
    } else {
      r.emplace_back(v, v + 1);
    }
  }
  return r;
}

/// Selects the union of the products of per-dim runs (offset by `start`) in `space`.
/// Returns false if an HDF5 call failed.
bool select_runs(hid_t space, const std::vector<std::vector<std::pair<int64_t, int64_t>>>& runs,
                 const std::vector<int64_t>& start) {
  const size_t nd = runs.size();
  std::vector<size_t> pick(nd, 0);
  bool first = true;
  while (true) {
    std::vector<hsize_t> off(nd), cnt(nd);
    for (size_t d = 0; d < nd; ++d) {
      off[d] = static_cast<hsize_t>(start[d] + runs[d][pick[d]].first);
      cnt[d] = static_cast<hsize_t>(runs[d][pick[d]].second - runs[d][pick[d]].first);
    }
    if (H5Sselect_hyperslab(space, first ? H5S_SELECT_SET : H5S_SELECT_OR, off.data(), nullptr,
                            cnt.data(), nullptr) < 0) {
      return false;
    }
    first = false;
    size_t d = nd;
    while (d > 0) {
      --d;
      if (++pick[d] < runs[d].size()) break;
      pick[d] = 0;
      if (d == 0) return true;
    }
    if (nd == 0) return true;
  }
}

void write_string_attr(hid_t obj, const std::string& name, const std::string& value) {
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(1, value.size()));
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose);
  TORCH_CHECK(attr.ok(), "cannot create attribute '", name, "': ", h5_error());
  std::string buf = value.empty() ? std::string(1, '\0') : value;
  TORCH_CHECK(H5Awrite(attr.get(), type.get(), buf.data()) >= 0, "cannot write attribute '", name,
              "': ", h5_error());
}

void write_ints_attr(hid_t obj, const std::string& name, const std::vector<int64_t>& value) {
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  Hid space = value.empty() ? Hid(H5Screate(H5S_NULL), H5Sclose)
                            : make_space({static_cast<int64_t>(value.size())});
  Hid attr(H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose);
  TORCH_CHECK(attr.ok(), "cannot create attribute '", name, "': ", h5_error());
  if (!value.empty()) {
    TORCH_CHECK(H5Awrite(attr.get(), H5T_NATIVE_INT64, value.data()) >= 0,
                "cannot write attribute '", name, "': ", h5_error());
  }
}

/// A string attribute (fixed or variable length), "" if absent or not a string.
std::string read_string_attr(hid_t obj, const std::string& name) {
  if (H5Aexists(obj, name.c_str()) <= 0) return {};
  Hid attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!attr.ok()) return {};
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING) return {};
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) return {};
  if (H5Tis_variable_str(type.get()) > 0) {
    Hid mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt.get(), H5T_VARIABLE);
    char* s = nullptr;
    if (H5Aread(attr.get(), mt.get(), &s) < 0 || s == nullptr) return {};
    std::string out(s);
    H5free_memory(s);
    return out;
  }
  const size_t n = H5Tget_size(type.get());
  std::string buf(n, '\0');
  if (H5Aread(attr.get(), type.get(), buf.data()) < 0) return {};
  buf.resize(std::strlen(buf.c_str()));
  return buf;
}

std::vector<int64_t> read_ints_attr(hid_t obj, const std::string& name) {
  if (H5Aexists(obj, name.c_str()) <= 0) return {};
  Hid attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!attr.ok()) return {};
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n <= 0 || H5Sget_simple_extent_type(space.get()) == H5S_NULL) return {};
  std::vector<int64_t> v(static_cast<size_t>(n));
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()) < 0) return {};
  return v;
}

/// Opens dataset `name` of `file`, agreeing on failure. Every rank walks the
/// path components so that a missing group says which one.
Hid open_dataset(File& file, const std::string& name, const std::string& what) {
  const std::string n = strip_slash(name);
  std::string err;
  if (n.empty()) {
    err = "empty dataset name";
  } else if (!file.exists(n)) {
    err = "no dataset '" + n + "' in file '" + file.path() + "'";
  }
  file.agree(err.empty(), what, err);
  Hid dset(H5Dopen2(file.id(), n.c_str(), H5P_DEFAULT), H5Dclose);
  file.agree(dset.ok(), what,
             "'" + n + "' in file '" + file.path() + "' is not a readable dataset (" +
                 (dset.ok() ? std::string() : h5_error()) + ")");
  return dset;
}

}  // namespace

std::string describe(const char* what, const std::string& path, const std::string& dataset) {
  return std::string(what) + "('" + path + "', '" + dataset + "')";
}

// ---- File -----------------------------------------------------------------------------

File::File(const std::string& path, const std::optional<DeviceMesh>& mesh, OpenMode mode,
           const std::string& context)
    : path_(path), mesh_(mesh) {
  QuietHdf5 quiet;
  const std::string what =
      context.empty() ? "open HDF5 file '" + path + "'" : context + ": file '" + path + "'";
#ifdef SHARDTENSOR_HDF5_SERIAL
  if (mesh_) {
    // Every rank sees the same build, so every rank throws here.
    TORCH_CHECK(false, what,
                ": shardtensor was built against a serial HDF5 (no H5_HAVE_PARALLEL); "
                "parallel reads and writes need libhdf5-openmpi-dev");
  }
#endif
  // Parallel HDF5 runs on MPI-IO, which needs the mesh's MPI communicator;
  // under the c10d transport (torchrun) there is none (Note [c10d handles]).
  // Every rank's mesh is on the same transport, so every rank throws here.
  TORCH_CHECK(!mesh_ || !shardtensor::detail::pg::owns(mesh_->comm()), what,
              ": parallel HDF5 (MPI-IO) needs the MPI transport, but this job runs on the c10d "
              "transport (Gloo; a torchrun launch or SHARDTENSOR_BACKEND=gloo): launch with "
              "mpirun/srun for HDF5 reads, writes and checkpoints");
  // Does the file exist? Rank 0's view decides for writers (all ranks must
  // then make the same open-or-create call); every reader checks its own.
  bool exists = ::access(path.c_str(), F_OK) == 0;
  const int saved_errno = errno;
  if (mode == OpenMode::Read) {
    agree(exists, what, "no such file (" + std::string(std::strerror(saved_errno)) + ")");
    agree(::access(path.c_str(), R_OK) == 0, what, "file not readable");
  } else if (mesh_) {
    exists = comm::broadcast_record(*mesh_, {exists ? 1 : 0}, 0).at(0) != 0;
  }
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
#ifndef SHARDTENSOR_HDF5_SERIAL
  if (mesh_) {
    // The one place io/ hands the mesh's communicator to a library: HDF5's
    // MPI-IO driver needs it (docs/architecture.md, "io/ and MPI").
    H5Pset_fapl_mpio(fapl.get(), mesh_->comm(), MPI_INFO_NULL);
  }
#endif
  hid_t id = -1;
  {
    Collective bound(mesh_, "H5Fopen/H5Fcreate (collective MPI-IO file open)");
    if (mode == OpenMode::Read) {
      id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get());
    } else if (mode == OpenMode::ReadWrite && exists) {
      id = H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl.get());
    } else {
      id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
    }
  }
  std::string err;
  if (id < 0) {
    err = std::string(mode == OpenMode::Read ? "not an HDF5 file or cannot be opened ("
                                             : "cannot open or create it for writing (") +
          h5_error() + ")";
  }
  if (mesh_) {
    if (!comm::all_ok(*mesh_, id >= 0)) {
      // Failed somewhere: ranks that did open close again, then all raise
      // the failing rank's message.
      if (id >= 0) H5Fclose(id);
      comm::check_all(*mesh_, id >= 0, what, err);
      TORCH_CHECK(false, what, ": the open failed on another rank");
    }
  } else {
    TORCH_CHECK(id >= 0, what, ": ", err);
  }
  id_ = id;
  fapl_ = fapl.release();
}

File::~File() {
  if (id_ >= 0) {
    QuietHdf5 quiet;
    Collective bound(mesh_, "H5Fclose (collective MPI-IO file close)");
    H5Fclose(static_cast<hid_t>(id_));
  }
  if (fapl_ >= 0) H5Pclose(static_cast<hid_t>(fapl_));
}

void File::close() {
  QuietHdf5 quiet;
  herr_t rc = 0;
  if (id_ >= 0) {
    Collective bound(mesh_, "H5Fclose (collective MPI-IO file close)");
    rc = H5Fclose(static_cast<hid_t>(id_));
  }
  id_ = -1;
  agree(rc >= 0, "close HDF5 file '" + path_ + "'",
        rc >= 0 ? std::string() : "H5Fclose failed (" + h5_error() + ")");
}

void File::agree(bool ok, const std::string& what, const std::string& message) const {
  if (mesh_) {
    comm::check_all(*mesh_, ok, what, message);
  } else {
    TORCH_CHECK(ok, what, ": ", message);
  }
}

bool File::exists(const std::string& dataset) const {
  QuietHdf5 quiet;
  const std::string n = strip_slash(dataset);
  if (n.empty()) return false;
  size_t pos = 0;
  while (true) {
    const size_t slash = n.find('/', pos);
    const std::string prefix = n.substr(0, slash);
    if (H5Lexists(static_cast<hid_t>(id_), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (slash == std::string::npos) return true;
    pos = slash + 1;
  }
}

// ---- read -----------------------------------------------------------------------------

HaloRead read_dataset(File& file, const std::string& dataset, const DeviceMesh& mesh,
                      Placements placements, const ReadOptions& opts, bool with_halo) {
  QuietHdf5 quiet;
  const std::string what =
      describe(with_halo ? "read_hdf5_with_halo" : "read_hdf5", file.path(), dataset);
  Hid dset = open_dataset(file, dataset, what);
  Hid ftype(H5Dget_type(dset.get()), H5Tclose);
  Hid fspace(H5Dget_space(dset.get()), H5Sclose);

  // Everything below until the read is arithmetic on metadata that every rank
  // sees identically; it is still agreed, so nothing can throw on one rank alone.
  FileType ft;
  std::vector<int64_t> file_shape, start, global;
  at::ScalarType dtype = at::kFloat, moved = at::kFloat;
  std::shared_ptr<const ShardSpec> spec;
  std::vector<std::vector<int64_t>>
      gidx;  // per dim: file index (in the box) of each output position, -1 = zero
  std::vector<std::vector<int64_t>> uniq;  // per dim: sorted distinct file indices to read
  std::vector<int64_t> left, right;
  std::string err = capture([&] {
    TORCH_CHECK(ftype.ok() && fspace.ok(),
                "cannot read the dataset's type or dataspace: ", h5_error());
    ft = file_type(ftype.get());
    file_shape = space_shape(fspace.get());
    const int64_t nd = static_cast<int64_t>(file_shape.size());
    dtype = opts.dtype() ? *opts.dtype() : default_dtype(ft);
    check_convertible(ft, dtype);
    moved = transfer_dtype(dtype);
    start.assign(nd, 0);
    global = file_shape;
    if (opts.select()) {
      const auto& sel = *opts.select();
      TORCH_CHECK(static_cast<int64_t>(sel.start.size()) == nd &&
                      static_cast<int64_t>(sel.count.size()) == nd,
                  "select has start ", join(sel.start), " and count ", join(sel.count),
                  " but the dataset has ", nd, " dims (shape ", join(file_shape), ")");
      for (int64_t d = 0; d < nd; ++d) {
        const int64_t s = sel.start[d], c = sel.count[d] == -1 ? file_shape[d] - s : sel.count[d];
        TORCH_CHECK(s >= 0 && c >= 0 && s + c <= file_shape[d], "select start ", join(sel.start),
                    " count ", join(sel.count), " is outside the dataset's shape ",
                    join(file_shape), " (dim ", d, ")");
        start[d] = s;
        global[d] = c;
      }
    }
    TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "got ", placements.size(),
                " placements ", to_string(placements), " for a mesh of ", mesh.ndim(), " dims");
    for (const auto& p : placements) {
      TORCH_CHECK(!is_partial(p), "cannot read into a Partial placement ", to_string(placements));
      TORCH_CHECK(!is_shard(p) || (shard_dim(p) >= -nd && shard_dim(p) < nd), "placements ",
                  to_string(placements), " shard a dim that the dataset of shape ", join(global),
                  " (", nd, " dims) does not have");
    }
    spec = std::make_shared<const ShardSpec>(mesh, placements, global, opts.sizes());
    const auto& halo = opts.halo();
    TORCH_CHECK(with_halo || halo.empty(),
                "ReadOptions().halo() is set: use read_hdf5_with_halo to get the halo");
    TORCH_CHECK(halo.empty() || static_cast<int64_t>(halo.size()) == nd, "halo ", join(halo),
                " needs one width per dataset dim (", nd, ")");
    const auto off = spec->local_offsets(), len = spec->local_shape();
    gidx.resize(nd);
    uniq.resize(nd);
    left.assign(nd, 0);
    right.assign(nd, 0);
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t h = halo.empty() ? 0 : halo[d], n = global[d];
      TORCH_CHECK(h >= 0, "halo widths must be >= 0, got ", join(halo));
      int64_t lo = off[d] - h, hi = off[d] + len[d] + h;
      if (h > 0 && opts.halo_mode() == HaloMode::None) {
        lo = std::max<int64_t>(lo, 0);
        hi = std::min<int64_t>(hi, n);
      }
      TORCH_CHECK(h == 0 || n > 0 || opts.halo_mode() == HaloMode::Zeros ||
                      opts.halo_mode() == HaloMode::None,
                  "a replicate or circular halo needs a non-empty extent, dim ", d,
                  " has extent 0");
      left[d] = off[d] - lo;
      right[d] = hi - off[d] - len[d];
      for (int64_t i = lo; i < hi; ++i) {
        int64_t g = i;
        if (g < 0 || g >= n) {
          switch (opts.halo_mode()) {
            case HaloMode::Zeros:
            case HaloMode::None:
              g = -1;
              break;
            case HaloMode::Replicate:
              g = std::clamp<int64_t>(g, 0, n - 1);
              break;
            case HaloMode::Circular:
              g = ((g % n) + n) % n;
              break;
          }
        }
        gidx[d].push_back(g);
        if (g >= 0) uniq[d].push_back(g);
      }
      std::sort(uniq[d].begin(), uniq[d].end());
      uniq[d].erase(std::unique(uniq[d].begin(), uniq[d].end()), uniq[d].end());
    }
  });
  file.agree(err.empty(), what, err);

  // Selections: the union of the runs in the file, a dense box in memory.
  const int64_t nd = static_cast<int64_t>(global.size());
  std::vector<int64_t> box(nd);
  int64_t npoints = 1;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(nd);
  for (int64_t d = 0; d < nd; ++d) {
    box[d] = static_cast<int64_t>(uniq[d].size());
    npoints *= box[d];
    runs[d] = runs_of(uniq[d]);
  }
  at::Tensor buf = at::empty(box, at::TensorOptions().dtype(moved));
  Hid mspace = npoints > 0 ? make_space(box) : make_space({1});
  bool sel_ok = true;
  if (npoints == 0) {
    sel_ok = H5Sselect_none(fspace.get()) >= 0 && H5Sselect_none(mspace.get()) >= 0;
  } else if (nd > 0) {
    sel_ok = select_runs(fspace.get(), runs, start);
  }
  // Note [overlapping collective reads]: Open MPI 4.1's OMPIO returned wrong
  // data (tests/test_io.cpp, ReadHdf5.Halo* on a 2x2 mesh; ROMIO was right)
  // for collective reads whose non-contiguous selections overlap across
  // ranks, which halos make them do. Halo reads therefore use independent
  // transfers; reads without halo (disjoint or identical selections) keep
  // the requested mode.
  bool any_halo = false;
  for (int64_t h : opts.halo()) any_halo = any_halo || h > 0;
  Hid dxpl = make_dxpl(file, any_halo ? Transfer::Independent : opts.transfer());
  // Selections fail only on arguments the agreed checks above rule out; a
  // rank whose selection failed still joins the collective read with an
  // empty selection, and the verdict below is agreed.
  if (!sel_ok) {
    H5Sselect_none(fspace.get());
    H5Sselect_none(mspace.get());
  }
  herr_t rc = -1;
  {
    Collective bound(file.mesh(), "H5Dread (collective MPI-IO read)");
    rc = H5Dread(dset.get(), mem_type(moved), mspace.get(), fspace.get(), dxpl.get(),
                 npoints > 0 && sel_ok ? buf.data_ptr() : nullptr);
  }
  if (!sel_ok) rc = -1;
  file.agree(rc >= 0, what, "H5Dread failed (" + (rc >= 0 ? std::string() : h5_error()) + ")");
  shardtensor::detail::record_io(npoints * static_cast<int64_t>(ft.size), 0, 1, 0);

  // Ghost cells: gather each output position from the box (zeros for -1).
  at::Tensor out = buf;
  for (int64_t d = 0; d < nd; ++d) {
    const auto& g = gidx[d];
    bool identity = static_cast<int64_t>(g.size()) == box[d];
    for (size_t i = 0; identity && i < g.size(); ++i) identity = g[i] == uniq[d][i];
    if (identity) continue;
    std::vector<int64_t> pos(g.size());
    bool zeros = false;
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] < 0) {
        pos[i] = box[d];
        zeros = true;
      } else {
        pos[i] = std::lower_bound(uniq[d].begin(), uniq[d].end(), g[i]) - uniq[d].begin();
      }
    }
    if (zeros) {
      auto zshape = out.sizes().vec();
      zshape[d] = 1;
      out = at::cat({out, at::zeros(zshape, out.options())}, d);
    }
    out = out.index_select(d, at::tensor(pos, at::TensorOptions().dtype(at::kLong)));
  }
  if (moved != dtype) out = dtype == at::kBool ? out.ne(0) : out.to(dtype);
  out = out.contiguous();

  HaloRead r;
  at::Tensor local = out;
  const auto len = spec->local_shape();
  for (int64_t d = 0; d < nd; ++d) local = local.narrow(d, left[d], len[d]);
  local = local.contiguous();
  r.tensor = ShardTensor::from_local_unchecked(local, spec);
  r.with_halo = out;
  r.halo_left = left;
  r.halo_right = right;
  return r;
}

// ---- write ----------------------------------------------------------------------------

void write_dataset(File& file, const std::string& dataset, const at::Tensor& tensor,
                   const WriteOptions& opts) {
  QuietHdf5 quiet;
  const std::string what = describe("write_hdf5", file.path(), dataset);
  const std::string name = strip_slash(dataset);
  at::Tensor local;
  std::vector<int64_t> global, offsets, mesh_shape;
  std::string placements_str;
  bool writer = true;
  at::ScalarType moved = at::kFloat;
  std::vector<int64_t> chunks;
  std::string err = capture([&] {
    TORCH_CHECK(!name.empty(), "empty dataset name");
    TORCH_CHECK(tensor.defined(), "the tensor is undefined");
    if (ShardTensor::is_shard_tensor(tensor)) {
      ShardTensor st(tensor);
      TORCH_CHECK(file.mesh() && st.spec().mesh() == *file.mesh(),
                  "the ShardTensor's mesh is not the mesh the file was opened on");
      if (st.spec().has_partial()) {
        // Metadata identical everywhere, so every rank makes this collective.
        Placements p = st.spec().placements();
        for (auto& q : p) {
          if (is_partial(q)) q = Replicate{};
        }
        st = ShardTensor(st.redistribute(p));
      }
      const ShardSpec& spec = st.spec();
      local = st.local();
      global = spec.global_shape();
      offsets = spec.local_offsets();
      mesh_shape = spec.mesh().shape();
      placements_str = to_string(spec.placements());
      const auto coord = spec.mesh().coordinate();
      for (int64_t m = 0; m < spec.mesh().ndim(); ++m) {
        if (!is_shard(spec.placements()[m]) && coord[m] != 0) writer = false;
      }
    } else {
      local = tensor;
      global = tensor.sizes().vec();
      offsets.assign(global.size(), 0);
      writer = !file.mesh() || file.mesh()->rank() == 0;
    }
    TORCH_CHECK(local.device().is_cpu(), "only CPU tensors are written, got ", local.device());
    moved = transfer_dtype(local.scalar_type());
    local = local.detach().to(moved).contiguous();
    const int64_t nd = static_cast<int64_t>(global.size());
    chunks = opts.chunks();
    if (!chunks.empty()) {
      TORCH_CHECK(static_cast<int64_t>(chunks.size()) == nd, "chunks ", join(chunks),
                  " needs one entry per dim of the shape ", join(global));
      bool empty = false;
      for (int64_t d = 0; d < nd; ++d) {
        TORCH_CHECK(chunks[d] >= 1, "chunk extents must be >= 1, got ", join(chunks));
        chunks[d] = std::min(chunks[d], std::max<int64_t>(global[d], 1));
        empty = empty || global[d] == 0;
      }
      if (empty || nd == 0) chunks.clear();  // HDF5 cannot chunk an empty or scalar dataset
    }
  });
  file.agree(err.empty(), what, err);
  // A ShardTensor's local pieces are consistent by construction; a plain
  // tensor written collectively must at least agree on its shape.
  if (file.mesh() && !ShardTensor::is_shard_tensor(tensor)) {
    auto recs = comm::all_gather_records(*file.mesh(), global);
    bool same = true;
    for (const auto& r : recs) same = same && r == recs[0];
    file.agree(same, what,
               "the plain tensor's shape " + join(global) + " differs across the ranks");
  }

  const bool exists = file.exists(name);
  file.agree(!exists || opts.overwrite(), what,
             "dataset '" + name + "' exists in '" + file.path() + "' and overwrite is false");
  if (exists) {
    const herr_t rc = H5Ldelete(static_cast<hid_t>(file.id()), name.c_str(), H5P_DEFAULT);
    file.agree(rc >= 0, what,
               "cannot replace the existing dataset (" + (rc >= 0 ? "" : h5_error()) + ")");
  }
  Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!chunks.empty()) {
    std::vector<hsize_t> c(chunks.begin(), chunks.end());
    H5Pset_chunk(dcpl.get(), static_cast<int>(c.size()), c.data());
  }
  Hid fspace = make_space(global);
  const hid_t type = mem_type(moved);
  std::optional<Collective> create_bound(std::in_place, file.mesh(),
                                         "H5Dcreate2 (collective dataset creation)");
  Hid dset(H5Dcreate2(static_cast<hid_t>(file.id()), name.c_str(), type, fspace.get(), lcpl.get(),
                      dcpl.get(), H5P_DEFAULT),
           H5Dclose);
  create_bound.reset();
  file.agree(dset.ok(), what,
             "cannot create the dataset (" + (dset.ok() ? std::string() : h5_error()) + ")");
  err = capture([&] {
    write_ints_attr(dset.get(), "global_shape", global);
    write_string_attr(dset.get(), "placements", placements_str);
    write_ints_attr(dset.get(), "mesh_shape", mesh_shape);
    write_string_attr(dset.get(), "torch_dtype", c10::toString(tensor.scalar_type()));
    if (!opts.units().empty()) write_string_attr(dset.get(), "units", opts.units());
  });
  file.agree(err.empty(), what, err);

  const int64_t nd = static_cast<int64_t>(global.size());
  const int64_t npoints = writer ? local.numel() : 0;
  Hid mspace = npoints > 0 ? make_space(local.sizes().vec()) : make_space({1});
  bool sel_ok = true;
  if (npoints == 0) {
    sel_ok = H5Sselect_none(fspace.get()) >= 0 && H5Sselect_none(mspace.get()) >= 0;
  } else if (nd > 0) {
    std::vector<hsize_t> off(offsets.begin(), offsets.end());
    std::vector<hsize_t> cnt(local.sizes().begin(), local.sizes().end());
    sel_ok = H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, off.data(), nullptr, cnt.data(),
                                 nullptr) >= 0;
  }
  if (!sel_ok) {
    H5Sselect_none(fspace.get());
    H5Sselect_none(mspace.get());
  }
  Hid dxpl = make_dxpl(file, opts.transfer());
  herr_t rc = -1;
  {
    Collective bound(file.mesh(), "H5Dwrite (collective MPI-IO write)");
    rc = H5Dwrite(dset.get(), type, mspace.get(), fspace.get(), dxpl.get(),
                  npoints > 0 && sel_ok ? local.data_ptr() : nullptr);
  }
  if (!sel_ok) rc = -1;
  file.agree(rc >= 0, what, "H5Dwrite failed (" + (rc >= 0 ? std::string() : h5_error()) + ")");
  shardtensor::detail::record_io(0, sel_ok ? npoints * local.element_size() : 0, 0, 1);
}

DatasetInfo dataset_info(File& file, const std::string& dataset) {
  QuietHdf5 quiet;
  const std::string what = describe("read_hdf5_info", file.path(), dataset);
  Hid dset = open_dataset(file, dataset, what);
  DatasetInfo info;
  std::string err = capture([&] {
    Hid ftype(H5Dget_type(dset.get()), H5Tclose);
    Hid fspace(H5Dget_space(dset.get()), H5Sclose);
    TORCH_CHECK(ftype.ok() && fspace.ok(),
                "cannot read the dataset's type or dataspace: ", h5_error());
    info.shape = space_shape(fspace.get());
    info.dtype = default_dtype(file_type(ftype.get()));
    info.placements = read_string_attr(dset.get(), "placements");
    info.mesh_shape = read_ints_attr(dset.get(), "mesh_shape");
    info.torch_dtype = read_string_attr(dset.get(), "torch_dtype");
    info.units = read_string_attr(dset.get(), "units");
  });
  file.agree(err.empty(), what, err);
  return info;
}

void write_root_int(File& file, const std::string& name, int64_t value) {
  QuietHdf5 quiet;
  Hid root(H5Gopen2(static_cast<hid_t>(file.id()), "/", H5P_DEFAULT), H5Gclose);
  std::string err = capture([&] { write_ints_attr(root.get(), name, {value}); });
  file.agree(err.empty(), "write attribute '" + name + "' of '" + file.path() + "'", err);
}

int64_t read_root_int(File& file, const std::string& name) {
  QuietHdf5 quiet;
  Hid root(H5Gopen2(static_cast<hid_t>(file.id()), "/", H5P_DEFAULT), H5Gclose);
  auto v = read_ints_attr(root.get(), name);
  file.agree(v.size() == 1, "read attribute '" + name + "' of '" + file.path() + "'",
             "missing or not one integer");
  return v[0];
}

std::vector<std::string> list_group(File& file, const std::string& group) {
  QuietHdf5 quiet;
  std::vector<std::string> names;
  if (!file.exists(group)) return names;
  Hid g(H5Gopen2(static_cast<hid_t>(file.id()), strip_slash(group).c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.ok()) return names;
  H5Literate(
      g.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->emplace_back(name);
        return 0;
      },
      &names);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace detail

// ---- public ---------------------------------------------------------------------------

at::Tensor read_hdf5(const std::string& path, const std::string& dataset, const DeviceMesh& mesh,
                     Placements placements, const ReadOptions& opts) {
  detail::File file(path, mesh, detail::OpenMode::Read,
                    detail::describe("read_hdf5", path, dataset));
  auto r = detail::read_dataset(file, dataset, mesh, std::move(placements), opts, false);
  file.close();
  return r.tensor;
}

HaloRead read_hdf5_with_halo(const std::string& path, const std::string& dataset,
                             const DeviceMesh& mesh, Placements placements,
                             const ReadOptions& opts) {
  detail::File file(path, mesh, detail::OpenMode::Read,
                    detail::describe("read_hdf5_with_halo", path, dataset));
  auto r = detail::read_dataset(file, dataset, mesh, std::move(placements), opts, true);
  file.close();
  return r;
}

void write_hdf5(const std::string& path, const std::string& dataset, const at::Tensor& tensor,
                const WriteOptions& opts) {
  std::optional<DeviceMesh> mesh = opts.mesh();
  const at::Tensor& t = tensor;
  if (ShardTensor::is_shard_tensor(t)) mesh = ShardTensor(t).spec().mesh();
  detail::File file(path, mesh,
                    opts.truncate() ? detail::OpenMode::Truncate : detail::OpenMode::ReadWrite,
                    detail::describe("write_hdf5", path, dataset));
  detail::write_dataset(file, dataset, t, opts);
  file.close();
}

DatasetInfo read_hdf5_info(const std::string& path, const std::string& dataset,
                           const DeviceMesh& mesh) {
  detail::File file(path, mesh, detail::OpenMode::Read,
                    detail::describe("read_hdf5_info", path, dataset));
  auto info = detail::dataset_info(file, dataset);
  file.close();
  return info;
}

}  // namespace shardtensor::io
