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

uint64_t settings_fingerprint() {
  detail::Fingerprint fp;
  for (int s = 0; s < kSettingCount; ++s) {
    fp.add(detail::setting_value(static_cast<Setting>(s)));
  }
  return fp.value();
}

// Note [settings at op entry]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// use_setting() checks a setting over the communicator that uses it: a halo
// along one mesh dim checks one line of the mesh. With a setting changed
// after init on one rank of a 2x2 mesh, the check raised on that rank's line
// only; the other line went on, and waited at its next exchange with the
// failed line until the watchdog. A whole-mesh check inside the halo is no
// cure: not every rank of the mesh reaches every halo call (the split-phase
// conv_transpose exchanges on some lines only). The one point every rank of
// the mesh provably reaches together is the op's entry, where
// SHARDTENSOR_DEBUG already agrees the op and its layouts over the mesh
// (dispatcher.cpp, check_agreement). So that agreement folds in the
// fingerprint of every setting's current value, at no extra message on the
// success path; when it fails, this names the setting (a second round per
// setting, only then). The per-use check stays for the collectives called
// outside ops (halo_exchange, fully_shard's hooks).
void check_settings(const DeviceMesh& mesh) {
  if (mesh.size() == 1) return;
  for (int s = 0; s < kSettingCount; ++s) use_setting(mesh, static_cast<Setting>(s));
}

}  // namespace shardtensor::comm
