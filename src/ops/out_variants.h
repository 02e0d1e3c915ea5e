#pragma once
// The generic adapter of out= overloads (private; Note [out variants] in
// ops/out_variants.cpp).
#include <ATen/core/dispatch/Dispatcher.h>

#include "ops/registry.h"

namespace shardtensor::ops {

/// How an out-variant runs through its functional overload's rule.
struct OutAdapter {
  Rule rule;        ///< the functional rule, then a copy into the out= tensors
  Accepts accepts;  ///< Note [partial rules]: calls the adapter or the op's own rule takes
  c10::OperatorName functional;  ///< e.g. aten::add.Tensor for aten::add.out
};

/// Local, metadata only (cached per op). The adapter of Note [out variants]
/// for `op`: when `op` is an out-variant (its written Tensor arguments are
/// exactly its returns), its functional overload (same name, the same
/// arguments without the out= ones, nothing written) has a rule, and `op`
/// has no rule registered for this very overload. nullptr otherwise.
const OutAdapter* find_out_adapter(const c10::OperatorHandle& op);

}  // namespace shardtensor::ops
