#pragma once
/// \file Integer arithmetic of partitions and windows (private; one
/// definition for comm/ and ops/).

#include <cstdint>

namespace shardtensor {

/// Local. Floor of a / b for any signs (b != 0).
inline int64_t div_floor(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/// Local. Ceiling of a / b for any signs (b != 0).
inline int64_t div_ceil(int64_t a, int64_t b) { return -div_floor(-a, b); }

}  // namespace shardtensor
