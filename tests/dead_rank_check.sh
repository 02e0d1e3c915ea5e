#!/bin/sh
# usage: dead_rank_check.sh <max-seconds> <mpirun|torchrun> <survivors> <command...>
# Runs tests/dead_rank_scenario.cpp (Note [flight recorder]): the last rank
# ends itself in the middle of a training step. Passes only if
#  - the job ends with a non-zero exit code within <max-seconds> (a hang is
#    killed by timeout(1) and fails), and at most SHARDTENSOR_TIMEOUT + 5 s
#    after the rank died;
#  - each of the <survivors> other ranks (world ranks 0 .. survivors-1) printed
#    a line that names its call ("<primitive> call #<seq> on world ranks [...]")
#    and either the dead rank ("lost world rank D", "missing: world rank(s)
#    [D]") or, when the launcher ended it first, the SIGTERM it received and
#    what it was waiting for (see docs/reliability.md for what each launcher
#    does);
#  - the launcher reported the failure.
max=$1
launcher=$2
survivors=$3
shift 3
log=$(mktemp)
start=$(date +%s.%N)
timeout -k 5 "$max" "$@" >"$log" 2>&1
rc=$?
end=$(date +%s.%N)
cat "$log"
fail=0
echo "dead_rank_check: exit code $rc after $(echo "$end - $start" | bc) s"
# mpirun returns the dead process's status (137 after SIGKILL), so a hang is
# told by the time timeout(1) took, not by its exit code alone.
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$(echo "$end - $start >= $max" | bc)" -eq 1 ]; then
  echo "dead_rank_check: FAIL: expected the job to end by itself with a non-zero exit code, got $rc"
  fail=1
fi
died=$(sed -n 's/.*dead_rank_scenario: world rank \([0-9]*\) ends itself .* at \([0-9.]*\) s$/\1 \2/p' "$log" | head -n 1)
dead=${died%% *}
at=${died#* }
if [ -z "$died" ]; then
  echo "dead_rank_check: FAIL: the culprit never reached its step"
  fail=1
else
  late=$(echo "$end - $at" | bc)
  limit=$(echo "${SHARDTENSOR_TIMEOUT:-600} + 5" | bc)
  echo "dead_rank_check: the job ended $late s after world rank $dead died (limit $limit s)"
  if [ "$(echo "$late > $limit" | bc)" -eq 1 ]; then
    echo "dead_rank_check: FAIL: later than SHARDTENSOR_TIMEOUT + 5 s"
    fail=1
  fi
  r=0
  while [ "$r" -lt "$survivors" ]; do
    if grep -q "^shardtensor: world rank $r lost world rank $dead in .* call #[0-9]* on world ranks \[.*missing: world rank $dead;" "$log"; then
      echo "dead_rank_check: world rank $r named the dead rank"
    elif grep -q "^shardtensor watchdog: world rank $r waited .*call #[0-9]* on world ranks \[.*missing: world ranks \[$dead\]" "$log"; then
      echo "dead_rank_check: world rank $r named the missing rank when the watchdog expired"
    elif grep -q "^shardtensor: world rank $r received SIGTERM .*call #[0-9]* on world ranks \[" "$log"; then
      echo "dead_rank_check: world rank $r was ended by the launcher's SIGTERM and said where it was"
    else
      echo "dead_rank_check: FAIL: world rank $r printed no line naming its call and the missing rank"
      fail=1
    fi
    r=$((r + 1))
  done
fi
case $launcher in
  mpirun) want="mpirun\|MPI_ABORT\|exited on signal\|without calling \"finalize\"\|Primary job\|exit code" ;;
  torchrun) want="ChildFailedError\|exitcode\|SignalException" ;;
esac
if ! grep -q "$want" "$log"; then
  echo "dead_rank_check: FAIL: no report of the failure by $launcher"
  fail=1
fi
rm -f "$log"
exit $fail
