#pragma once
// Results files of the benchmarks: a JSON array with one record (an object)
// per line, read by bench/report.sh (jq) and tests/bench_smoke.cmake.
#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bench {

/// Records keep their keys in insertion order.
using Json = nlohmann::ordered_json;

/// Appends `records` to the JSON array in `path` (created if missing or
/// empty), one record per line. Writes a temporary file beside it and renames
/// it into place. Throws c10::Error if the file is not a JSON array.
inline void append_records(const std::string& path, const std::vector<Json>& records) {
  Json all = Json::array();
  {
    std::ifstream in(path);
    if (in && in.peek() != std::ifstream::traits_type::eof()) {
      try {
        all = Json::parse(in);
      } catch (const Json::parse_error& e) {
        TORCH_CHECK(false, "results file ", path, " is not JSON: ", e.what());
      }
      TORCH_CHECK(all.is_array(), "results file ", path, " is not a JSON array");
    }
  }
  for (const auto& r : records) all.push_back(r);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream o(tmp, std::ios::trunc);
    TORCH_CHECK(o, "cannot write ", tmp);
    o << "[\n";
    for (size_t i = 0; i < all.size(); ++i) o << (i ? ",\n" : "") << all[i].dump();
    o << "\n]\n";
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path);
}

}  // namespace bench
