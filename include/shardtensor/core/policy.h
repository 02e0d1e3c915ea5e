#pragma once
/// \file Policy for gathers: the generic fallback and rules that replicate
/// more than a rank's piece (Note [visible gathers]).
///
/// Note [visible gathers]: an op with no sharding rule and no decomposition
/// runs through the generic fallback (src/dispatch/fallback.cpp): its
/// ShardTensor inputs are all-gathered, the op runs on full tensors and the
/// results are re-sharded. Some rules also replicate more than a rank's piece
/// (matmul replicating an operand where no ring applies, Note [ring matmul];
/// a channel-sharded input of a grouped conv, Note [channel-sharded conv]). A
/// shard-dim swap in redistribute is not one: it is a direct exchange (Note
/// [shard-dim swap] in src/tensor/shard_tensor.cpp). Every such gather is counted in
/// CommStats::gathered_bytes and announced by a one-line warning, once per op
/// name, on mesh rank 0. In strict mode (SHARDTENSOR_STRICT=1 in the
/// environment, or set_strict(true)) they are refused instead: a c10::Error
/// naming the op and the placements, raised on every rank before any
/// communication.

#include <cstdint>
#include <string>

namespace shardtensor {

/// Local. Turns strict mode on or off for this process (overrides
/// SHARDTENSOR_STRICT). Every rank must use the same setting, or ranks would
/// disagree on whether to gather: call it on every rank with the same value.
void set_strict(bool on);

/// Local. Whether strict mode is on: set_strict()'s last value, else
/// SHARDTENSOR_STRICT (any value other than empty or "0" turns it on).
bool strict();

namespace detail {
/// Local. Counts `bytes` gathered beyond this rank's piece on behalf of `op`
/// and, the first time for that op name in this process, warns (c10 warning)
/// on the rank where `announce` is true (mesh rank 0):
/// "shardtensor: <op> gathered <bytes> bytes per rank ...". `how` says what
/// gathered ("the generic fallback", "matmul replicates an operand").
void record_gather(const std::string& op, int64_t bytes, bool announce, const std::string& how);
/// Local. Forgets which ops have already warned (tests).
void reset_gather_warnings();
}  // namespace detail

}  // namespace shardtensor
