#pragma once
/// \file Settings that change communication (private): the one registry of the
/// process-wide switches that decide which collectives are made, for every
/// layer (core/policy reads strict mode here, comm/halo the neighbourhood
/// switch, ops/ and nn/ the rest), and their agreement at init.
///
/// Note [agreed settings]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// Some settings choose between two communication patterns: the FFT's output
/// layout (set_fft_layout: Input swaps back, Spectral does not), the causal
/// balance of ring attention (set_causal_balance: ZigZag moves q/k/v/out
/// there and back), strict mode (SHARDTENSOR_STRICT / set_strict: a refused
/// gather is an error where the other ranks gather), the halo's
/// neighbourhood collectives (SHARDTENSOR_HALO_NEIGHBOR), the environment
/// switches of the split-phase paths (SHARDTENSOR_CONV_OVERLAP,
/// SHARDTENSOR_POOL_SPLIT, SHARDTENSOR_TCONV_SPLIT, SHARDTENSOR_INTERP_SPLIT)
/// and fully_shard's early gathers and reductions (SHARDTENSOR_FSDP_PREFETCH).
/// Ranks that disagree on one of them make different collectives: a hang
/// until the watchdog, or a wrong result when the byte counts happen to
/// match. This file is their one registry (enum Setting); the per-use check
/// is comm::use_setting() (comm/settings.h), above the network.
///
/// Two checks, at two moments:
///  - At init (always, no SHARDTENSOR_DEBUG needed): shardtensor::init()
///    takes one snapshot of every setting (the environment as the launcher
///    passed it, and the set_*() values) and agrees it over the world:
///    under MPI one MPI_Allgather of kSettingCount int64 per rank on
///    MPI_COMM_WORLD, under c10d one store key per rank read by every rank.
///    Nothing per op, nothing in CommStats. Ranks that differ all throw the
///    same c10::Error from init(): "shardtensor::init: ranks disagree on the
///    setting <name>, which decides the collectives: world rank 0: <value>,
///    world rank 1: <value>, ...; set the same value on every rank" (one
///    line per setting that differs). This catches what a launcher gets
///    wrong (an `-x VAR` or an environment that reaches some hosts only).
///  - At every use, under SHARDTENSOR_DEBUG=1: comm::use_setting() agrees the
///    current value (one uncounted all-reduce of 5 int64, the diagnostic
///    agreement of Note [collective discipline]); on disagreement a second
///    uncounted max all-reduce of one slot per rank names the values, and
///    every rank throws "SHARDTENSOR_DEBUG:
///    ranks disagree on the setting <name> (<op>), ...". This catches a
///    change made on some ranks only after init (set_fft_layout on one rank,
///    a setenv in rank-dependent code), which the init check cannot see and
///    which, without SHARDTENSOR_DEBUG, is still not checked (no message per
///    op is spent on it). The dispatcher's per-op check agrees every setting
///    over the whole mesh at each op's entry as well (Note [settings at op
///    entry], comm/settings.cpp): a setting used on one line of the mesh
///    (a halo) would otherwise be checked on that line only.
///
/// Why nothing else without SHARDTENSOR_DEBUG: a change on one rank is
/// invisible to the others (an agreement "when it changes" would be entered
/// by that rank alone), and no agreement happens on the success path to fold
/// a fingerprint into (carried errors send nothing when every check passes,
/// Note [carried errors]). Init is the one moment every rank reaches
/// together. Cost, measured: docs/architecture.md, Note [agreed settings].
///
/// Every rule reads such a setting through comm::use_setting() at its point
/// of use, after the metadata-only decisions that every rank takes alike and
/// before any communication that depends on it. The environment switches are
/// read on every use (a getenv, as for SHARDTENSOR_DEBUG), so a value changed
/// with setenv() takes effect at the next call; SHARDTENSOR_STRICT alone is
/// read once per process, as before.

#include <cstdint>
#include <string>

namespace shardtensor {

/// A setting that changes communication (Note [agreed settings]).
enum class Setting : int {
  FftLayout,      ///< set_fft_layout(): the FftLayout as an int
  CausalBalance,  ///< set_causal_balance(): the CausalBalance as an int
  ConvOverlap,    ///< SHARDTENSOR_CONV_OVERLAP: 1 on, 0 off (on unless "0")
  PoolSplit,      ///< SHARDTENSOR_POOL_SPLIT
  TconvSplit,     ///< SHARDTENSOR_TCONV_SPLIT
  InterpSplit,    ///< SHARDTENSOR_INTERP_SPLIT
  FsdpPrefetch,   ///< SHARDTENSOR_FSDP_PREFETCH (Note [fully_shard prefetch])
  Strict,         ///< SHARDTENSOR_STRICT or set_strict() (off unless set, not "" or "0")
  HaloNeighbor,   ///< SHARDTENSOR_HALO_NEIGHBOR (off unless set, not "" or "0")
};
constexpr int kSettingCount = 9;

namespace detail {

/// Local. The name of `s` as a user sets it ("set_fft_layout",
/// "SHARDTENSOR_CONV_OVERLAP", "SHARDTENSOR_STRICT / set_strict").
const char* setting_name(Setting s);

/// Local. This process's current value of `s`. Does not throw.
int64_t setting_value(Setting s);

/// Local. `v` as a user reads it ("FftLayout::Input", "on", "off (\"0\")").
std::string setting_value_str(Setting s, int64_t v);

/// Local. Sets a setting held in the process (FftLayout, CausalBalance,
/// Strict) and returns its previous value; `v` < 0 for Strict: back to the
/// environment. Does not communicate.
int64_t store_setting(Setting s, int64_t v);

/// Collective over the whole job (MPI_COMM_WORLD, or the c10d world through
/// its store), uncounted; called by init() once the world is up. Throws
/// c10::Error on every rank, naming each setting whose values differ and
/// every world rank's value (Note [agreed settings]).
void agree_settings_at_init();

}  // namespace detail
}  // namespace shardtensor
