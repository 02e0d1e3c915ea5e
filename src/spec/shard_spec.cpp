#include <c10/util/Exception.h>
#include <shardtensor/spec/shard_spec.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace shardtensor {

namespace {

std::string list_string(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    os << (i ? ", " : "") << v[i];
  }
  os << "]";
  return os.str();
}

std::string sizes_string(const ShardSizes& sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    os << (i ? ", " : "") << list_string(sizes[i]);
  }
  os << "]";
  return os.str();
}

}  // namespace

std::vector<int64_t> balanced_sizes(int64_t n, int64_t parts) {
  TORCH_CHECK(n >= 0, "balanced_sizes: extent ", n, " must be non-negative");
  TORCH_CHECK(parts >= 1, "balanced_sizes: cannot split over ", parts, " parts");
  std::vector<int64_t> sizes(parts, n / parts);
  for (int64_t i = 0; i < n % parts; ++i) {
    ++sizes[i];
  }
  return sizes;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  int64_t acc = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    offsets[i] = acc;
    acc += sizes[i];
  }
  return offsets;
}

ShardSpec::ShardSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> global_shape,
                     std::optional<ShardSizes> sizes)
    : mesh_(std::move(mesh)),
      placements_(std::move(placements)),
      global_shape_(std::move(global_shape)) {
  TORCH_CHECK(mesh_.defined(), "ShardSpec: the mesh is undefined (default-constructed DeviceMesh)");
  const int64_t mesh_ndim = mesh_.ndim();
  const int64_t ndim = this->ndim();
  const Placements given = placements_;  // as passed, for error messages
  // Everything an error message needs to identify the offending layout.
  auto what = [&]() {
    std::ostringstream os;
    os << "ShardSpec(global shape " << list_string(global_shape_) << ", placements "
       << shardtensor::to_string(given) << ", mesh shape " << list_string(mesh_.shape());
    if (sizes.has_value()) {
      os << ", sizes " << sizes_string(*sizes);
    }
    os << "): ";
    return os.str();
  };
  TORCH_CHECK(static_cast<int64_t>(placements_.size()) == mesh_ndim, what(), "expected ", mesh_ndim,
              " placements (one per mesh dim), got ", placements_.size());
  for (int64_t d = 0; d < ndim; ++d) {
    TORCH_CHECK(global_shape_[d] >= 0, what(), "extent ", global_shape_[d], " of tensor dim ", d,
                " is negative");
  }
  // Normalize negative Shard dims; reject out-of-range and doubly sharded dims.
  std::vector<int64_t> sharded_by(ndim, -1);
  for (int64_t m = 0; m < mesh_ndim; ++m) {
    if (auto* s = std::get_if<Shard>(&placements_[m])) {
      TORCH_CHECK(s->dim >= -ndim && s->dim < ndim, what(), "Shard(", s->dim, ") on mesh dim ", m,
                  " is out of range for a tensor with ", ndim, " dims");
      if (s->dim < 0) {
        s->dim += ndim;
      }
      TORCH_CHECK(sharded_by[s->dim] < 0, what(), "tensor dim ", s->dim,
                  " is sharded by both mesh dim ", sharded_by[s->dim], " and mesh dim ", m);
      sharded_by[s->dim] = m;
    }
  }
  if (sizes.has_value()) {
    TORCH_CHECK(static_cast<int64_t>(sizes->size()) == mesh_ndim, what(), "expected ", mesh_ndim,
                " entries in sizes (one per mesh dim), got ", sizes->size());
    for (int64_t m = 0; m < mesh_ndim; ++m) {
      const auto& v = (*sizes)[m];
      if (!is_shard(placements_[m])) {
        TORCH_CHECK(v.empty(), what(), "sizes for mesh dim ", m, " must be empty because it is ",
                    shardtensor::to_string(placements_[m]), ", got ", list_string(v));
        continue;
      }
      const int64_t d = shard_dim(placements_[m]);
      TORCH_CHECK(static_cast<int64_t>(v.size()) == mesh_.size(m), what(), "sizes for mesh dim ", m,
                  " has ", v.size(), " entries, expected ", mesh_.size(m), " (one per coordinate)");
      int64_t total = 0;
      for (int64_t e : v) {
        TORCH_CHECK(e >= 0, what(), "sizes for mesh dim ", m, " has a negative entry ", e);
        total += e;
      }
      TORCH_CHECK(total == global_shape_[d], what(), "sizes for mesh dim ", m, " sum to ", total,
                  ", but tensor dim ", d, " has extent ", global_shape_[d]);
    }
    sizes_ = std::move(*sizes);
  } else {
    sizes_.assign(mesh_ndim, {});
    for (int64_t m = 0; m < mesh_ndim; ++m) {
      if (is_shard(placements_[m])) {
        sizes_[m] = balanced_sizes(global_shape_[shard_dim(placements_[m])], mesh_.size(m));
      }
    }
  }
}

int64_t ShardSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : global_shape_) {
    n *= s;
  }
  return n;
}

const std::vector<int64_t>& ShardSpec::shard_sizes(int64_t mesh_dim) const {
  const int64_t n = static_cast<int64_t>(sizes_.size());
  TORCH_CHECK(mesh_dim >= -n && mesh_dim < n, "ShardSpec::shard_sizes: mesh dim ", mesh_dim,
              " is out of range for a mesh with ", n, " dims");
  return sizes_[mesh_dim < 0 ? mesh_dim + n : mesh_dim];
}

std::vector<int64_t> ShardSpec::local_shape() const { return local_shape_at(mesh_.coordinate()); }

std::vector<int64_t> ShardSpec::local_offsets() const {
  return local_offsets_at(mesh_.coordinate());
}

namespace {
void check_coordinate(const ShardSpec& spec, const std::vector<int64_t>& coordinate,
                      const char* fn) {
  const auto& shape = spec.mesh().shape();
  bool ok = coordinate.size() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    ok = coordinate[i] >= 0 && coordinate[i] < shape[i];
  }
  TORCH_CHECK(ok, "ShardSpec::", fn, ": coordinate ", list_string(coordinate),
              " is not in the mesh of shape ", list_string(shape));
}
}  // namespace

std::vector<int64_t> ShardSpec::local_shape_at(const std::vector<int64_t>& coordinate) const {
  check_coordinate(*this, coordinate, "local_shape_at");
  std::vector<int64_t> shape = global_shape_;
  for (size_t m = 0; m < placements_.size(); ++m) {
    if (is_shard(placements_[m])) {
      shape[shard_dim(placements_[m])] = sizes_[m][coordinate[m]];
    }
  }
  return shape;
}

std::vector<int64_t> ShardSpec::local_offsets_at(const std::vector<int64_t>& coordinate) const {
  check_coordinate(*this, coordinate, "local_offsets_at");
  std::vector<int64_t> offsets(global_shape_.size(), 0);
  for (size_t m = 0; m < placements_.size(); ++m) {
    if (is_shard(placements_[m])) {
      const auto& sizes = sizes_[m];
      int64_t off = 0;
      for (int64_t c = 0; c < coordinate[m]; ++c) {
        off += sizes[c];
      }
      offsets[shard_dim(placements_[m])] = off;
    }
  }
  return offsets;
}

int64_t ShardSpec::mesh_dim_of(int64_t tensor_dim) const {
  const int64_t n = ndim();
  TORCH_CHECK(tensor_dim >= -n && tensor_dim < n, "ShardSpec::mesh_dim_of: tensor dim ", tensor_dim,
              " is out of range for global shape ", list_string(global_shape_));
  if (tensor_dim < 0) {
    tensor_dim += n;
  }
  for (size_t m = 0; m < placements_.size(); ++m) {
    if (shard_dim(placements_[m]) == tensor_dim) {
      return static_cast<int64_t>(m);
    }
  }
  return -1;
}

bool ShardSpec::is_replicated() const {
  for (const auto& p : placements_) {
    if (!is_replicate(p)) {
      return false;
    }
  }
  return true;
}

bool ShardSpec::has_partial() const {
  for (const auto& p : placements_) {
    if (is_partial(p)) {
      return true;
    }
  }
  return false;
}

bool ShardSpec::is_sharded() const {
  for (const auto& p : placements_) {
    if (is_shard(p)) {
      return true;
    }
  }
  return false;
}

bool ShardSpec::is_balanced() const {
  for (size_t m = 0; m < placements_.size(); ++m) {
    if (is_shard(placements_[m]) &&
        sizes_[m] != balanced_sizes(global_shape_[shard_dim(placements_[m])],
                                    static_cast<int64_t>(sizes_[m].size()))) {
      return false;
    }
  }
  return true;
}

bool ShardSpec::same_layout(const ShardSpec& other) const {
  return mesh_.shape() == other.mesh_.shape() && placements_ == other.placements_ &&
         global_shape_ == other.global_shape_ && sizes_ == other.sizes_;
}

bool ShardSpec::operator==(const ShardSpec& other) const {
  return mesh_ == other.mesh_ && same_layout(other);
}

std::string ShardSpec::to_string() const {
  std::ostringstream os;
  os << "ShardSpec(global=" << list_string(global_shape_)
     << ", placements=" << shardtensor::to_string(placements_)
     << ", mesh=" << list_string(mesh_.shape()) << ", sizes={";
  bool first = true;
  for (size_t m = 0; m < sizes_.size(); ++m) {
    if (is_shard(placements_[m])) {
      os << (first ? "" : ", ") << m << ": " << list_string(sizes_[m]);
      first = false;
    }
  }
  os << "})";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const ShardSpec& spec) { return os << spec.to_string(); }

}  // namespace shardtensor
