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
# Open MPI 4.1 / 5.0 launcher flags and variables: one home, bench/mpi_launch.sh.
. bench/mpi_launch.sh
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
