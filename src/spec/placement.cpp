#include <shardtensor/spec/placement.h>

#include <ostream>
#include <string>
#include <variant>

namespace shardtensor {

bool operator==(const Shard& a, const Shard& b) { return a.dim == b.dim; }
bool operator==(const Replicate&, const Replicate&) { return true; }
bool operator==(const Partial&, const Partial&) { return true; }

std::string to_string(const Placement& p) {
  if (const auto* s = std::get_if<Shard>(&p)) {
    return "Shard(" + std::to_string(s->dim) + ")";
  }
  if (is_replicate(p)) {
    return "Replicate()";
  }
  return "Partial()";
}

std::string to_string(const Placements& p) {
  std::string out = "[";
  for (size_t i = 0; i < p.size(); ++i) {
    if (i > 0) {
      out += ", ";
    }
    out += to_string(p[i]);
  }
  out += "]";
  return out;
}

std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << to_string(p); }
std::ostream& operator<<(std::ostream& os, const Placements& p) { return os << to_string(p); }

}  // namespace shardtensor
