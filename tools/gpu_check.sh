#!/usr/bin/env bash
# tools/gpu_check.sh: the GPU check of issue 24, one command for a machine with
# a CUDA GPU (the device machine: one H100/H200, torch 2.11 + CUDA 13.0 on
# Python 3.12 as python3, no MPI). Under 10 minutes there.
#
#   tools/gpu_check.sh              on the GPU machine
#   tools/gpu_check.sh --dry-run    anywhere (CI): the same build and the same
#                                   steps, on the CPU, the GPU-only parts skipped
#
# It builds the c10d-only library and Python package (SHARDTENSOR_WITH_MPI=OFF,
# Note [c10d-only build]) against that machine's own torch, then runs:
#   1. the c10d-only build's C++ suites launched the torchrun way at P = 1 and 2
#      (when GoogleTest is installed; CPU pieces);
#   2. the device subset (tests/gpu/device_subset.py) at P = 1, and at P = 2
#      sharing the one GPU over Gloo;
#   3. the conv example (examples/python/conv_example.py) with its tensors on the GPU;
#   4. the U-Net main job's one-step MATCH check (examples/python/unet_train.py
#      --check-only) on the GPU;
#   5. U-Net 512^2 training at P = 1 on the GPU against plain torch on the same
#      GPU (bench/gpu_overhead.py; goal: overhead <= 5 %); --dry-run runs it at
#      64^2 on the CPU so that the script cannot rot, and reports no figure.
# Each step's output goes to $BUILD/gpu_check/<step>.log; the last line is the
# summary: "gpu_check: PASSED ..." or "gpu_check: FAILED ...", and the exit code
# says so. Options: --build-dir DIR (default build-gpu-check), --jobs N,
# --python PY (default: $VIRTUAL_ENV/bin/python, .venv/bin/python, python3).
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
BUILD="$REPO/build-gpu-check"
JOBS="$(nproc 2>/dev/null || echo 2)"
PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --build-dir) BUILD="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --python) PY="$2"; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
if [ -z "$PY" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
  elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
  else PY="$(command -v python3)"; fi
fi
LOGS="$BUILD/gpu_check"
mkdir -p "$LOGS"
START=$(date +%s)
RESULTS=()
FAILED=0
say() { echo "gpu_check: $*"; }
record() {  # record <step> <ok|FAILED|skipped> [detail]
  RESULTS+=("$1 $2${3:+ ($3)}")
  [ "$2" = FAILED ] && FAILED=$((FAILED + 1))
  say "$1: $2${3:+ ($3)}"
}
run_step() {  # run_step <name> <pass-regex> <command...>: ok when it exits 0 and prints the regex
  local name="$1" regex="$2"; shift 2
  local log="$LOGS/$name.log"
  say "$name: $*"
  if timeout 900 "$@" >"$log" 2>&1 && grep -Eq -- "$regex" "$log"; then
    record "$name" ok "$(grep -E -- "$regex" "$log" | tail -1 | cut -c1-160)"
  else
    record "$name" FAILED "see $log: $(grep -Ev '^\s*$' "$log" | tail -1 | cut -c1-200)"
  fi
}

# ---- the machine ----------------------------------------------------------------
INFO=$("$PY" - <<'EOF' 2>&1
import platform, torch
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if cuda else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPUs {torch.cuda.device_count() if cuda else 0} ({name})")
print("cuda" if cuda else "cpu")
EOF
) || { say "FAILED: $PY cannot import torch: $INFO"; exit 1; }
MACHINE=$(echo "$INFO" | head -1)
HAVE_CUDA=$(echo "$INFO" | tail -1)
say "$(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n), $MACHINE, $(nproc) cores"
if [ "$DRY" = 1 ]; then
  DEV=cpu
  say "dry run: every step on the CPU, the GPU-only figure skipped"
else
  if [ "$HAVE_CUDA" != cuda ]; then
    say "FAILED: no CUDA device visible to $PY (use --dry-run on a machine without a GPU)"
    exit 1
  fi
  DEV=cuda
fi
HAVE_GTEST=OFF
if [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ]; then HAVE_GTEST=ON; fi

# ---- build: c10d-only library, Python package, torchrun suites ---------------------
say "configure $BUILD (SHARDTENSOR_WITH_MPI=OFF, tests $HAVE_GTEST)"
if ! cmake -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSHARDTENSOR_WITH_MPI=OFF \
    -DSHARDTENSOR_BUILD_EXAMPLES=OFF -DSHARDTENSOR_BUILD_BENCH=OFF -DBUILD_TESTING=$HAVE_GTEST \
    -DPython3_EXECUTABLE="$PY" >"$LOGS/configure.log" 2>&1; then
  record configure FAILED "see $LOGS/configure.log: $(grep -m1 -A2 'Error' "$LOGS/configure.log" | tr '\n' ' ' | cut -c1-300)"
  say "FAILED (${RESULTS[*]})"
  exit 1
fi
if ! cmake --build "$BUILD" -j "$JOBS" >"$LOGS/build.log" 2>&1; then
  record build FAILED "see $LOGS/build.log: $(grep -m1 'error' "$LOGS/build.log" | cut -c1-300)"
  say "FAILED (${RESULTS[*]})"
  exit 1
fi
record build ok "$(( $(date +%s) - START )) s"
if [ ! -f "$BUILD/python/shardtensor/__init__.py" ] || ! ls "$BUILD"/python/shardtensor/_C*.so >/dev/null 2>&1; then
  record python-package FAILED "no shardtensor._C was built (pybind11 missing from $PY's environment? see $LOGS/configure.log)"
  say "FAILED (${RESULTS[*]})"
  exit 1
fi

export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 SHARDTENSOR_TIMEOUT=120
TORCHRUN=("$PY" -m torch.distributed.run --standalone)

# 1. The c10d-only build's own C++ suites (CPU pieces), torchrun at P = 1 and 2.
if [ "$HAVE_GTEST" = ON ]; then
  run_step cpp-suites "100% tests passed" \
    ctest --test-dir "$BUILD" -R '\.torchrun\.np[12]$' --output-on-failure --timeout 600
else
  record cpp-suites skipped "GoogleTest is not installed"
fi
# 2. The device subset at P = 1 and at P = 2 (two ranks on the one device, Gloo).
for np in 1 2; do
  run_step "device-subset.np$np" "device subset: PASSED" \
    "${TORCHRUN[@]}" --nproc-per-node $np "$REPO/tests/gpu/device_subset.py" --device $DEV
done
# 3. The conv example with its tensors on the device (P = 2 sharing it).
run_step conv-example.np2 "Gradient check: PASSED" \
  env SHARDTENSOR_CONV_DEVICE=$DEV SHARDTENSOR_CONV_SIZE=512 \
  "${TORCHRUN[@]}" --nproc-per-node 2 "$REPO/examples/python/conv_example.py"
# 4. The U-Net main job's one-step MATCH check on the device.
run_step unet-match.np2 "-> MATCH" \
  "${TORCHRUN[@]}" --nproc-per-node 2 "$REPO/examples/python/unet_train.py" --check-only \
  --device $DEV --mesh 1x2
# 5. Overhead at P = 1 against plain torch on the same device.
if [ "$DRY" = 1 ]; then
  run_step overhead.np1 "gpu overhead:" \
    "${TORCHRUN[@]}" --nproc-per-node 1 "$REPO/bench/gpu_overhead.py" --device cpu --size 64 \
    --steps 1 --warmup 1 --rounds 1
else
  run_step overhead.np1 "gpu overhead:" \
    "${TORCHRUN[@]}" --nproc-per-node 1 "$REPO/bench/gpu_overhead.py" --device cuda --size 512
fi

SECONDS_USED=$(( $(date +%s) - START ))
MODE=$([ "$DRY" = 1 ] && echo "dry run on cpu" || echo "on $DEV")
if [ "$FAILED" = 0 ]; then
  say "PASSED ($MODE, $MACHINE, ${SECONDS_USED} s: $(IFS=';'; echo "${RESULTS[*]}"))"
  exit 0
fi
say "FAILED ($FAILED steps; $MODE, $MACHINE, ${SECONDS_USED} s: $(IFS=';'; echo "${RESULTS[*]}"))"
exit 1
