#pragma once
// The generic fallback for ops with no sharding rule and no decomposition
// (private; Note [generic fallback] in fallback.cpp).
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace shardtensor::dispatch {

/// Collective over the mesh of the ShardTensor arguments (all-gathers, and in
/// backward their adjoints). Runs the boxed call on the stack on gathered
/// tensors and leaves its results on the stack, re-sharded where the shapes
/// allow. In strict mode throws "no sharding rule" on every rank instead.
void generic_fallback(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack);

}  // namespace shardtensor::dispatch
