#pragma once
// The table of sharding rules (private). A rule receives the boxed call of an
// aten op in which at least one argument is a ShardTensor, and must leave the
// results on the stack exactly as the op would (ShardTensors or plain tensors).
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <initializer_list>
#include <string>

namespace shardtensor::ops {

using Stack = std::vector<c10::IValue>;
using Rule = std::function<void(const c10::OperatorHandle& op, Stack* stack)>;

/// Registers `rule` for an aten op. `name` is "add" (every overload of
/// aten::add) or "add.Tensor" (one overload); an exact overload wins.
void register_rule(const std::string& name, Rule rule);

/// The rule for `op`, or nullptr.
const Rule* find_rule(const c10::OperatorName& op);

/// Static registration helper: `static RuleRegistrar r({"relu", "relu_"}, rule);`
struct RuleRegistrar {
  RuleRegistrar(std::initializer_list<const char*> names, const Rule& rule);
};

}  // namespace shardtensor::ops
