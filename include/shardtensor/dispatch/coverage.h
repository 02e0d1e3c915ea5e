#pragma once
/// \file Which aten ops a ShardTensor handles, and how (docs/ops.md is
/// generated from op_coverage() by `make docs-ops`).

#include <string>
#include <vector>

namespace shardtensor {

/// How the dispatcher handles an aten op called with a ShardTensor argument.
enum class OpHandling {
  Rule,        ///< a sharding rule (src/ops/) runs it on the local pieces
  OutAdapter,  ///< an out= overload: its functional overload's rule, then a copy into out=
               ///< (Note [out variants], src/ops/out_variants.cpp)
  Decomposes,  ///< no rule; its CompositeImplicitAutograd decomposition runs, piece by piece
  Fallback,    ///< no rule, no decomposition: the generic fallback gathers (Note [visible gathers])
};

/// Local. "rule", "out-adapter", "decomposes" or "falls back".
std::string to_string(OpHandling h);

struct OpCoverage {
  std::string name;  ///< "aten::add.Tensor" (overload after the dot; none for the default)
  OpHandling handling = OpHandling::Fallback;
};

/// Local (no communication). Every aten op registered with libtorch's
/// dispatcher in this process, sorted by name, with how a ShardTensor call is
/// handled. A rule may still refuse some arguments (with a clear error), or
/// pass calls in layouts it does not cover on to the decomposition or the
/// generic fallback (Note [partial rules], src/ops/registry.h); a
/// decomposition's pieces may themselves fall back.
std::vector<OpCoverage> op_coverage();

/// Local. Registered sharding rules whose name matches no aten op of the libtorch this
/// process runs (a rule for an op that torch renamed or removed, e.g. 1.13's
/// aten::_scaled_dot_product_attention under torch 2.x): such a rule can never run.
/// Empty when every rule is reachable; tested (test_dispatch_stats, RulesNameLiveOps).
std::vector<std::string> unreachable_rules();

}  // namespace shardtensor
