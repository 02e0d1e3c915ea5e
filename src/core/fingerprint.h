#pragma once
/// \file Deterministic fingerprints (private): FNV-1a, 64 bit.
///
/// Whenever a hash crosses ranks (the SHARDTENSOR_DEBUG agreement, the
/// distribute_module module check), every process must compute the same value
/// for the same input. std::hash gives no such promise (its result may differ
/// between processes, builds and standard libraries), so every cross-rank hash
/// in the library is a Fingerprint.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string_view>
#include <vector>

namespace shardtensor::detail {

/// FNV-1a over bytes: the same value on every rank, run and platform of the
/// same endianness. Local.
class Fingerprint {
 public:
  Fingerprint& add_bytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= kPrime;
    }
    return *this;
  }
  /// The 8 bytes of `v`, least significant first.
  Fingerprint& add(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) {
      h_ ^= (u >> (8 * i)) & 0xffu;
      h_ *= kPrime;
    }
    return *this;
  }
  /// The length, then the values.
  Fingerprint& add(const std::vector<int64_t>& v) {
    add(static_cast<int64_t>(v.size()));
    for (int64_t x : v) add(x);
    return *this;
  }
  /// The bit pattern of `d`.
  Fingerprint& add(double d) {
    int64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    return add(bits);
  }
  /// The characters of `s`.
  Fingerprint& add(std::string_view s) { return add_bytes(s.data(), s.size()); }
  /// dtype, rank and shape of `t`, with the dims in `masked` left out (they
  /// may differ per rank, e.g. a local extent).
  Fingerprint& add_shape(const at::Tensor& t, std::initializer_list<int64_t> masked) {
    add(static_cast<int64_t>(t.scalar_type()));
    add(static_cast<int64_t>(t.dim()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      const bool skip = std::find(masked.begin(), masked.end(), d) != masked.end();
      add(skip ? int64_t{-1} : t.size(d));
    }
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t h_ = 1469598103934665603ull;
};

/// Local. The fingerprint of a string.
inline uint64_t fingerprint(std::string_view s) { return Fingerprint().add(s).value(); }

}  // namespace shardtensor::detail
