#pragma once
/// \file Placements: how a tensor is laid out along one mesh dimension. Pure metadata.

#include <cstdint>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

namespace shardtensor {

/// Split tensor dim `dim` across the mesh dim (balanced-block unless sizes are given).
struct Shard {
  int64_t dim = 0;
};
/// Every coordinate along the mesh dim holds the whole extent.
struct Replicate {};
/// Every coordinate holds a summand; the value is the pending sum over the mesh dim.
struct Partial {};

using Placement = std::variant<Shard, Replicate, Partial>;
using Placements = std::vector<Placement>;
/// Per mesh dim: the extent held by each coordinate along it ({} if the mesh dim is not Shard).
using ShardSizes = std::vector<std::vector<int64_t>>;

bool operator==(const Shard& a, const Shard& b);
bool operator==(const Replicate&, const Replicate&);
bool operator==(const Partial&, const Partial&);

inline bool is_shard(const Placement& p) { return std::holds_alternative<Shard>(p); }
inline bool is_replicate(const Placement& p) { return std::holds_alternative<Replicate>(p); }
inline bool is_partial(const Placement& p) { return std::holds_alternative<Partial>(p); }
/// The sharded tensor dim, or -1 if `p` is not Shard.
inline int64_t shard_dim(const Placement& p) { return is_shard(p) ? std::get<Shard>(p).dim : -1; }

std::string to_string(const Placement& p);   ///< "Shard(2)", "Replicate()", "Partial()"
std::string to_string(const Placements& p);  ///< "[Shard(2), Replicate()]"
std::ostream& operator<<(std::ostream& os, const Placement& p);
std::ostream& operator<<(std::ostream& os, const Placements& p);

}  // namespace shardtensor
