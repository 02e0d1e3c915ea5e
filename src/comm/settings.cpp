// The per-use check of the settings that change communication (Note [agreed
// settings], core/settings.h).
#include "comm/settings.h"

#include <c10/util/Exception.h>
#include <shardtensor/core/runtime.h>

#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "comm/diagnostic.h"
#include "comm/transport.h"
#include "core/debug.h"
#include "core/fingerprint.h"

namespace shardtensor::comm {

int64_t use_setting(Comm comm, Setting s) {
  const int64_t v = detail::setting_value(s);
  if (!detail::debug_enabled() || transport::comm_size(comm) == 1) return v;
  detail::Fingerprint fp;
  fp.add(static_cast<int64_t>(s)).add(v);
  if (diagnostic_agree(comm, fp.value()).same) return v;
  // Every rank saw the disagreement: all take this branch together.
  // Every rank's value, in its slot of a max all-reduce (uncounted, like the check).
  std::vector<int64_t> all(transport::comm_size(comm), std::numeric_limits<int64_t>::min());
  all[transport::comm_rank(comm)] = v;
  transport::diagnostic_max_(all, comm);
  std::ostringstream os;
  os << "SHARDTENSOR_DEBUG: ranks disagree on the setting " << detail::setting_name(s);
  const char* op = OpLabel::current();
  if (op != nullptr && op[0] != '\0') os << " (" << op << ")";
  os << ", which decides the collectives: ";
  for (size_t r = 0; r < all.size(); ++r) {
    os << (r ? ", " : "") << "mesh rank " << r << ": " << detail::setting_value_str(s, all[r]);
  }
  os << "; set the same value on every rank";
  TORCH_CHECK(false, os.str());
  return v;  // unreachable
}

int64_t use_setting(const DeviceMesh& mesh, Setting s) { return use_setting(mesh.comm(), s); }

}  // namespace shardtensor::comm
