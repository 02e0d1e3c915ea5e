#!/usr/bin/env bash
# I/O scenario: read throughput of a sharded float32 field from one HDF5 file
# at P = 1, 2, 4 (each rank its Shard(0) hyperslab, collective and
# independent MPI-IO) next to a sequential whole-file read on one rank in the
# same run. Appends records to the JSON array $RESULTS/io.json (started afresh).
#
#   bench/run_io.sh            (after: cmake --build build --target shardtensor_bench_io)
# Environment: BENCH_IO_BIN [build/bench/shardtensor_bench_io]  RESULTS [bench/results]
#   NPS ["1 2 4"]  IO_SHAPES ["4096,4096 256,256,256"]  REPEATS [5]  MPIRUN [mpirun]
#   MPIRUN_FLAGS [this Open MPI's, as in bench/run.sh]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${BENCH_IO_BIN:-build/bench/shardtensor_bench_io}
RESULTS=${RESULTS:-bench/results}
NPS=${NPS:-1 2 4}
IO_SHAPES=${IO_SHAPES:-4096,4096 256,256,256}
REPEATS=${REPEATS:-5}
MPIRUN=${MPIRUN:-mpirun}
export OMP_NUM_THREADS=1
# This Open MPI's flags and variables (4.1 or 5.0), from cmake/MpiLaunch.cmake (Note [Open MPI
# 4.1 and 5.0 spellings]); MPIRUN_FLAGS and variables already set win. Without cmake: 4.1's
# (5.0's mpirun accepts them too). bench/run.sh has the same lines.
mpi_version="" mpi_flags=() mpi_env=()
for w in $(cmake -DMPIEXEC_EXECUTABLE="$MPIRUN" -DSHARDTENSOR_MPI_PRINT=words \
  -P cmake/MpiLaunch.cmake 2>/dev/null); do
  case $w in
    version=*) mpi_version=${w#version=} ;;
    flag=*) mpi_flags+=("${w#flag=}") ;;
    env=*) mpi_env+=("${w#env=}") ;;
  esac
done
if [ -z "$mpi_version" ]; then
  mpi_flags=(--oversubscribe --bind-to none) mpi_env=(OMPI_MCA_btl_vader_single_copy_mechanism=none)
fi
for kv in "${mpi_env[@]}"; do  # single copy off (containers), in this version's spelling
  name=${kv%%=*}
  [ -n "${!name:-}" ] || export "$kv"
done
MPIRUN_FLAGS=${MPIRUN_FLAGS-${mpi_flags[*]}}
read -r -a MPIRUN_ARGS <<<"$MPIRUN_FLAGS"
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
mkdir -p "$RESULTS"
rm -f "$RESULTS/io.json"
echo "load before: $(uptime)"
for shape in $IO_SHAPES; do
  for np in $NPS; do
    "$MPIRUN" "${MPIRUN_ARGS[@]}" -np "$np" "$BIN" --shape "$shape" \
      --repeats "$REPEATS" --out "$RESULTS/io.json"
  done
done
echo "load after: $(uptime)"
