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

/// Local. A fingerprint of this process's current value of every setting of
/// Note [agreed settings], identical on ranks that hold the same values.
uint64_t settings_fingerprint();

/// Note [settings at op entry]: the SHARDTENSOR_DEBUG check of every setting
/// over the whole mesh, for the dispatcher's per-op agreement, which folds
/// settings_fingerprint() into its own fingerprint and calls this when that
/// agreement failed (on every rank alike). Collective over every rank of
/// `mesh` (uncounted diagnostic all-reduces). Throws c10::Error on every rank
/// of `mesh` through use_setting(), naming the first setting whose values
/// differ and every mesh rank's value; returns normally when every setting
/// agrees (then the op or its layouts differ).
void check_settings(const DeviceMesh& mesh);

}  // namespace shardtensor::comm
