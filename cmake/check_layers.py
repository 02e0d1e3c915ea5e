#!/usr/bin/python3
"""Layering check for shardtensor (issue 10): the include graph obeys cmake/layers.txt.

Walks src/, include/shardtensor/ and python/ (C/C++ files) and fails, printing
every offending include, when a file
  - includes a header of a layer above its own (layer order: cmake/layers.txt),
  - includes <mpi.h> although its layer may not and it is not allow-listed,
  - includes comm/transport.h outside comm/ without being allow-listed,
  - calls an MPI function (MPI_Xxx(...)) although its layer may not use MPI
    (the precompiled header makes <mpi.h> visible everywhere, so the include
    alone would not catch it).
It also checks that docs/architecture.md renders the layer table of layers.txt.

Usage (plain /usr/bin/python3, no third-party modules):
  check_layers.py [--root DIR]            run the check (exit 1 on violations)
  check_layers.py --root DIR --write-doc  regenerate the table in docs/architecture.md
  check_layers.py --self-test             feed the check deliberately wrong trees
"""

import argparse
import os
import re
import shutil
import sys
import tempfile

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
MPI_CALL_RE = re.compile(r"\bP?MPI_[A-Z][a-z0-9_]*\s*\(")
SOURCE_EXT = (".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cxx", ".cu")
DOC_BEGIN = "<!-- layers:begin (generated from cmake/layers.txt by cmake/check_layers.py) -->"
DOC_END = "<!-- layers:end -->"
TRANSPORT = "comm/transport.h"
UMBRELLA = "shardtensor/shardtensor.h"


class Config:
    def __init__(self, layers, mpi_layers, sentences, allow):
        self.layers = layers            # names, bottom to top
        self.index = {n: i for i, n in enumerate(layers)}
        self.mpi_layers = mpi_layers    # names that may include <mpi.h>
        self.sentences = sentences      # name -> what it owns
        self.allow = allow              # (path, what) -> reason


def read_config(path):
    layers, mpi_layers, sentences, allow = [], set(), {}, {}
    with open(path, encoding="utf-8") as f:
        for no, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split("|", 3)]
            if len(parts) != 4 or parts[0] not in ("layer", "allow"):
                raise SystemExit(f"{path}:{no}: expected 'layer | name | mpi|- | text' "
                                 f"or 'allow | path | mpi|transport | reason'")
            kind, name, flag, text = parts
            if kind == "layer":
                if flag not in ("mpi", "-"):
                    raise SystemExit(f"{path}:{no}: the MPI flag must be 'mpi' or '-'")
                layers.append(name)
                sentences[name] = text
                if flag == "mpi":
                    mpi_layers.add(name)
            else:
                if flag not in ("mpi", "transport") or not text:
                    raise SystemExit(f"{path}:{no}: an allow line needs 'mpi' or 'transport' "
                                     f"and a reason")
                allow[(name, flag)] = text
    if not layers:
        raise SystemExit(f"{path}: no layers")
    return Config(layers, mpi_layers, sentences, allow)


def layer_of_file(rel, cfg):
    """The layer of a repository file (path relative to the root, '/' separated), or None."""
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2 and parts[1] in cfg.index:
        return parts[1]
    if parts[:2] == ["include", "shardtensor"] and len(parts) > 3 and parts[2] in cfg.index:
        return parts[2]
    if parts[0] == "python" and "python" in cfg.index:
        return "python"
    return None


def layer_of_include(target, cfg):
    """The layer an include names (<shardtensor/x/..>, "x/..."), or None."""
    parts = target.split("/")
    if parts[0] == "shardtensor" and len(parts) > 2 and parts[1] in cfg.index:
        return parts[1]
    if len(parts) > 1 and parts[0] in cfg.index:
        return parts[0]
    return None


def strip_comments_and_strings(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def source_files(root):
    for top in ("src", os.path.join("include", "shardtensor"), "python"):
        base = os.path.join(root, top)
        if not os.path.isdir(base):
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "build")
            for name in sorted(filenames):
                if name.endswith(SOURCE_EXT):
                    full = os.path.join(dirpath, name)
                    yield os.path.relpath(full, root).replace(os.sep, "/"), full


def umbrella_layer(root, cfg):
    """Including the umbrella header counts as including the highest layer it includes."""
    path = os.path.join(root, "include", UMBRELLA)
    best = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = INCLUDE_RE.match(line)
                lay = layer_of_include(m.group(2), cfg) if m else None
                if lay and (best is None or cfg.index[lay] > cfg.index[best]):
                    best = lay
    return best


def check_tree(root, cfg):
    """Returns the list of violations (strings)."""
    problems = []
    umbrella = umbrella_layer(root, cfg)
    for rel, full in source_files(root):
        mine = layer_of_file(rel, cfg)
        may_mpi = (mine in cfg.mpi_layers) or ((rel, "mpi") in cfg.allow)
        may_transport = mine == "comm" or ((rel, "transport") in cfg.allow)
        with open(full, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for no, line in enumerate(text.splitlines(), 1):
            m = INCLUDE_RE.match(line)
            if not m:
                continue
            target = m.group(2).strip()
            where = f"{rel}:{no}: #include {m.group(1)}{target}{'>' if m.group(1) == '<' else m.group(1)}"
            if target == "mpi.h" and not may_mpi:
                problems.append(f"{where}: <mpi.h> outside the layers that may use MPI "
                                f"({', '.join(sorted(cfg.mpi_layers))}) and not allow-listed "
                                f"in cmake/layers.txt")
                continue
            if (target == TRANSPORT or target.endswith("/" + TRANSPORT)) and not may_transport:
                problems.append(f"{where}: the transport is private to comm/; use comm/'s "
                                f"primitives, agreement or plain collectives instead")
                continue
            if mine is None:
                continue
            theirs = umbrella if target == UMBRELLA else layer_of_include(target, cfg)
            if theirs is not None and cfg.index[theirs] > cfg.index[mine]:
                problems.append(f"{where}: layer '{mine}' includes a header of layer "
                                f"'{theirs}', which is above it")
        if not may_mpi and mine is not None:
            code = strip_comments_and_strings(text)
            for no, line in enumerate(code.splitlines(), 1):
                for m in MPI_CALL_RE.finditer(line):
                    problems.append(f"{rel}:{no}: calls {m.group(0).rstrip('( ')} directly; "
                                    f"layer '{mine}' reaches MPI only through comm/")
    return problems


def render_table(cfg):
    lines = [DOC_BEGIN,
             "| # | folder | may use MPI | owns |",
             "|---|---|---|---|"]
    for i, name in enumerate(cfg.layers, 1):
        folder = "`python/`" if name == "python" else f"`{name}/`"
        lines.append(f"| {i} | {folder} | {'yes' if name in cfg.mpi_layers else 'no'} | "
                     f"{cfg.sentences[name]} |")
    lines.append("")
    lines.append("Allowed exceptions (a file above `comm/` that includes `<mpi.h>` or "
                 "`comm/transport.h`):")
    lines.append("")
    for (path, what), reason in sorted(cfg.allow.items()):
        lines.append(f"- `{path}` ({'`<mpi.h>`' if what == 'mpi' else '`comm/transport.h`'}): {reason}")
    lines.append(DOC_END)
    return "\n".join(lines)


def doc_block(doc_text):
    b = doc_text.find(DOC_BEGIN)
    e = doc_text.find(DOC_END)
    if b < 0 or e < b:
        return None, b, e
    return doc_text[b:e + len(DOC_END)], b, e


def check_doc(root, cfg):
    path = os.path.join(root, "docs", "architecture.md")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block, _, _ = doc_block(text)
    if block is None:
        return [f"docs/architecture.md: no generated layer table (markers {DOC_BEGIN!r} ... "
                f"{DOC_END!r})"]
    if block != render_table(cfg):
        return ["docs/architecture.md: the layer table differs from cmake/layers.txt; run "
                "/usr/bin/python3 cmake/check_layers.py --write-doc"]
    return []


def write_doc(root, cfg):
    path = os.path.join(root, "docs", "architecture.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block, b, e = doc_block(text)
    if block is None:
        raise SystemExit("docs/architecture.md: add the markers first:\n" + DOC_BEGIN + "\n" + DOC_END)
    text = text[:b] + render_table(cfg) + text[e + len(DOC_END):]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def run(root, config):
    cfg = read_config(config or os.path.join(root, "cmake", "layers.txt"))
    problems = check_tree(root, cfg) + check_doc(root, cfg)
    for p in problems:
        print(p)
    if problems:
        print(f"layering check: {len(problems)} violation(s) of cmake/layers.txt")
        return 1
    print(f"layering check: ok ({' < '.join(cfg.layers)})")
    return 0


def self_test(config):
    """Builds small trees with one wrong include each and asserts the check catches it."""
    cfg = read_config(config)
    cases = [
        ("src/ops/bad.cpp", '#include "nn/module_private.h"\n', "includes a header of layer 'nn'"),
        ("include/shardtensor/tensor/bad.h", "#include <shardtensor/ops/attention.h>\n",
         "includes a header of layer 'ops'"),
        ("src/tensor/bad.cpp", "#include <mpi.h>\n", "<mpi.h> outside"),
        ("src/nn/bad.cpp", '#include "comm/transport.h"\n', "the transport is private"),
        ("src/dispatch/bad.cpp", "void f() { int r; MPI_Comm_rank(c, &r); }\n",
         "calls MPI_Comm_rank directly"),
        ("src/spec/bad.cpp", "#include <mpi.h>\n", "<mpi.h> outside"),
        ("python/src/bad.cpp", '#include "comm/transport.h"\n', "the transport is private"),
    ]
    good = {
        "src/comm/ok.cpp": '#include <mpi.h>\n#include "comm/transport.h"\n#include "mesh/x.h"\n',
        "src/ops/ok.cpp": '#include "comm/agree.h"\n#include <shardtensor/tensor/shard_tensor.h>\n'
                          "// MPI_Comm_dup(...) in a comment is fine\n"
                          'const char* s = "MPI_Send(";\n',
        "src/nn/ok.cpp": "#include <shardtensor/ops/halo.h>\n",
    }
    failures = []
    for bad_path, bad_text, expect in cases + [(None, None, None)]:
        tmp = tempfile.mkdtemp(prefix="layers_selftest_")
        try:
            for path, text in good.items():
                os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
                with open(os.path.join(tmp, path), "w") as f:
                    f.write(text)
            if bad_path:
                os.makedirs(os.path.dirname(os.path.join(tmp, bad_path)), exist_ok=True)
                with open(os.path.join(tmp, bad_path), "w") as f:
                    f.write(bad_text)
            problems = check_tree(tmp, cfg)
            if bad_path is None:
                if problems:
                    failures.append(f"a clean tree was rejected: {problems}")
            elif not any(p.startswith(bad_path + ":1:") and expect in p for p in problems):
                failures.append(f"{bad_path} ({bad_text.strip()}) was not reported as "
                                f"'{expect}'; got {problems}")
            elif len(problems) != 1:
                failures.append(f"{bad_path}: expected exactly one violation, got {problems}")
            else:
                print(f"caught: {problems[0]}")
        finally:
            shutil.rmtree(tmp)
    # The doc check notices a table that drifted from the layer file.
    tmp = tempfile.mkdtemp(prefix="layers_selftest_")
    try:
        os.makedirs(os.path.join(tmp, "docs"))
        doc = os.path.join(tmp, "docs", "architecture.md")
        with open(doc, "w") as f:
            f.write("x\n" + render_table(cfg).replace("| 1 |", "| 0 |") + "\ny\n")
        if not check_doc(tmp, cfg):
            failures.append("a drifted layer table in docs/architecture.md was not reported")
        write_doc(tmp, cfg)
        if check_doc(tmp, cfg):
            failures.append("--write-doc did not produce a table the check accepts")
    finally:
        shutil.rmtree(tmp)
    for f in failures:
        print("SELF-TEST FAILED: " + f)
    print("layering self-test: " + ("FAILED" if failures else "ok"))
    return 1 if failures else 0


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="repository root")
    ap.add_argument("--config", default=None, help="layer file (default ROOT/cmake/layers.txt)")
    ap.add_argument("--write-doc", action="store_true", help="regenerate the doc's layer table")
    ap.add_argument("--self-test", action="store_true", help="check the check")
    a = ap.parse_args()
    if a.self_test:
        return self_test(a.config or os.path.join(here, "layers.txt"))
    if a.write_doc:
        write_doc(a.root, read_config(a.config or os.path.join(a.root, "cmake", "layers.txt")))
        return 0
    return run(a.root, a.config)


if __name__ == "__main__":
    sys.exit(main())
