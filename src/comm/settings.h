#pragma once
/// \file The per-use check of the settings that change communication (private;
/// Note [agreed settings] in core/settings.h, which holds the registry).

#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>

#include "core/settings.h"

namespace shardtensor::comm {

/// The value of `s`, checked across ranks under SHARDTENSOR_DEBUG (Note
/// [agreed settings]). Collective over every rank of `comm` when
/// SHARDTENSOR_DEBUG is on (uncounted), local otherwise. Throws c10::Error
/// on every rank of `comm`, naming the setting, the op being run and every
/// rank's value, when ranks hold different values.
int64_t use_setting(Comm comm, Setting s);

/// The same over every rank of `mesh` (mesh.comm()).
int64_t use_setting(const DeviceMesh& mesh, Setting s);

}  // namespace shardtensor::comm
