#include "ops/registry.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace shardtensor::ops {
namespace {

struct Entry {
  Rule rule;
  Accepts accepts;  // empty: every call
};

struct Table {
  std::mutex mu;
  std::unordered_map<std::string, Entry> rules;  // node-based: entries never move
};

Table& table() {
  static Table* t = new Table();  // never destroyed: rules may run during static teardown
  return *t;
}

const Entry* find_entry(const c10::OperatorName& op) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  // "name.overload" for a named overload, "name." for the unnamed one, then "name".
  auto it = t.rules.find(op.name + "." + op.overload_name);
  if (it != t.rules.end()) return &it->second;
  it = t.rules.find(op.name);
  return it == t.rules.end() ? nullptr : &it->second;
}

}  // namespace

void register_rule(const std::string& name, Rule rule, Accepts accepts) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.rules["aten::" + name] = Entry{std::move(rule), std::move(accepts)};
}

const Rule* find_rule(const c10::OperatorName& op) {
  const Entry* e = find_entry(op);
  return e ? &e->rule : nullptr;
}

const Rule* find_exact_rule(const c10::OperatorName& op) {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.rules.find(op.name + "." + op.overload_name);
  return it == t.rules.end() ? nullptr : &it->second.rule;
}

const Accepts* find_accepts(const c10::OperatorName& op) {
  const Entry* e = find_entry(op);
  return e && e->accepts ? &e->accepts : nullptr;
}

std::vector<std::string> registered_rule_names() {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::string> out;
  out.reserve(t.rules.size());
  for (const auto& kv : t.rules) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

RuleRegistrar::RuleRegistrar(std::initializer_list<const char*> names, const Rule& rule,
                             const Accepts& accepts) {
  for (const char* n : names) register_rule(n, rule, accepts);
}

}  // namespace shardtensor::ops
