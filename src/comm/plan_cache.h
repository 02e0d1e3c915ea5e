#pragma once
/// \file A bounded, thread-safe cache of communication plans keyed by a
/// vector of integers (private to comm/; Notes [halo plan cache], [box
/// exchange plan cache]).
///
/// Plans depend only on metadata (the communicator, this rank's coordinate,
/// the partition), so a key of those integers identifies one. Like PETSc's
/// VecScatter or heFFTe's plans: built once, found by every later call with
/// the same layout. At most `Capacity` plans; the cache is cleared when full
/// (a model has a bounded number of distinct layouts).

#include <shardtensor/core/comm.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace shardtensor::comm {

/// The bits of an Comm handle (a pointer in Open MPI, an int in MPICH), as
/// the first entry of a plan key: a plan is never reused on another
/// communicator. A handle reused after MPI_Comm_free gives the same plan
/// contents for the same key, so a stale entry is still right.
inline int64_t comm_key_bits(Comm comm) {
  int64_t bits = 0;
  std::memcpy(&bits, &comm, std::min(sizeof(comm), sizeof(bits)));
  return bits;
}

template <class Plan, size_t Capacity = 512>
class PlanCache {
 public:
  using Key = std::vector<int64_t>;

  /// Local. The cached plan for `key`, or nullptr.
  std::shared_ptr<const Plan> find(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    return it == plans_.end() ? nullptr : it->second;
  }

  /// Local. Stores `plan` under `key` (clearing the cache first when full).
  void insert(Key key, std::shared_ptr<const Plan> plan) {
    std::lock_guard<std::mutex> lock(mu_);
    if (plans_.size() >= Capacity) plans_.clear();
    plans_.emplace(std::move(key), std::move(plan));
  }

  /// Local. Number of cached plans (tests).
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return plans_.size();
  }

 private:
  /// Local (never crosses ranks, so not a Fingerprint): one multiply-xorshift
  /// round per key entry where byte-wise FNV-1a needs eight multiplies (the
  /// keys of repartition and halo plans are O(P) entries long).
  struct KeyHash {
    size_t operator()(const Key& k) const {
      uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(k.size());
      for (int64_t x : k) {
        h = (h ^ static_cast<uint64_t>(x)) * 0xff51afd7ed558ccdull;
        h ^= h >> 29;
      }
      return static_cast<size_t>(h);
    }
  };
  std::mutex mu_;
  std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> plans_;
};

}  // namespace shardtensor::comm
