#include <ATen/core/dispatch/Dispatcher.h>
#include <shardtensor/dispatch/coverage.h>

#include <algorithm>
#include <set>

#include "ops/out_variants.h"
#include "ops/registry.h"

namespace shardtensor {

std::string to_string(OpHandling h) {
  switch (h) {
    case OpHandling::Rule:
      return "rule";
    case OpHandling::OutAdapter:
      return "out-adapter";
    case OpHandling::Decomposes:
      return "decomposes";
    case OpHandling::Fallback:
      return "falls back";
  }
  return "?";
}

std::vector<OpCoverage> op_coverage() {
  std::vector<OpCoverage> out;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    OpCoverage c;
    c.name = name.name;
    if (!name.overload_name.empty()) c.name += "." + name.overload_name;
    auto op = dispatcher.findOp(name);
    if (op && ops::find_out_adapter(*op)) {
      c.handling = OpHandling::OutAdapter;
    } else if (ops::find_rule(name)) {
      c.handling = OpHandling::Rule;
    } else if (op && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      c.handling = OpHandling::Decomposes;
    } else {
      c.handling = OpHandling::Fallback;
    }
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(),
            [](const OpCoverage& a, const OpCoverage& b) { return a.name < b.name; });
  return out;
}

std::vector<std::string> unreachable_rules() {
  std::set<std::string> names;  // "aten::name", "aten::name." and "aten::name.overload"
  for (const auto& op : c10::Dispatcher::singleton().getAllOpNames()) {
    names.insert(op.name);
    names.insert(op.name + "." + op.overload_name);
  }
  std::vector<std::string> out;
  for (const auto& r : ops::registered_rule_names()) {
    if (!names.count(r)) out.push_back(r);
  }
  return out;
}

}  // namespace shardtensor
