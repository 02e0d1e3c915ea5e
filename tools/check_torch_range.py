#!/usr/bin/env python3
"""Compiles the library and the Python binding against other torch versions' headers.

    tools/check_torch_range.py BUILD_DIR WHEEL_OR_DIR [WHEEL_OR_DIR ...]
    make check-torch-range TORCH_WHEELS="torch-2.11.0-....whl torch-2.14.1-....whl"

The supported range is torch 2.11 - 2.14 (cmake/ProjectTorch.cmake), CI builds and
tests 2.13.0. This check takes each translation unit's exact command from BUILD_DIR's
compile_commands.json (configured against the project's torch), swaps the torch
include directories for those of another torch (a wheel, of which only torch/include
is unpacked, or an unpacked torch package directory), replaces the precompiled header
by its source (src/pch.h; a PCH is only valid for the headers it was built from) and
compiles with -fsyntax-only. It proves the code compiles against every version in the
range; it does not link or run it (that needs the matching libtorch; CI runs 2.13.0).
Exit status: the number of versions with a failing translation unit (0: all compile).
"""

import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_include_of(src, work):
    """The torch/include directory of a wheel (unpacked once into work/) or of a package dir."""
    if os.path.isdir(src):
        inc = os.path.join(src, "include")
        return inc, open(os.path.join(src, "version.py")).read().split("'")[1]
    name = os.path.basename(src)
    version = name.split("-")[1]
    dest = os.path.join(work, version)
    inc = os.path.join(dest, "torch", "include")
    if not os.path.isdir(inc):
        with zipfile.ZipFile(src) as z:
            for m in z.namelist():
                if m.startswith("torch/include/") or m == "torch/version.py":
                    z.extract(m, dest)
    return inc, version


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    build = os.path.abspath(sys.argv[1])
    db = json.load(open(os.path.join(build, "compile_commands.json")))
    work = os.path.join(build, "torch-range")
    os.makedirs(work, exist_ok=True)
    units = [e for e in db if re.search(r"/(src/[a-z]+|python/src)/[^/]+\.cpp$", e["file"])]
    if not units:
        print("check_torch_range: no library translation units in compile_commands.json")
        return 2
    failed_versions = 0
    for src in sys.argv[2:]:
        inc, version = torch_include_of(src, work)
        failures = []

        def compile_one(e):
            args = shlex.split(e["command"])
            out = []
            skip = False
            for a in args:
                if skip:
                    skip = False
                    continue
                if a in ("-o", "-MF", "-MT"):
                    skip = True
                    continue
                if a in ("-MD", "-MMD", "-Winvalid-pch") or a.endswith("ccache"):
                    continue
                if "cmake_pch.hxx" in a:  # "-include <build>/.../cmake_pch.hxx" -> its source
                    if out and out[-1] == "-include":
                        out.pop()
                    out += ["-include", os.path.join(ROOT, "src", "pch.h")]
                    continue
                out.append(re.sub(r"[^ ]*/torch/include", inc, a) if "/torch/include" in a else a)
            if tuple(int(x) for x in version.split(".")[:2]) >= (2, 14):  # 2.14's headers need C++20
                out = ["-std=c++20" if a in ("-std=c++17", "-std=gnu++17") else a for a in out]
            out.append("-fsyntax-only")
            r = subprocess.run(out, cwd=e["directory"], capture_output=True, text=True)
            return e["file"], r.returncode, r.stderr

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
            for f, rc, err in ex.map(compile_one, units):
                if rc != 0:
                    failures.append((f, err))
        status = "OK" if not failures else f"{len(failures)} of {len(units)} translation units fail"
        print(f"torch {version}: {len(units)} translation units, {status}")
        for f, err in failures:
            print(f"--- {os.path.relpath(f, ROOT)}\n" + "\n".join(err.splitlines()[:20]))
        failed_versions += bool(failures)
    return failed_versions


if __name__ == "__main__":
    sys.exit(main())
