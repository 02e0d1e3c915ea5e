#pragma once
/// \file Settings that change communication (private): the one home of the
/// process-wide switches that decide which collectives a rule makes, and of
/// their cross-rank check.
///
/// Note [agreed settings]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// Some settings choose between two communication patterns: the FFT's output
/// layout (set_fft_layout: Input swaps back, Spectral does not), the causal
/// balance of ring attention (set_causal_balance: ZigZag moves q/k/v/out
/// there and back), and the environment switches of the split-phase paths
/// (SHARDTENSOR_CONV_OVERLAP, SHARDTENSOR_POOL_SPLIT, SHARDTENSOR_TCONV_SPLIT,
/// SHARDTENSOR_INTERP_SPLIT), and fully_shard's early gathers and
/// reductions (SHARDTENSOR_FSDP_PREFETCH). Ranks that disagree on one of them make
/// different collectives: a hang until the watchdog, or a wrong result when
/// the byte counts happen to match. Every rule reads such a setting through
/// use_setting() at its point of use, after the metadata-only decisions that
/// every rank takes alike and before any communication that depends on it.
///
/// Cost: without SHARDTENSOR_DEBUG, use_setting() is local (an atomic load or
/// one getenv) and nothing is checked. With SHARDTENSOR_DEBUG=1 every use is
/// checked: one uncounted all-reduce of 5 int64 over the mesh (the same
/// diagnostic agreement as the per-op check of Note [collective discipline],
/// so CommStats do not change); on disagreement one more all-gather of one
/// int64 per rank names the values, and every rank of the mesh throws the
/// same c10::Error: "SHARDTENSOR_DEBUG: ranks disagree on the setting <name>
/// (<op>): mesh rank 0: <value>, mesh rank 1: <value>, ...".
///
/// The environment switches are read on every use (a getenv, as for
/// SHARDTENSOR_DEBUG), not once per process: a value changed with setenv()
/// takes effect at the next call. Each is on unless set to exactly "0".

#include <shardtensor/mesh/device_mesh.h>

#include <cstdint>

namespace shardtensor::ops {

/// A setting that changes communication (Note [agreed settings]).
enum class Setting : int {
  FftLayout,      ///< set_fft_layout(): the FftLayout as an int
  CausalBalance,  ///< set_causal_balance(): the CausalBalance as an int
  ConvOverlap,    ///< SHARDTENSOR_CONV_OVERLAP: 1 on, 0 off
  PoolSplit,      ///< SHARDTENSOR_POOL_SPLIT
  TconvSplit,     ///< SHARDTENSOR_TCONV_SPLIT
  InterpSplit,    ///< SHARDTENSOR_INTERP_SPLIT
  FsdpPrefetch,   ///< SHARDTENSOR_FSDP_PREFETCH (Note [fully_shard prefetch])
};

/// Local. The name of `s` as a user sets it ("set_fft_layout",
/// "SHARDTENSOR_CONV_OVERLAP").
const char* setting_name(Setting s);

/// Local. This process's current value of `s` (environment switches: 0 when
/// the variable is exactly "0", else 1). Does not throw.
int64_t setting_value(Setting s);

/// The value of `s`, checked across ranks under SHARDTENSOR_DEBUG (Note
/// [agreed settings]). Collective over every rank of `mesh` when
/// SHARDTENSOR_DEBUG is on (uncounted), local otherwise. Throws c10::Error
/// on every rank of `mesh`, naming the setting, the op being run and every
/// rank's value, when ranks hold different values.
int64_t use_setting(const DeviceMesh& mesh, Setting s);

}  // namespace shardtensor::ops
