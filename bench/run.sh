#!/usr/bin/env bash
# Benchmark driver: launches shardtensor_bench under mpirun for each scenario
# and collects the JSON records in bench/results/<scenario>.json (each
# scenario's file is started afresh when that scenario runs).
#
#   bench/run.sh quick                     # `make bench-quick`: bench/results/quick.json
#   bench/run.sh fixed|weak|strong|maxsize|overhead|attention
#   bench/run.sh scale                     # `make bench-scale`: weak scaling with tiny pieces, P = 1..SCALE_NPS
#   bench/run.sh profile                   # per-op profile, unet2d PROFILE_SHAPE at P = 1, 2
#   bench/run.sh io                        # parallel HDF5 reads (bench/run_io.sh): bench/results/io.json
#   bench/run.sh targets                   # `make bench-targets`: issue 13's targets, bench/results/targets.json
#   bench/run.sh transport                 # `make bench-transport`: MPI vs Gloo, U-Net 512^2 train, P = 2
#   bench/run.sh all                       # `make bench`: every scenario above but quick and scale
#
# Environment (defaults in brackets):
#   BENCH_BIN [build/bench/shardtensor_bench]   RESULTS [bench/results]
#   MPIRUN [mpirun]  MPIRUN_FLAGS [this Open MPI's: 4.1 --oversubscribe --bind-to none,
#     5.0 --map-by :OVERSUBSCRIBE --bind-to none; cmake/MpiLaunch.cmake]
#   NPS ["1 2 4 8"]  STEPS [5]  WARMUP [2]  BASELINE_THREADS [1,match]
#   FIXED_SHAPE_2D [256,256]  FIXED_SHAPE_3D [32,32,32]  FIXED_SHAPE_CONV [512,512]
#   WEAK_ROWS_PER_RANK [64]  WEAK_COLS [256]   (unet2d weak scaling: global [64*P, 256])
#   CAP_MIB [1024]  MAXSIZE_WORKLOADS [unet2d]  NORM [group]
#   ATTN_LOG2 ["10 11 12 13 14 15"]  ATTN_BASELINE_MAX_LOG2 [13]
#   SCALE_NPS ["1 2 4 8 16"]  SCALE_PIECE [16,32] (per-rank piece, rows x cols)  SCALE_STEPS [3]
#   PROFILE_SHAPE [512,512]  PROFILE_NPS ["1 2"]  PROFILE_STEPS [3]
#   BENCH_IO_BIN [build/bench/shardtensor_bench_io]  IO_NPS ["1 2 4"]  IO_SHAPES  IO_REPEATS
# Every scenario prints `uptime` before and after it; every record carries the
# 1-minute load, the mpirun flags and each rank's CPU affinity.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BENCH_BIN=${BENCH_BIN:-build/bench/shardtensor_bench}
RESULTS=${RESULTS:-bench/results}
MPIRUN=${MPIRUN:-mpirun}
# Open MPI 4.1 / 5.0 launcher flags and variables: one home, bench/mpi_launch.sh.
. bench/mpi_launch.sh
NPS=${NPS:-1 2 4 8}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
BASELINE_THREADS=${BASELINE_THREADS:-1,match}
FIXED_SHAPE_2D=${FIXED_SHAPE_2D:-256,256}
FIXED_SHAPE_3D=${FIXED_SHAPE_3D:-32,32,32}
FIXED_SHAPE_CONV=${FIXED_SHAPE_CONV:-512,512}
WEAK_ROWS_PER_RANK=${WEAK_ROWS_PER_RANK:-64}
WEAK_COLS=${WEAK_COLS:-256}
CAP_MIB=${CAP_MIB:-1024}
MAXSIZE_WORKLOADS=${MAXSIZE_WORKLOADS:-unet2d}
NORM=${NORM:-group}
ATTN_LOG2=${ATTN_LOG2:-10 11 12 13 14 15}
ATTN_BASELINE_MAX_LOG2=${ATTN_BASELINE_MAX_LOG2:-13}
SCALE_NPS=${SCALE_NPS:-1 2 4 8 16}
SCALE_PIECE=${SCALE_PIECE:-16,32}
SCALE_STEPS=${SCALE_STEPS:-3}
PROFILE_SHAPE=${PROFILE_SHAPE:-512,512}
PROFILE_NPS=${PROFILE_NPS:-1 2}
PROFILE_STEPS=${PROFILE_STEPS:-3}
# The records store the launcher's flags (Note [baseline honesty]).
export BENCH_MPIRUN_FLAGS="$MPIRUN_FLAGS"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

[ -x "$BENCH_BIN" ] || { echo "run.sh: $BENCH_BIN not built (make bench-quick builds it)" >&2; exit 1; }
mkdir -p "$RESULTS"
FAILED=0

# bench NP OUT_NAME ARGS...: one mpirun; a failure is reported and counted, the rest go on.
bench() {
  local np=$1 name=$2
  shift 2
  echo "+ $MPIRUN -np $np $BENCH_BIN $*"
  if ! "$MPIRUN" "${MPIRUN_ARGS[@]}" -np "$np" "$BENCH_BIN" "$@" --out "$RESULTS/$name.json"; then
    echo "run.sh: FAILED: -np $np $*" >&2
    FAILED=$((FAILED + 1))
  fi
}

fresh() { rm -f "$RESULTS/$1.json"; }

norm_flag() { case "$1" in unet*) echo "--norm $NORM" ;; esac; }

# (1) fixed global size at P = 1, 2, 4, 8 (oversubscribed beyond the cores).
scenario_fixed() {
  fresh fixed
  local w shape mode np
  for w in unet2d conv_stack unet3d; do
    case $w in unet2d) shape=$FIXED_SHAPE_2D ;; unet3d) shape=$FIXED_SHAPE_3D ;; *) shape=$FIXED_SHAPE_CONV ;; esac
    for mode in train infer; do
      for np in $NPS; do
        # shellcheck disable=SC2046
        bench "$np" fixed run --scenario fixed --workload $w $(norm_flag $w) --mode $mode \
          --shape "$shape" --steps "$STEPS" --warmup "$WARMUP" --baseline-threads "$BASELINE_THREADS"
      done
    done
  done
}

# (2) weak scaling: the per-rank piece fixed ([WEAK_ROWS_PER_RANK, WEAK_COLS]), P = 1, 2, 4, 8.
scenario_weak() {
  fresh weak
  local np w
  for w in unet2d conv_stack; do
    for np in $NPS; do
      # shellcheck disable=SC2046
      bench "$np" weak run --scenario weak --workload $w $(norm_flag $w) --mode train \
        --shape "$((WEAK_ROWS_PER_RANK * np)),$WEAK_COLS" --steps "$STEPS" --warmup "$WARMUP" \
        --baseline-threads "$BASELINE_THREADS"
    done
  done
}

# (3) strong scaling on 2 cores: P = 2 x 1 thread vs one process with 1 and 2 threads.
scenario_strong() {
  fresh strong
  local w shape mode
  for w in unet2d conv_stack; do
    case $w in unet2d) shape=$FIXED_SHAPE_2D ;; *) shape=$FIXED_SHAPE_CONV ;; esac
    for mode in train infer; do
      # shellcheck disable=SC2046
      bench 2 strong run --scenario strong --workload $w $(norm_flag $w) --mode $mode \
        --shape "$shape" --threads 1 --steps "$STEPS" --warmup "$WARMUP" --baseline-threads 1,2
    done
  done
}

# (4) the largest trainable resolution under a per-rank tensor-memory cap.
scenario_maxsize() {
  fresh maxsize
  local w np
  for w in $MAXSIZE_WORKLOADS; do
    for np in $NPS; do
      # shellcheck disable=SC2046
      bench "$np" maxsize maxsize --scenario maxsize --workload $w $(norm_flag $w) --cap-mib "$CAP_MIB"
    done
  done
}

# (5) overhead at P = 1: the ShardTensor path vs plain libtorch, same input, 1 thread each.
scenario_overhead() {
  fresh overhead
  local w shape mode
  for w in unet2d conv_stack unet3d; do
    case $w in unet2d) shape=$FIXED_SHAPE_2D ;; unet3d) shape=$FIXED_SHAPE_3D ;; *) shape=$FIXED_SHAPE_CONV ;; esac
    for mode in train infer; do
      # shellcheck disable=SC2046
      bench 1 overhead run --scenario overhead --workload $w $(norm_flag $w) --mode $mode \
        --shape "$shape" --steps "$STEPS" --warmup "$WARMUP" --baseline-threads 1
    done
  done
}

# Attention (only when the binary has it): S = 2^10 .. 2^15 on 1 and 2 ranks.
scenario_attention() {
  if ! "$BENCH_BIN" list 2>/dev/null | grep -q '^attention'; then
    echo "run.sh: attention not built (no <shardtensor/ops/attention.h>); skipped"
    return 0
  fi
  fresh attention
  local l np mode base steps
  for l in $ATTN_LOG2; do
    for np in 1 2; do
      for mode in infer train; do
        base=(--baseline-threads "$BASELINE_THREADS")
        [ "$l" -le "$ATTN_BASELINE_MAX_LOG2" ] || base=(--no-baseline)
        # Past 2^13 a step takes minutes on one core: one warm-up and one timed step.
        steps=(--steps 3 --warmup 1)
        [ "$l" -le 13 ] || steps=(--steps 1 --warmup 1)
        bench "$np" attention run --scenario attention --workload attention --mode $mode \
          --shape $((1 << l)) --heads 1 --head-dim 64 "${steps[@]}" "${base[@]}"
      done
    done
  done
}

# Weak scaling with tiny pieces (the scale model, docs/benchmarks.md): every
# rank holds a SCALE_PIECE piece of a 1-D decomposition along rows, so the
# global rows grow with P; U-Net (depth 2, 8 channels) and the conv stack,
# train, no baseline, through `shardtensor_bench profile`: per rank and step
# the records carry messages, bytes, CPU seconds, the host time outside
# kernels and MPI (Note [bench profile]) and the dispatcher's counters.
# P beyond the cores runs oversubscribed: look at counts and CPU seconds, not
# wall time.
scenario_scale() {
  fresh scale
  local np w rows cols
  rows=${SCALE_PIECE%,*}
  cols=${SCALE_PIECE#*,}
  for w in conv_stack unet2d; do
    for np in $SCALE_NPS; do
      # shellcheck disable=SC2046
      bench "$np" scale profile --scenario scale --workload $w $(norm_flag $w) --mode train \
        --shape "$((rows * np)),$cols" --base-channels 8 --depth 2 --steps "$SCALE_STEPS" \
        --warmup 1 --no-baseline --top 0
    done
  done
}

# Per-op profile (shardtensor_bench profile): unet2d train at PROFILE_SHAPE.
scenario_profile() {
  fresh profile
  local np
  for np in $PROFILE_NPS; do
    bench "$np" profile profile --scenario profile --workload unet2d --norm "$NORM" --mode train \
      --shape "$PROFILE_SHAPE" --steps "$PROFILE_STEPS" --warmup 1
  done
}

# Parallel HDF5 reads: bench/run_io.sh (its own binary and results file io.json).
scenario_io() {
  local bin=${BENCH_IO_BIN:-$(dirname "$BENCH_BIN")/shardtensor_bench_io}
  if [ ! -x "$bin" ]; then
    echo "run.sh: $bin not built; io skipped" >&2
    FAILED=$((FAILED + 1))
    return 0
  fi
  BENCH_IO_BIN=$bin RESULTS=$RESULTS MPIRUN=$MPIRUN MPIRUN_FLAGS=$MPIRUN_FLAGS NPS="${IO_NPS:-1 2 4}" \
    IO_SHAPES="${IO_SHAPES:-4096,4096 256,256,256}" REPEATS="${IO_REPEATS:-5}" \
    bench/run_io.sh || FAILED=$((FAILED + 1))
}

# A small, honest subset (< 10 minutes on 2 cores): unet2d training at 2 and 4
# ranks with the 1-thread baseline (and 'match' threads), its P = 1 overhead,
# inference at 2 ranks, a conv stack at 2 ranks, and a small memory-cap search.
scenario_quick() {
  fresh quick
  local np
  for np in 1 2 4; do
    bench "$np" quick run --scenario quick --workload unet2d --norm "$NORM" --mode train \
      --shape 512,512 --steps 3 --warmup 1 --baseline-threads 1,match
  done
  bench 2 quick run --scenario quick --workload unet2d --norm "$NORM" --mode infer \
    --shape 512,512 --steps 3 --warmup 1 --baseline-threads 1,match
  bench 2 quick run --scenario quick --workload conv_stack --mode train \
    --shape 512,512 --steps 3 --warmup 1 --baseline-threads 1,match
  for np in 1 2 4; do
    bench "$np" quick maxsize --scenario quick --workload unet2d --norm "$NORM" --cap-mib 128
  done
}

# Issue 13's targets (docs/benchmarks.md, "Issue 13's targets"): U-Net 512x512 train and
# infer at P = 1, 2, 4 against plain libtorch with 1 thread (and, at P = 2 train, with
# matched threads on the same cores), and ring attention at S = 4096, P = 1.
scenario_targets() {
  fresh targets
  local np mode steps
  for np in 1 2 4; do
    steps=3
    [ "$np" -le 2 ] || steps=2
    for mode in train infer; do
      base=1
      [ "$np" != 2 ] || [ "$mode" != train ] || base=1,match
      bench "$np" targets run --scenario targets --workload unet2d --norm "$NORM" --mode $mode \
        --shape 512,512 --steps $steps --warmup 1 --baseline-threads $base
    done
  done
  if "$BENCH_BIN" list 2>/dev/null | grep -q '^attention'; then
    for mode in train infer; do
      bench 1 targets run --scenario targets --workload attention --mode $mode --shape 4096 \
        --heads 4 --head-dim 32 \
        --steps 3 --warmup 1 --baseline-threads 1
    done
  fi
}

# Issue 24: the same U-Net 512^2 training step at P = 2 on the MPI transport and on
# the c10d (Gloo) transport (SHARDTENSOR_BACKEND=gloo under the same mpirun, so only
# the transport differs): time and bytes per step, bench/results/transport.json.
scenario_transport() {
  fresh transport
  local backend
  for backend in mpi gloo; do
    SHARDTENSOR_BACKEND=$backend bench 2 transport run --scenario transport --workload unet2d \
      --norm "$NORM" --mode train --shape 512,512 --steps ${TRANSPORT_STEPS:-5} --warmup 1 \
      --baseline-threads 1
  done
}

[ $# -ge 1 ] || set -- quick
for s in "$@"; do
  case $s in
    quick | fixed | weak | strong | maxsize | overhead | attention | scale | profile | io | targets | transport)
      echo "run.sh: $s: load before: $(uptime)"
      "scenario_$s"
      echo "run.sh: $s: load after: $(uptime)"
      ;;
    all)
      for t in overhead strong fixed weak maxsize attention profile io; do
        echo "run.sh: $t: load before: $(uptime)"
        "scenario_$t"
        echo "run.sh: $t: load after: $(uptime)"
      done
      ;;
    *)
      echo "run.sh: unknown scenario '$s' (quick fixed weak strong maxsize overhead attention scale profile io targets all)" >&2
      exit 2
      ;;
  esac
done
if [ "$FAILED" -gt 0 ]; then
  echo "run.sh: $FAILED run(s) failed" >&2
  exit 1
fi
echo "run.sh: results in $RESULTS/"
