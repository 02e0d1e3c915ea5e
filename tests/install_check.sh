#!/usr/bin/env bash
# The `install.pip` CTest test (tests/install.cmake): shardtensor installed the way a
# PyTorch extension is, into a fresh virtual environment, then used from there.
#
#   install_check.sh SRC WORK PYTHON TORCH_VERSION MPIEXEC [MPIEXEC_FLAGS...]
#
#   SRC            the source tree (holds pyproject.toml and requirements.txt)
#   WORK           scratch folder (the CMake binary dir's tests/install); venv/ and run/
#                  are made afresh, build/ is scikit-build-core's build dir (a fixed path,
#                  so that ccache hits on reruns)
#   PYTHON         the project's Python (CMake's Python3_EXECUTABLE); the new venv is
#                  made from its base interpreter
#   TORCH_VERSION  the torch the build tree uses (e.g. 2.13.0+cpu); the same is installed
#
# Steps: 1. venv from the base interpreter, torch==TORCH_VERSION, and the build tools
# pinned in requirements.txt (scikit-build-core, pybind11, ninja; numpy for torch);
# 2. `pip install --no-build-isolation SRC` (checks that CMake used the venv's
# interpreter and torch); 3. from a folder outside the source tree: shardtensor is
# imported from the venv, and the wheel layout is site-packages/shardtensor/ only;
# 4. examples/python/conv_example.py on 4 ranks prints both PASSED lines;
# 5. the torch version check: a copy of the installed package whose build info names
# another torch raises ImportError naming both versions, before _C is loaded.
set -euo pipefail

if [ $# -lt 5 ]; then
  echo "usage: $0 SRC WORK PYTHON TORCH_VERSION MPIEXEC [MPIEXEC_FLAGS...]" >&2
  exit 2
fi
SRC=$1 WORK=$2 PROJECT_PY=$3 TORCH_VERSION=$4 MPIEXEC=$5
shift 5
MPIEXEC_FLAGS=("$@")

# The same compiler cache settings as the Makefile exports (ccache is CMake's compiler
# launcher when installed, CMakeLists.txt); two compile jobs.
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$SRC}
export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Nothing from the caller's Python setup may leak in.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP

t0=$(date +%s)
step() { echo "install_check: [$(($(date +%s) - t0)) s] $*"; }
fail() { echo "install_check: FAIL: $*" >&2; exit 1; }

venv=$WORK/venv
build=$WORK/build
run=$WORK/run
mkdir -p "$WORK"
rm -rf "$venv" "$run" "$build"
mkdir -p "$run"

# ---- 1. a fresh venv: torch and the build tools ---------------------------------
base_py=$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')
step "venv $venv from $base_py"
"$base_py" -m venv "$venv"
py=$venv/bin/python
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH

step "pip install torch==$TORCH_VERSION"
"$py" -m pip install -q "torch==$TORCH_VERSION"

tools=(scikit-build-core pybind11 ninja numpy)
pins=$WORK/build-requirements.txt
: >"$pins"
for t in "${tools[@]}"; do
  grep -E "^$t==" "$SRC/requirements.txt" >>"$pins" || fail "no $t==... pin in $SRC/requirements.txt"
done
step "pip install $(tr '\n' ' ' <"$pins")"
"$py" -m pip install -q -r "$pins"

# ---- 2. pip install --no-build-isolation . --------------------------------------
log=$WORK/pip-install.log
step "pip install --no-build-isolation $SRC (build dir $build, log $log)"
if ! (cd "$WORK" && "$py" -m pip install -v --no-build-isolation -C "build-dir=$build" "$SRC") >"$log" 2>&1; then
  tail -n 80 "$log"
  fail "pip install --no-build-isolation $SRC"
fi
# CMake must have built against the venv's interpreter and torch (cmake/ProjectTorch.cmake).
want="shardtensor: torch $TORCH_VERSION from $py"
grep -qF -- "$want" "$log" || { grep -n "shardtensor: torch" "$log" || true; fail "the build did not report '$want'"; }
step "built: $want"

# ---- 3. import from the venv, outside the source tree ---------------------------
cd "$run"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
file=$("$py" -c 'import shardtensor; print(shardtensor.__file__)')
case "$file" in
  "$site"/shardtensor/__init__.py) step "import shardtensor: $file" ;;
  *) fail "shardtensor imported from $file, not from $site" ;;
esac
for f in "$site"/shardtensor/libshardtensor.so "$site"/shardtensor/_build_info.py; do
  [ -f "$f" ] || fail "$f is missing"
done
ext=$(ls "$site"/shardtensor/_C*.so) || fail "no _C*.so in $site/shardtensor"
for d in lib lib64 include share bin; do
  [ ! -e "$site/$d" ] || fail "the wheel put $site/$d into site-packages (only shardtensor/ belongs there)"
done
resolved=$(ldd "$ext" | awk '$1 == "libshardtensor.so" {print $3}')
[ "$resolved" = "$site/shardtensor/libshardtensor.so" ] ||
  fail "_C resolves libshardtensor.so to '$resolved', not the one beside it"
step "layout: $(cd "$site/shardtensor" && ls | grep -v __pycache__ | tr '\n' ' ')"

# ---- 4. the tutorial program on 4 ranks, from the install -----------------------
cp "$SRC/examples/python/conv_example.py" "$run/"
step "${MPIEXEC} ${MPIEXEC_FLAGS[*]} -np 4 $py conv_example.py"
set +e
out=$("$MPIEXEC" "${MPIEXEC_FLAGS[@]}" -np 4 "$py" "$run/conv_example.py" 2>&1)
rc=$?
set -e
echo "$out"
[ $rc -eq 0 ] || fail "conv_example.py exited with $rc"
if echo "$out" | grep -qE "FAILED|Traceback|MPI_ABORT|exited on signal"; then
  fail "conv_example.py reported a failure"
fi
for line in "Output check: PASSED" "Gradient check: PASSED" "(Shard(dim=2),) torch.Size([1, 8, 256, 1024])"; do
  echo "$out" | grep -qF -- "$line" || fail "conv_example.py did not print '$line'"
done
step "conv_example.py: PASSED"

# ---- 5. the torch version check (Note [torch version check]) --------------------
# A copy of the installed package (with _C and libshardtensor, so that without the
# check the import would succeed) whose _build_info.py names another torch: Debian's
# old 1.13.1, outside the supported range, so never the torch of this build.
# A second copy names this torch's release with another local label (+cu999): that
# one must import (builds of one release share the C++ ABI).
check_copy() {  # check_copy DIR FAKE_VERSION EXPECT(ok|importerror)
  local dir=$1 fake=$2 expect=$3
  rm -rf "$dir"
  mkdir -p "$dir"
  cp -r "$site/shardtensor" "$dir/"
  rm -rf "$dir/shardtensor/__pycache__"
  sed -i -E "s/^torch_version = .*/torch_version = \"$fake\"/" "$dir/shardtensor/_build_info.py"
  grep -qF "torch_version = \"$fake\"" "$dir/shardtensor/_build_info.py" || fail "could not doctor $dir"
  PYTHONPATH=$dir "$py" - "$dir" "$fake" "$expect" <<'EOF'
import importlib.util
import sys

import torch

copy, fake, expect = sys.argv[1:]
origin = importlib.util.find_spec("shardtensor").origin
assert origin.startswith(copy + "/"), f"shardtensor would come from {origin}, not {copy}"
try:
    import shardtensor  # noqa: F401
except ImportError as e:
    msg = str(e)
    print(f"install_check: build info {fake!r}: ImportError: {msg}")
    assert expect == "importerror", f"unexpected ImportError for {fake!r}"
    assert fake in msg and torch.__version__ in msg, "the message must name both torch versions"
    assert "shardtensor._C" not in sys.modules, "_C was loaded before the version check"
else:
    print(f"install_check: build info {fake!r}: imports under torch {torch.__version__}")
    assert expect == "ok", f"no ImportError with build info {fake!r} under torch {torch.__version__}"
EOF
}
check_copy "$WORK/doctored-old" "1.13.1" importerror || fail "version check (another torch)"
check_copy "$WORK/doctored-label" "${TORCH_VERSION%%+*}+cu999" ok || fail "version check (another local label)"
rm -rf "$WORK/doctored-old" "$WORK/doctored-label"
step "version check: PASSED"
echo "install_check: PASSED"
