"""Which BLAS libtorch runs on, and what it costs (Note [blas] in docs/benchmarks.md).

Debian's libtorch (BLAS_INFO=generic) calls whatever libblas.so.3 the alternatives
system provides: the unoptimized reference BLAS unless an optimized one (OpenBLAS,
installed by `make deps`) is there. At 1 thread libtorch 1.13 runs a 1x1 convolution
with batch < 16 through thnn_conv2d, a GEMM on that BLAS; at 2 or more threads it
uses oneDNN. This probe times, at 1 and 2 threads, in one process per BLAS:
a 1x1 convolution (libtorch's choice, and oneDNN called directly), a 3x3 one, and a
512x512 matmul; then reruns itself with the reference BLAS forced first on the
library path, so both rows come from the same machine state.

    /usr/bin/python3 bench/blas_probe.py            # the installed BLAS and the reference one
    /usr/bin/python3 bench/blas_probe.py --only     # the installed BLAS only

Prints one line per (BLAS, threads, kernel): the median of 5 calls after 1 warm-up,
and the 1-minute load (timings on a busy machine are noisy).
"""

import os
import statistics
import subprocess
import sys
import time

import torch

REFERENCE_DIR = "/usr/lib/x86_64-linux-gnu/blas"  # Debian's libblas3 (reference BLAS)
REFERENCE_LAPACK_DIR = "/usr/lib/x86_64-linux-gnu/lapack"  # liblapack3, over the reference BLAS


def blas_in_use():
    libs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if "/" in line else ""
            name = os.path.basename(path)
            if "blas" in name or "lapack" in name:
                libs.add(path)
    return ", ".join(sorted(libs)) or "none mapped"


def median_time(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(label):
    torch.manual_seed(0)
    x = torch.randn(1, 64, 256, 256)
    w1 = torch.randn(64, 64, 1, 1)
    w3 = torch.randn(64, 64, 3, 3)
    a = torch.randn(512, 512)
    kernels = {
        "conv 1x1 64->64 on 256x256 (libtorch's choice)": lambda: torch.conv2d(x, w1),
        "conv 1x1 64->64 on 256x256 (oneDNN directly)": lambda: torch.ops.aten.mkldnn_convolution(
            x, w1, None, [0, 0], [1, 1], [1, 1], 1
        ),
        "conv 3x3 64->64 on 256x256": lambda: torch.conv2d(x, w3, padding=1),
        "matmul 512x512": lambda: a @ a,
    }
    print(f"# {label}: {blas_in_use()}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fn in kernels.items():
            t = median_time(fn)
            load = os.getloadavg()[0]
            print(f"{label:10s} threads={threads} {name:50s} {t * 1e3:9.2f} ms  (load {load:.2f})")


def main():
    label = os.environ.get("BLAS_PROBE_LABEL", "installed")
    probe(label)
    if "--only" in sys.argv or label != "installed":
        return
    if not os.path.exists(os.path.join(REFERENCE_DIR, "libblas.so.3")):
        print(f"# no reference BLAS at {REFERENCE_DIR}; skipped")
        return
    env = dict(os.environ, BLAS_PROBE_LABEL="reference")
    env["LD_LIBRARY_PATH"] = ":".join(
        [REFERENCE_DIR, REFERENCE_LAPACK_DIR] + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
    )
    sys.stdout.flush()
    subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True)


if __name__ == "__main__":
    main()
