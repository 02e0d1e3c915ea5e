#pragma once
// A tiny JSON writer for flat benchmark records: one object on one line, so
// that the report generator (bench/report.sh, awk) can read a record per line.
// Results files are JSON arrays: "[\n{...},\n{...}\n]\n".
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

class JsonRecord {
 public:
  JsonRecord& str(const std::string& key, const std::string& value) {
    return raw(key, quote(value));
  }
  JsonRecord& num(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  JsonRecord& num(const std::string& key, int value) { return raw(key, std::to_string(value)); }
  JsonRecord& num(const std::string& key, double value) { return raw(key, number(value)); }
  /// null when empty.
  JsonRecord& num(const std::string& key, std::optional<double> value) {
    return raw(key, value ? number(*value) : "null");
  }
  JsonRecord& boolean(const std::string& key, bool value) {
    return raw(key, value ? "true" : "false");
  }
  JsonRecord& array(const std::string& key, const std::vector<int64_t>& values) {
    std::string s = "[";
    for (size_t i = 0; i < values.size(); ++i) s += (i ? "," : "") + std::to_string(values[i]);
    return raw(key, s + "]");
  }
  /// `value` must already be valid JSON.
  JsonRecord& raw(const std::string& key, const std::string& value) {
    body_ += (body_.empty() ? "" : ", ") + quote(key) + ": " + value;
    return *this;
  }
  std::string to_string() const { return "{" + body_ + "}"; }

  static std::string number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.6g", v);
    return buf;
  }
  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out += c;
          }
      }
    }
    return out + "\"";
  }

 private:
  std::string body_;
};

/// Appends `records` to the JSON array in `path` (created if missing or
/// empty). Writes a temporary file beside it and renames it into place.
inline void append_records(const std::string& path, const std::vector<JsonRecord>& records) {
  std::string old;
  {
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      old = ss.str();
    }
  }
  std::string body;
  const auto first = old.find_first_not_of(" \t\r\n");
  if (first != std::string::npos) {
    const auto last = old.find_last_not_of(" \t\r\n");
    if (old[first] != '[' || old[last] != ']') {
      throw std::runtime_error("results file " + path + " is not a JSON array");
    }
    body = old.substr(first + 1, last - first - 1);
    const auto b0 = body.find_first_not_of(" \t\r\n");
    const auto b1 = body.find_last_not_of(" \t\r\n");
    body = b0 == std::string::npos ? "" : body.substr(b0, b1 - b0 + 1);
  }
  std::string out = "[\n";
  if (!body.empty()) out += body;
  for (const auto& r : records) {
    out += (out.size() > 2 ? ",\n" : "") + r.to_string();
  }
  out += "\n]\n";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream o(tmp, std::ios::trunc);
    if (!o) throw std::runtime_error("cannot write " + tmp);
    o << out;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
  }
}

}  // namespace bench
