#pragma once
// The transposed convolution rule (src/ops/conv_transpose.cpp), for the
// other rules that receive one. Private to the op rules.
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "ops/registry.h"

namespace shardtensor::ops {

/// Collective as the conv_transpose rule is (halo exchanges over the mesh
/// dims that shard spatial dims; with a channel-sharded input the
/// reduce-scatter of Note [channel-sharded transposed convolution]). Runs
/// aten::convolution / aten::_convolution with transposed=true (`args`: the
/// popped arguments, in that schema's order) as conv_transpose{1,2,3}d, and
/// pushes the result. Throws on every rank, naming the op, its shapes and
/// placements, what that rule refuses (and a weight that is not 3-d to 5-d).
void transposed_convolution_rule(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                                 Stack* stack);

}  // namespace shardtensor::ops
