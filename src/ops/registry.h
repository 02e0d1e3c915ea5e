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

/// Note [partial rules]: whether a rule takes a call. It sees the call's
/// arguments on the stack (the last op.schema().arguments().size() entries,
/// not popped) and must decide from metadata that is identical on every rank
/// (specs, global shapes, dtypes, the op's other arguments), never from a
/// piece's values or extent, so that every rank decides alike. When it
/// returns false the dispatcher handles the call as if the op had no rule:
/// its CompositeImplicitAutograd decomposition, else the generic fallback
/// (which is exact). A rule without a predicate takes every call.
using Accepts = std::function<bool(const c10::OperatorHandle& op, const Stack& stack)>;

/// Registers `rule` for an aten op. `name` is "add" (every overload of
/// aten::add), "add.Tensor" (one overload) or "add." (only the overload with
/// no name); the most specific entry wins. `accepts` (optional) limits the
/// calls the rule takes (Note [partial rules]).
void register_rule(const std::string& name, Rule rule, Accepts accepts = {});

/// The rule for `op`, or nullptr.
const Rule* find_rule(const c10::OperatorName& op);

/// The rule registered for exactly `op`'s overload ("name.overload", or
/// "name." for the unnamed one), ignoring a rule registered for every
/// overload of the name; nullptr when there is none.
const Rule* find_exact_rule(const c10::OperatorName& op);

/// The predicate of `op`'s rule (Note [partial rules]), or nullptr when the
/// op has no rule or its rule takes every call.
const Accepts* find_accepts(const c10::OperatorName& op);

/// Every registered name, "aten::name", "aten::name.overload" or "aten::name." (sorted).
std::vector<std::string> registered_rule_names();

/// Local. `rule`, after which its results' wrappers get the strides that
/// libtorch's own results would have (the op run on meta tensors of the
/// inputs' global sizes and strides), so that contiguous(), view and reshape
/// decide copy or view as libtorch does (Note [wrapper strides],
/// ops/shape.cpp). For the rules of view ops. Throws what `rule` throws.
Rule with_torch_strides(Rule rule);

/// Local (metadata only, identical on every rank). What with_torch_strides
/// does after its rule: gives the ShardTensor results among the last
/// `op.schema().returns().size()` values of `stack` the strides of libtorch's
/// own results, from `op` run on meta tensors of `args`' global sizes and
/// strides (`args`: the op's arguments as the rule received them). Results
/// stay contiguous where the meta call raises. Throws nothing of its own.
void set_torch_strides(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                       Stack* stack);

/// Static registration helper: `static RuleRegistrar r({"relu", "relu_"}, rule);`
struct RuleRegistrar {
  RuleRegistrar(std::initializer_list<const char*> names, const Rule& rule,
                const Accepts& accepts = {});
};

}  // namespace shardtensor::ops
