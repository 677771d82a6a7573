"""Builds the native CPU passes (the ``.c`` files shipped with the package) into one shared library
with the system's C compiler, caches it, and loads it with ctypes.

The sources are compiled as ONE translation unit: a small unit file that ``#include``s them in
:data:`SOURCES` order (the compiler's messages then name the real files and lines). The library is
cached under ``$XDG_CACHE_HOME/onebit`` (or ``~/.cache/onebit``, else the temporary folder), keyed by
the hash of every source's text, the compiler and its flags: an edit of any ``.c`` or ``.h`` builds a
new one. Ranks that build at once each write a whole file and rename it into place.

``ONEBIT_BACKEND=native:avx2`` (or ``native:c``; :func:`onebit.kernels.backends.native_isa`) caps the
instruction set the passes use below what the CPU has: what a machine without AVX-512 (or without
AVX2) runs, measured on one with it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# in this order: native.h's declarations are defined in codec.c, which the fused passes call
SOURCES = (_HERE / "codec.c", _HERE / "rounding.c", _HERE / "sketch.c", _HERE.parent / "fused" / "adam.c",
           _HERE.parent / "fused" / "zero_one.c", _HERE.parent / "fused" / "hook.c")
HEADERS = (_HERE / "native.h",)
# -fno-math-errno: sqrtf is the instruction (vectorised; correctly rounded either way), not a call
# that sets errno
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (os.path.join(base, "onebit"), os.path.join(tempfile.gettempdir(), f"onebit-{os.getuid()}")):
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache folder")


def source_key(cc: str) -> str:
    """The cache key: every source's and header's text, the compiler and the flags."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update((cc + " " + " ".join(FLAGS)).encode())
    return h.hexdigest()[:16]


def build() -> ctypes.CDLL:
    """The library, built on first use (raises where there is no compiler or it fails)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    missing = [str(p) for p in SOURCES + HEADERS if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"the package's C sources are missing: {', '.join(missing)}")
    d = _cache_dir()
    path = os.path.join(d, f"native-{source_key(cc)}.so")
    if not os.path.exists(path):
        fd, unit = tempfile.mkstemp(suffix=".c", dir=d)
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(f'#include "{p}"\n' for p in SOURCES))
        tmp = unit[:-2] + ".so"
        try:
            run = subprocess.run([cc, *FLAGS, unit, "-o", tmp], capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                errors = [ln for ln in run.stderr.splitlines() if ": error" in ln or ": fatal error" in ln]
                errors = errors or run.stderr.splitlines()
                raise RuntimeError(f"{cc} failed: {errors[0] if errors else ''}")
            os.replace(tmp, path)  # atomic: ranks that build at once each install a whole file
        finally:
            for f in (unit, tmp):
                if os.path.exists(f):
                    os.remove(f)
    lib = ctypes.CDLL(path)
    for name, signature in SIGNATURES.items():
        result, args = signature.split(":")
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _TYPES[result], [_TYPES[a] for a in args.split()]
    return lib


_TYPES = {"p": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int, "f32": ctypes.c_float,
          "f64": ctypes.c_double, "-": None}
# name -> "return type: argument types" of every exported function (p: a pointer, -: void)
SIGNATURES = {
    "onebit_best_isa": "i32: ",
    "onebit_encode_total": "f64: p p p i64 i32 i32",
    "onebit_encode_blocks": "-: p p p p i64 i64 i32 i32",
    "onebit_server_total": "f64: p i64 i32 p p p i64 i32 i32",
    "onebit_server_reduce_one": "i32: p i64 i32 p i64 p p p i64 i32 i32",
    "onebit_server_reduce_one16": "i32: p i64 i32 p i64 p p p i64 i32 i32",
    "onebit_server_blocks": "-: p i64 i32 p p p p i64 i64 i32 i32",
    "onebit_decompress": "-: p p i64 p p p i64 i64 i64 i32 i32",
    "onebit_encode_total16": "f64: p p p i64 i32 i32",
    "onebit_server_blocks16": "-: p i64 i32 p p p p i64 i64 i32 i32",
    "onebit_server_update16": "-: p i64 i32 p p p i64 i64 i64 i32 i32",
    "onebit_encode_blocks16": "-: p p p p i64 i64 i32 i32",
    "onebit_decompress16": "-: p p i64 p p p i64 i64 i64 i64 i32 i32",
    "onebit_server_update": "-: p i64 i32 p i64 p p i64 i64 i64 i32 i32",
    "onebit_sumsq": "f64: p i64 i32 i32",
    "onebit_error_update": "-: p p p i64 i64 i64 i32 i32",
    "onebit_fold_encode_all": "-: p p p i64 i64 i32 p p p p p p p p p i32 p i64 p p i32 i32 i32",
    "onebit_decompress_update_all": ("-: p i64 p p p p i64 i32 p p p p p p p i32 f32 f32 p i64 p "
                                     "i32 i32 i32 i32"),
    "onebit_update": "-: p i64 i64 p p p p i32 f32 f32 i32",
    "onebit_zoa_encode_all": "-: p p p i64 i64 i32 p p p p p p p p p p i32 i32 i32 i32 i32",
    "onebit_zoa_step_all": "-: p i64 p p p i64 i32 p p p p p p p p i32 f32 f32 i32 i32 i32 i32",
    "onebit_zoa_step_range": "-: p i64 i64 p p p p p p p i32 f32 f32 i32 i32",
    "onebit_hook_encode": "f64: p p p p i64 i64 i64 p p p p p i32 p i32 i32 i32",
    "onebit_hook_decompress": "-: p p i64 p p p i64 i64 i64 i64 p p p p p i32 i32 i32 i32",
    "onebit_hook_pre_range": "f64: p i64 i64 p p p p p i32 i32 i32",
    "onebit_hook_post_range": "-: p i64 i64 p p p p p i32 i32 i32",
    "onebit_fold": "-: p p p f32 f32 f32 f32 f32 i64 i32 i32 i32",
    "onebit_stale_denominator": "-: p p f32 f32 f32 i64 i32 i32 i32",
    "onebit_stale_update": "-: p p f32 f32 f32 f32 f32 i64 i32 i32",
    "onebit_stale_step": "-: p p p f32 f32 f32 f32 f32 f32 f32 i64 i32 i32 i32",
    "onebit_local_step": "-: p p p p f32 f32 f32 f32 f32 f32 f32 f32 f32 i64 i32 i32 i32",
    "onebit_narrow": "-: p p p i64 i64 i32 i32 i32",
    "onebit_count_sketch": "-: p i64 i32 i64 p i32",
    "onebit_zoa_momentum": "-: p p p f32 f32 f32 f32 i64 i32 i32 i32",
    "onebit_frozen_adam": "-: p p p p f32 f32 f32 f32 f32 f32 f32 i64 i32 i32",
}
