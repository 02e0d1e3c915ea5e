#include "ops/registry.h"

#include <mutex>
#include <unordered_map>

namespace shardtensor::ops {
namespace {

struct Table {
  std::mutex mu;
  std::unordered_map<std::string, Rule> rules;
};

Table& table() {
  static Table* t = new Table();  // never destroyed: rules may run during static teardown
  return *t;
}

}  // namespace

void register_rule(const std::string& name, Rule rule) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.rules["aten::" + name] = std::move(rule);
}

const Rule* find_rule(const c10::OperatorName& op) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  if (!op.overload_name.empty()) {
    auto it = t.rules.find(op.name + "." + op.overload_name);
    if (it != t.rules.end()) return &it->second;
  }
  auto it = t.rules.find(op.name);
  return it == t.rules.end() ? nullptr : &it->second;
}

RuleRegistrar::RuleRegistrar(std::initializer_list<const char*> names, const Rule& rule) {
  for (const char* n : names) register_rule(n, rule);
}

}  // namespace shardtensor::ops
