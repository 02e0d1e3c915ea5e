#pragma once
// Small helpers shared by the standalone benchmark programs
// (shardtensor_bench_io, shardtensor_bench_rebalance).
#include <shardtensor/core/runtime.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

namespace bench {

/// The machine's load average as "1min 5min 15min" (recorded with timings).
inline std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

/// Parses the command line. Returns the exit code when the program should
/// stop (0 after --help, 2 after a bad option; rank 0 prints), else nullopt.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             const char* program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    if (shardtensor::world_rank() == 0) std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    if (shardtensor::world_rank() == 0) std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  }
  return std::nullopt;
}

}  // namespace bench
