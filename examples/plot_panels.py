"""Draws the examples' validation picture: 2-D fields side by side, each with its
title and a colour bar (matplotlib, Agg backend). One function for both languages:

* Python (examples/python/unet_train.py, fno_train.py) calls ``draw_panels`` (which
  calls ``plot_panels``) in the same process.
* C++ (examples/unet_train.cpp, fno_train.cpp; examples/models/diffusion.h) writes the
  fields on rank 0 to ``<name>_panels.json`` (the header below) + ``<name>_panels.f32``
  (raw float32, the panels one after the other, row-major) and runs

      python examples/plot_panels.py unet_train_panels.json [--out PNG]

  with the project's Python (CMake compiles its path in). Exit status 0: drawn;
  3: matplotlib (or numpy) is missing; anything else: an error.

The header (JSON; file names relative to the header's folder)::

    {"format": "shardtensor-panels-1", "data": "unet_train_panels.f32",
     "dtype": "float32", "byte_order": "little", "png": "unet_train.png",
     "suptitle": "...",
     "panels": [{"title": "u0", "shape": [512, 512], "vmin": 0.1, "vmax": 0.9,
                 "cmap": "viridis"}, ...]}

Panels that share a colour range (u0, prediction, target) are given the same
vmin/vmax by the caller, so their colours compare directly.
"""

import argparse
import json
import os
import sys

FORMAT = "shardtensor-panels-1"
MISSING_MATPLOTLIB = 3  # exit status of the command line when matplotlib cannot be imported


def _as_array(field):
    """A 2-D float numpy array from a numpy array or a (CPU) torch tensor."""
    import numpy as np

    if hasattr(field, "detach"):  # torch.Tensor, without importing torch here
        field = field.detach().to("cpu").double().numpy()
    a = np.asarray(field, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"plot_panels: a panel must be 2-D, got shape {a.shape}")
    return a


def plot_panels(png, fields, titles, ranges=None, cmaps=None, suptitle=None):
    """Writes ``png``: the 2-D ``fields`` side by side, panel i titled ``titles[i]``,
    coloured over ``ranges[i] = (vmin, vmax)`` (default: the field's own range) with
    colour map ``cmaps[i]`` (default viridis), each with its colour bar.
    Raises ImportError when matplotlib is missing (nothing is written then)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    n = len(fields)
    if len(titles) != n or (ranges is not None and len(ranges) != n) or (
            cmaps is not None and len(cmaps) != n):
        raise ValueError("plot_panels: fields, titles, ranges and cmaps differ in length")
    arrays = [_as_array(f) for f in fields]
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.6), squeeze=False,
                             layout="constrained")
    for i, (ax, a) in enumerate(zip(axes[0], arrays)):
        lo, hi = ranges[i] if ranges is not None else (float(a.min()), float(a.max()))
        if not hi > lo:  # a constant field: any non-empty range shows it
            hi = lo + 1e-12
        im = ax.imshow(a, cmap=(cmaps[i] if cmaps else None) or "viridis", vmin=lo, vmax=hi,
                       interpolation="nearest")
        ax.set_title(titles[i])
        ax.set_xticks([])
        ax.set_yticks([])
        # A triangle at an end of the bar marks values beyond the shared range (clipped).
        slack = 1e-6 * (hi - lo)  # float32 data against float64 limits
        extend = {(False, False): "neither", (True, False): "min", (False, True): "max",
                  (True, True): "both"}[(bool(a.min() < lo - slack), bool(a.max() > hi + slack))]
        fig.colorbar(im, ax=ax, shrink=0.85, pad=0.03, extend=extend)
    if suptitle:
        fig.suptitle(suptitle)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def save_panels(header_path, png, fields, titles, ranges, cmaps=None, suptitle=None):
    """Writes the fields as ``header_path`` (JSON) + its ``.f32`` data file, the format
    the command line reads; for a later ``python examples/plot_panels.py header_path``."""
    import numpy as np

    arrays = [_as_array(f).astype(np.float32) for f in fields]
    base = os.path.splitext(header_path)[0]
    data_path = base + ".f32"
    with open(data_path, "wb") as f:
        for a in arrays:
            f.write(np.ascontiguousarray(a).tobytes())
    header = {
        "format": FORMAT, "data": os.path.basename(data_path), "dtype": "float32",
        "byte_order": sys.byteorder, "png": os.path.relpath(png, os.path.dirname(
            os.path.abspath(header_path))), "suptitle": suptitle or "",
        "panels": [{"title": t, "shape": list(a.shape), "vmin": float(lo), "vmax": float(hi),
                    "cmap": (cmaps[i] if cmaps else None) or "viridis"}
                   for i, (t, a, (lo, hi)) in enumerate(zip(titles, arrays, ranges))],
    }
    with open(header_path, "w") as f:
        json.dump(header, f, indent=1)
    return header_path


def load_panels(header_path):
    """(header, fields) from a header written by save_panels or examples/models/diffusion.h."""
    import numpy as np

    with open(header_path) as f:
        header = json.load(f)
    if header.get("format") != FORMAT:
        raise ValueError(f"{header_path}: not a '{FORMAT}' header")
    folder = os.path.dirname(os.path.abspath(header_path))
    dtype = np.dtype(header.get("dtype", "float32")).newbyteorder(
        "<" if header.get("byte_order", "little") == "little" else ">")
    flat = np.fromfile(os.path.join(folder, header["data"]), dtype=dtype)
    fields, at = [], 0
    for p in header["panels"]:
        h, w = p["shape"]
        if at + h * w > flat.size:
            raise ValueError(f"{header_path}: the data file is shorter than its panels")
        fields.append(flat[at:at + h * w].reshape(h, w).astype(np.float64))
        at += h * w
    return header, fields


def draw_panels(png, fields, titles, ranges, suptitle=None, cmaps=None):
    """``plot_panels`` for the examples: never raises for a missing matplotlib, and
    returns one line for the log. Without matplotlib the fields are saved next to the
    PNG (``<png stem>_panels.json`` + ``.f32``) and the line says how to draw them."""
    try:
        plot_panels(png, fields, titles, ranges, cmaps, suptitle)
        return f"wrote {png}: " + " | ".join(titles)
    except ImportError as e:
        header = save_panels(os.path.splitext(png)[0] + "_panels.json", png, fields, titles,
                             ranges, cmaps, suptitle)
        return (f"could not draw {png} ({e.name or e} is not available to {sys.executable}); "
                f"its data is in {header} + {os.path.basename(os.path.splitext(header)[0])}.f32"
                f" ({' | '.join(titles)}): `python {os.path.abspath(__file__)} {header}` draws it")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("header", help="<name>_panels.json written by an example")
    ap.add_argument("--out", help="PNG to write (default: the header's png)")
    args = ap.parse_args(argv)
    try:
        header, fields = load_panels(args.header)
        folder = os.path.dirname(os.path.abspath(args.header))
        png = args.out or os.path.join(folder, header["png"])
        panels = header["panels"]
        plot_panels(png, fields, [p["title"] for p in panels],
                    [(p["vmin"], p["vmax"]) for p in panels], [p.get("cmap") for p in panels],
                    header.get("suptitle"))
    except ImportError as e:  # numpy or matplotlib
        print(f"plot_panels: {e.name or e} is not available to {sys.executable}", file=sys.stderr)
        return MISSING_MATPLOTLIB
    return 0


if __name__ == "__main__":
    sys.exit(main())
