#!/bin/sh
# usage: watchdog_check.sh <max-seconds> <command...>
# Runs a watchdog scenario (tests/watchdog_scenario.cpp) and passes only if the
# job ended with the watchdog's exit code (kWatchdogExitCode = 85, Note
# [watchdog]) and one-line message within <max-seconds>; a hang is killed by
# timeout(1) and fails.
max=$1
shift
log=$(mktemp)
start=$(date +%s)
timeout -k 5 "$max" "$@" >"$log" 2>&1
rc=$?
end=$(date +%s)
cat "$log"
echo "watchdog_check: exit code $rc after $((end - start)) s"
fail=0
# A rank that exits without finalizing is caught by the launcher itself
# (OpenMPI's mpirun ends the job at once, before the watchdog's deadline):
# WATCHDOG_OR_LAUNCHER names the launcher's message that is accepted instead.
if [ -n "$WATCHDOG_OR_LAUNCHER" ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] &&
  grep -q "$WATCHDOG_OR_LAUNCHER" "$log"; then
  echo "watchdog_check: the launcher ended the job (exit code $rc): ok"
  rm -f "$log"
  exit 0
fi
# Open MPI 4.1's mpirun can itself crash (SIGSEGV in PMIx_server_finalize,
# exit code 139) while it tears down a job that a rank aborted with MPI_Abort
# and another rank was finalizing. The job still ended through the watchdog's
# MPI_Abort(85), which Open MPI reports in its banner: accept exactly that, and
# only from Open MPI 4.1's launcher ($1; 5.0's runtime is PRRTE, another code
# path: there such a crash is a failure; Note [Open MPI 4.1 and 5.0 spellings]
# in cmake/MpiLaunch.cmake).
if [ "$rc" -eq 139 ] && grep -q "MPI_ABORT was invoked on rank" "$log" &&
  grep -q "with errorcode 85" "$log" && grep -q "PMIx_server_finalize" "$log" &&
  "$1" --version 2>/dev/null | grep -Eq "\((Open MPI|OpenRTE)\) 4\.1\."; then
  echo "watchdog_check: mpirun crashed in PMIx_server_finalize after the watchdog's MPI_Abort(85)"
  rc=85
fi
# torchrun returns 1 when a worker fails and reports each worker's exit code.
if [ "$WATCHDOG_LAUNCHER" = torchrun ] && [ "$rc" -eq 1 ] && grep -q "exitcode *: 85" "$log"; then
  echo "watchdog_check: torchrun reports a worker's exit code 85"
  rc=85
fi
if [ "$rc" -ne 85 ]; then
  echo "watchdog_check: FAIL: expected exit code 85 (the watchdog's), got $rc"
  fail=1
fi
if ! grep -q "shardtensor watchdog: world rank .* waited .* s (SHARDTENSOR_TIMEOUT = .* s) in " "$log"; then
  echo "watchdog_check: FAIL: no watchdog message in the output"
  fail=1
fi
if [ -n "$WATCHDOG_EXPECT" ] && ! grep -q "$WATCHDOG_EXPECT" "$log"; then
  echo "watchdog_check: FAIL: the output does not contain '$WATCHDOG_EXPECT'"
  fail=1
fi
# WATCHDOG_EXPECT_EACH: a pattern that the output must match once for each of
# the world ranks 0 .. WATCHDOG_EACH-1 (every surviving rank), "@R" standing
# for the rank.
if [ -n "$WATCHDOG_EXPECT_EACH" ]; then
  r=0
  while [ "$r" -lt "${WATCHDOG_EACH:-0}" ]; do
    want=$(printf '%s' "$WATCHDOG_EXPECT_EACH" | sed "s/@R/$r/g")
    if grep -q "$want" "$log"; then
      echo "watchdog_check: world rank $r printed its line"
    else
      echo "watchdog_check: FAIL: no line of world rank $r matches '$want'"
      fail=1
    fi
    r=$((r + 1))
  done
fi
rm -f "$log"
exit $fail
