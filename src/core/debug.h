#pragma once
/// \file The SHARDTENSOR_DEBUG switch (private; one definition for every layer).

#include <cstdlib>
#include <cstring>

namespace shardtensor::detail {

/// Local. True when the environment variable SHARDTENSOR_DEBUG is set to
/// anything but "" or "0". Re-read on every call (a getenv, far cheaper than
/// the agreement it guards), so that a test can switch it on and off for a
/// scope. In debug mode every intercepted op (dispatch/) and every primitive
/// (comm/) first checks, uncounted, that all ranks make the same call
/// (Note [collective discipline]).
inline bool debug_enabled() {
  const char* env = std::getenv("SHARDTENSOR_DEBUG");
  return env != nullptr && env[0] != '\0' && std::strcmp(env, "0") != 0;
}

}  // namespace shardtensor::detail
