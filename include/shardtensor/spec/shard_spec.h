#pragma once
/// \file ShardSpec: how a global tensor is laid out over a DeviceMesh. Pure
/// metadata, identical on every rank, computed without communication.

#include <shardtensor/mesh/device_mesh.h>
#include <shardtensor/spec/placement.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace shardtensor {

/// Local. Balanced-block split of `n` over `parts`: coordinate i gets
/// n/parts + (i < n%parts). Throws if n < 0 or parts < 1.
std::vector<int64_t> balanced_sizes(int64_t n, int64_t parts);

/// Local. Exclusive prefix sum: offsets[i] = sizes[0] + ... + sizes[i-1].
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes);

/// Global tensor shape, mesh, one placement per mesh dim, and for each Shard
/// mesh dim the extent held by each coordinate. Immutable.
class ShardSpec {
 public:
  /// Local. Validates and throws c10::Error naming the shapes and placements if:
  /// the number of placements differs from mesh.ndim(); a Shard dim is out of
  /// range (negative dims wrap); two mesh dims shard the same tensor dim;
  /// `sizes` has the wrong length, a negative entry, a non-empty entry for a
  /// non-Shard mesh dim, or entries that do not sum to the global extent.
  /// Without `sizes`, every Shard mesh dim uses balanced_sizes().
  ShardSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> global_shape,
            std::optional<ShardSizes> sizes = std::nullopt);

  const DeviceMesh& mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  int64_t ndim() const { return static_cast<int64_t>(global_shape_.size()); }
  int64_t numel() const;

  /// Extent held by each coordinate along `mesh_dim` ({} if that mesh dim is not Shard).
  const std::vector<int64_t>& shard_sizes(int64_t mesh_dim) const;
  const ShardSizes& all_shard_sizes() const { return sizes_; }

  /// This rank's local shape and the global index of its first element.
  std::vector<int64_t> local_shape() const;
  std::vector<int64_t> local_offsets() const;
  /// Same, for any mesh coordinate.
  std::vector<int64_t> local_shape_at(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> local_offsets_at(const std::vector<int64_t>& coordinate) const;

  /// The mesh dim that shards tensor dim `dim`, or -1.
  int64_t mesh_dim_of(int64_t tensor_dim) const;
  /// True when every placement is Replicate (every rank holds the whole tensor).
  bool is_replicated() const;
  bool has_partial() const;
  /// True if any mesh dim is Shard.
  bool is_sharded() const;
  /// True when every Shard dim uses the balanced-block split.
  bool is_balanced() const;

  bool operator==(const ShardSpec& other) const;
  bool operator!=(const ShardSpec& other) const { return !(*this == other); }
  /// Same layout ignoring the mesh's identity (used by metadata-only code).
  bool same_layout(const ShardSpec& other) const;

  /// "ShardSpec(global=[1, 8, 1024, 1024], placements=[Shard(2)], mesh=[4], sizes={0: [256, ...]})"
  std::string to_string() const;

 private:
  DeviceMesh mesh_;
  Placements placements_;
  std::vector<int64_t> global_shape_;
  ShardSizes sizes_;
};

std::ostream& operator<<(std::ostream& os, const ShardSpec& spec);

}  // namespace shardtensor
