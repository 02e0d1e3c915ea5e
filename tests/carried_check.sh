#!/bin/sh
# usage: carried_check.sh <max-seconds> <np> "<rc>;<regex>;<regex>..." <command...>
# Runs a carried-error scenario (tests/watchdog_scenario.cpp, Note [carried
# errors]) under timeout(1) and passes only if the job ended with exit code
# <rc> within <max-seconds> (a hang is killed and fails) and every regex
# matches exactly <np> lines of the output (one per rank: every rank raised);
# a regex written "N@regex" must match at least N lines.
max=$1
np=$2
spec=$3
shift 3
log=$(mktemp)
start=$(date +%s)
timeout -k 5 "$max" "$@" >"$log" 2>&1
rc=$?
end=$(date +%s)
cat "$log"
echo "carried_check: exit code $rc after $((end - start)) s"
want_rc=${spec%%;*}
fail=0
if [ "$rc" -ne "$want_rc" ]; then
  echo "carried_check: FAIL: expected exit code $want_rc, got $rc"
  fail=1
fi
rest=${spec#*;}
while [ -n "$rest" ]; do
  re=${rest%%;*}
  if [ "$re" = "$rest" ]; then rest=""; else rest=${rest#*;}; fi
  case "$re" in
    [0-9]@*)  # "N@regex": at least N lines
      least=${re%%@*}
      re=${re#*@}
      n=$(grep -c "$re" "$log")
      if [ "$n" -lt "$least" ]; then
        echo "carried_check: FAIL: '$re' matches $n lines, expected at least $least"
        fail=1
      fi
      ;;
    *)
      n=$(grep -c "$re" "$log")
      if [ "$n" -ne "$np" ]; then
        echo "carried_check: FAIL: '$re' matches $n lines, expected one per rank ($np)"
        fail=1
      fi
      ;;
  esac
done
if grep -q "WRONG\|unexpected" "$log"; then
  echo "carried_check: FAIL: a wrong value or an unexpected completion"
  fail=1
fi
rm -f "$log"
exit $fail
