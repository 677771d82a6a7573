"""The sign-packing pass of the CPU codec in C with SIMD intrinsics, built with the system's C
compiler on first use and loaded with ctypes.

torch's compiler vectorises the codec's element-wise passes but not the packing of 8 signs into a
byte (element 8k+i in bit 7-i of byte k): its loop over the bytes stays scalar, and the worker's
encode (``z = x + e``, the float64 sum of ``z * z``, the bits of ``not z < 0``) ran at 0.25-0.4 of
copy bandwidth (bench/HISTORY.md, "A C encode"; no formulation in torch ops did better). Here one
AVX-512 compare gives the 16 bits of 16 elements (AVX2: a movemask, 8), a table reverses the bit
order within each byte, and the sum accumulates in float64 vectors: the pass runs at copy bandwidth.

Same contract and float32 arithmetic as :func:`onebit.kernels.cpu_compiled._encode`: the bits are
bitwise the plain path's (NaN and -0.0 give 1); the sums are exact squares added in float64 in
another order (a scale can differ in its last float32 bit, as the compiled path's can). Each block
of ``block`` elements is summed on its own in a fixed order, so a block's sum does not depend on
where a piece starts or on the thread count (the sliced calls of onebit.collectives._pipeline stay
bitwise the unsliced ones); the whole-piece sum adds per-thread partial sums in thread order.

Used by :mod:`onebit.kernels.cpu_compiled` (the worker's encode of float32 inputs, the server's
first pass) where :func:`available`; else its torch.compile'd passes run. The library is cached
under ``$XDG_CACHE_HOME/onebit`` (or ``~/.cache/onebit``, else the temporary folder), keyed by the
source's hash; a failed build warns once and leaves the compiled path in place.
``ONEBIT_CPU_SIMD=off``: never this path (A/B runs).
Each function takes ``isa`` (2: AVX-512, 1: AVX2 + FMA, 0: portable C; None: the best this CPU
has) so that the tests run every variant the machine supports against the plain path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

from ._simd_source import SOURCE
from ._warn import warn_user

_ENV = "ONEBIT_CPU_SIMD"
_state: dict = {}


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


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]
    key = hashlib.sha256((SOURCE + cc + " ".join(flags)).encode()).hexdigest()[:16]
    d = _cache_dir()
    path = os.path.join(d, f"simd-{key}.so")
    if not os.path.exists(path):
        fd, src = tempfile.mkstemp(suffix=".c", dir=d)
        with os.fdopen(fd, "w") as fh:
            fh.write(SOURCE)
        tmp = src[:-2] + ".so"
        try:
            run = subprocess.run([cc, *flags, src, "-o", tmp], capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                last = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
                raise RuntimeError(f"{cc} failed: {last}")
            os.replace(tmp, path)  # atomic: ranks that build at once each install a whole file
        finally:
            for f in (src, tmp):
                if os.path.exists(f):
                    os.remove(f)
    lib = ctypes.CDLL(path)
    p = ctypes.c_void_p
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.onebit_encode_total.argtypes = [p, p, p, i64, i32, i32]
    lib.onebit_encode_total.restype = ctypes.c_double
    lib.onebit_encode_blocks.argtypes = [p, p, p, p, i64, i64, i32, i32]
    lib.onebit_encode_blocks.restype = None
    lib.onebit_best_isa.restype = ctypes.c_int
    lib.onebit_server_total.argtypes = [p, i64, i32, p, p, p, i64, i32, i32]
    lib.onebit_server_reduce_one.argtypes = [p, i64, i32, p, i64, p, p, p, i64, i32, i32]
    lib.onebit_server_reduce_one.restype = i32
    lib.onebit_server_total.restype = ctypes.c_double
    lib.onebit_server_blocks.argtypes = [p, i64, i32, p, p, p, p, i64, i64, i32, i32]
    lib.onebit_server_blocks.restype = None
    lib.onebit_decompress.argtypes = [p, p, i64, p, p, p, i64, i64, i64, i32, i32]
    lib.onebit_decompress.restype = None
    lib.onebit_server_update.argtypes = [p, i64, i32, p, i64, p, p, i64, i64, i64, i32, i32]
    lib.onebit_server_update.restype = None
    lib.onebit_fold_encode.argtypes = [p, p, p, i64, i64, i64, p, p, p, p, p, i32, i32, i32]
    lib.onebit_fold_encode.restype = ctypes.c_double
    lib.onebit_decompress_update.argtypes = [p, p, p, p, p, i64, i64, p, p, p, p, i32, ctypes.c_float,
                                             ctypes.c_float, i32, i32]
    lib.onebit_decompress_update.restype = None
    lib.onebit_fold_encode_all.argtypes = [p, p, p, i64, i64, i32, p, p, p, p, p, p, p, p, p, i32, i32, i32]
    lib.onebit_fold_encode_all.restype = None
    lib.onebit_decompress_update_all.argtypes = [p, i64, p, p, p, p, i64, i32, p, p, p, p, p, i32,
                                                 ctypes.c_float, ctypes.c_float, i32, i32]
    lib.onebit_decompress_update_all.restype = None
    lib.onebit_update.argtypes = [p, i64, i64, p, p, p, p, i32, ctypes.c_float, ctypes.c_float, i32]
    lib.onebit_update.restype = None
    lib.onebit_sumsq.argtypes = [p, i64, i32, i32]
    lib.onebit_sumsq.restype = ctypes.c_double
    lib.onebit_hook_pre.argtypes = [p, p, p, ctypes.c_float, i64, i32, i32]
    lib.onebit_hook_pre.restype = ctypes.c_double
    lib.onebit_hook_encode.argtypes = [p, p, p, p, i64, i64, i64, p, p, p, p, p, i32, p, i32, i32]
    lib.onebit_hook_encode.restype = ctypes.c_double
    lib.onebit_hook_decompress.argtypes = [p, p, i64, p, p, p, i64, i64, i64, i64, p, p, p, p, p, i32, i32,
                                           i32]
    lib.onebit_hook_decompress.restype = None
    lib.onebit_hook_pre_range.argtypes = [p, i64, i64, p, p, p, p, p, i32, i32]
    lib.onebit_hook_pre_range.restype = ctypes.c_double
    lib.onebit_hook_post_range.argtypes = [p, i64, i64, p, p, p, p, p, i32, i32]
    lib.onebit_hook_post_range.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The built library, or None (``ONEBIT_CPU_SIMD=off``, or the build failed: warned once)."""
    if os.environ.get(_ENV, "") == "off":
        return None
    if "lib" not in _state:
        try:
            _state["lib"] = _build()
        except Exception as exc:  # noqa: BLE001 - any failure to build means: not here
            _state["lib"] = None
            warn_user(f"onebit: the C sign-packing pass could not be built ({type(exc).__name__}: {exc}); "
                      f"the compiled CPU codec packs signs with torch.compile's loops (slower, same bits). "
                      f"{_ENV}=off silences this", RuntimeWarning)
    return _state["lib"]


def available() -> bool:
    """Whether the codec takes these passes: built, on a CPU with AVX2 or AVX-512 (the portable C
    variant is a reference for the tests, slower than torch.compile's loops: not chosen), and not
    ``ONEBIT_CPU_CODEC=torch`` (which keeps every CPU pass plain)."""
    if os.environ.get("ONEBIT_CPU_CODEC", "") == "torch":  # every CPU pass plain (cpu_compiled's switch)
        return False
    if "available" not in _state:
        _state["available"] = library() is not None and best_isa() >= 1
    return _state["available"]


def best_isa() -> int:
    lib = library()
    return 0 if lib is None else int(lib.onebit_best_isa())


def _isa(isa: int | None) -> int:
    return best_isa() if isa is None else min(int(isa), best_isa())


def _threads(n: int) -> int:
    return 1 if n < (1 << 16) else torch.get_num_threads()


def _ok(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, n: int) -> None:
    if not (x.dtype == e.dtype == torch.float32 and bits.dtype == torch.uint8 and x.is_contiguous()
            and e.is_contiguous() and bits.is_contiguous() and x.numel() == e.numel() == n
            and bits.numel() == n // 8 and n % 8 == 0 and x.device.type == "cpu"):
        raise ValueError("cpu_simd: expected contiguous float32 x and e of n elements (a multiple of 8) and "
                         "n / 8 contiguous uint8 bits on the CPU")


def encode_total(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, isa: int | None = None) -> float:
    """Writes the packed bits of ``sgn(x + e)`` into ``bits`` and returns the float64 sum of
    ``(x + e)^2``."""
    n = x.numel()
    _ok(x, e, bits, n)
    return float(library().onebit_encode_total(x.data_ptr(), e.data_ptr(), bits.data_ptr(), n, _isa(isa),
                                                _threads(n)))


def encode_blocks(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, block: int,
                  isa: int | None = None) -> torch.Tensor:
    """Writes the packed bits of ``sgn(x + e)`` into ``bits``; returns each ``block``'s float64
    sum of squares (``block`` a multiple of 8 dividing ``x.numel()``)."""
    n = x.numel()
    _ok(x, e, bits, n)
    if block % 8 or n % block:
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    sums = torch.empty(n // block, dtype=torch.float64)
    library().onebit_encode_blocks(x.data_ptr(), e.data_ptr(), bits.data_ptr(), sums.data_ptr(), n, block,
                                   _isa(isa), _threads(n))
    return sums


def _server_ok(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
    W, n = bits.shape[0], e.numel()
    if not (bits.dtype == out.dtype == torch.uint8 and w.dtype == e.dtype == torch.float32
            and bits.dim() == 2 and bits.stride(1) == 1 and bits.shape[1] == n // 8 and w.is_contiguous()
            and w.numel() == W * blocks and e.is_contiguous() and out.is_contiguous()
            and out.numel() == n // 8 and n % 8 == 0 and bits.device.type == "cpu"):
        raise ValueError("cpu_simd: expected bits uint8 [W, n/8] with contiguous rows, weights float32 "
                         "[W, blocks], e float32 [n] (a multiple of 8) and out uint8 [n/8], contiguous, "
                         "on the CPU")


def server_total(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, out: torch.Tensor,
                 isa: int | None = None) -> float:
    """The server's first pass with one weight per rank: ``m = sum_r sgn_r * w[r] + e`` (ranks in
    order), its packed bits into ``out``; returns the float64 sum of ``m^2``. ``bits``: uint8 [W, n/8]."""
    _server_ok(bits, w, e, out, 1)
    n = e.numel()
    return float(library().onebit_server_total(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(),
                                               e.data_ptr(), out.data_ptr(), n, _isa(isa), _threads(n)))


def server_reduce_one(bits: torch.Tensor, scales: torch.Tensor, e: torch.Tensor, out: torch.Tensor,
                      scale: torch.Tensor) -> bool:
    """The server's whole call with one scale per chunk on AVX-512 (``cpu_compiled.server_reduce``'s
    C path in one call): ``scales`` the W received scales (float32, any stride), the packed bits of
    ``m`` into ``out``, its scale into ``scale`` (one float32, NaN where a received scale or the
    sum is not finite), then the error pass where the scale is finite; returns whether it ran."""
    n = e.numel()
    if not (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.stride(1) == 1 and bits.shape[1] == n // 8
            and scales.dtype == torch.float32 and scales.dim() == 1 and scales.numel() == bits.shape[0]
            and _f32(e) and n % 8 == 0 and out.dtype == torch.uint8 and out.is_contiguous()
            and out.numel() == n // 8 and scale.dtype == torch.float32 and scale.numel() == 1
            and best_isa() >= 2):
        raise ValueError("cpu_simd.server_reduce_one: expected bits uint8 [W, n/8] with contiguous rows, W "
                         "float32 scales, e float32 [n] (a multiple of 8), out uint8 [n/8], one float32 "
                         "scale, and an AVX-512 CPU")
    return bool(library().onebit_server_reduce_one(bits.data_ptr(), bits.stride(0), bits.shape[0],
                                                   scales.data_ptr(), scales.stride(0), e.data_ptr(),
                                                   out.data_ptr(), scale.data_ptr(), n, _isa(None),
                                                   _threads(n)))


def server_blocks(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, out: torch.Tensor, block: int,
                  isa: int | None = None) -> torch.Tensor:
    """As :func:`server_total` with ``w`` [W, n / block] (rank r's weight for each block); returns
    each block's float64 sum of squares."""
    n = e.numel()
    if block % 8 or n % block:
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    _server_ok(bits, w, e, out, n // block)
    sums = torch.empty(n // block, dtype=torch.float64)
    library().onebit_server_blocks(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(), e.data_ptr(),
                                   out.data_ptr(), sums.data_ptr(), n, block, _isa(isa), _threads(n))
    return sums


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int | None,
               worker_error: torch.Tensor | None = None, worker_scales: torch.Tensor | None = None,
               isa: int | None = None) -> None:
    """One pass over ``out`` (n elements): with ``worker_error``, first the deferred worker error
    ``e = z - copysign(ws, z + 0)``, ``z = out + e``; then the decode ``out = sgn * s`` of
    ``bits``. ``scales`` and ``worker_scales``: one scale (``block`` None) or one per ``block``."""
    n = out.numel()
    per = 1 if block is None else n // block
    if not (_f32(out) and _f32(scales) and scales.numel() == per and bits.dtype == torch.uint8
            and bits.is_contiguous() and bits.numel() == n // 8 and n % 8 == 0
            and (block is None or (block % 8 == 0 and n % block == 0))
            and (worker_error is None or (_f32(worker_error) and worker_error.numel() == n
                                          and _f32(worker_scales) and worker_scales.numel() == per))):
        raise ValueError("cpu_simd.decompress: expected contiguous float32 out (n, a multiple of 8 and of "
                         "block), n / 8 uint8 bits, and float32 scales, one or one per block")
    step = 0 if block is None else 1
    e = None if worker_error is None else worker_error.data_ptr()
    ws = None if worker_scales is None else worker_scales.data_ptr()
    library().onebit_decompress(bits.data_ptr(), scales.data_ptr(), step, out.data_ptr(), e, ws, step, n,
                                n if block is None else block, _isa(isa), _threads(n))


def server_update(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, scales: torch.Tensor,
                  block: int | None, isa: int | None = None) -> bool:
    """The server's error pass: ``m`` again as :func:`server_total` / :func:`server_blocks` sum
    it, then ``e = m - copysign(s, m + 0)``. Returns False, having done nothing, where this CPU
    has no AVX-512 and no ``isa`` is asked for (the compiled pass is the faster one there)."""
    n = e.numel()
    blocks = 1 if block is None else n // block
    if block is not None and (block % 8 or n % block):
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    _server_ok(bits, w, e, torch.empty(n // 8, dtype=torch.uint8), blocks)
    if not (_f32(scales) and scales.numel() == blocks):
        raise ValueError("cpu_simd.server_update: expected float32 scales, one or one per block")
    if isa is None and best_isa() < 2:
        return False
    step = 0 if block is None else 1
    library().onebit_server_update(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(), step,
                                   e.data_ptr(), scales.data_ptr(), step, n, n if block is None else block,
                                   _isa(isa), _threads(n))
    return True


class Table:
    """A bucket's tensors for the fused passes: tensor k covers flat elements ``[start[k], start[k]
    + count[k])``; ``g``, ``d``, ``p`` the addresses of its gradient (0: none, a zero gradient),
    frozen denominator and parameter (float32, contiguous, ``count[k]`` elements, alive for the
    call); ``scalars`` [K, 5] float32: b1, 1 - b1, 1 - lr * wd, -lr, bc1."""

    def __init__(self, start: list[int], count: list[int]) -> None:
        self.start = torch.tensor(start, dtype=torch.int64)
        self.count = torch.tensor(count, dtype=torch.int64)
        self.K = len(start)
        self.g = torch.zeros(self.K, dtype=torch.int64)
        self.d = torch.zeros(self.K, dtype=torch.int64)
        self.p = torch.zeros(self.K, dtype=torch.int64)
        self.scalars = torch.zeros(self.K, 5, dtype=torch.float32)
        self.key = None  # what the caller last filled in (optimizers/_fused_cpu.py)


def fold_encode(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, off: int, n_enc: int, n_fold: int,
                table: Table, isa: int | None = None) -> float:
    """Fold the gradients into ``flat[off : off + n_fold]`` (``u = u * b1 + (w * g) / d``) and
    encode ``flat + e`` over ``[off, off + n_enc)`` into ``bits`` (n_enc / 8 bytes) in the same
    pass; returns the float64 sum of squares, as :func:`encode_total`."""
    if not (_f32(flat) and _f32(e) and bits.dtype == torch.uint8 and bits.is_contiguous()
            and bits.numel() >= n_enc // 8 and n_enc % 8 == 0 and 0 <= n_enc <= n_fold
            and off + n_fold <= flat.numel() and off + n_enc <= e.numel()):
        raise ValueError("cpu_simd.fold_encode: expected contiguous float32 flat and e covering the range, "
                         "n_enc a multiple of 8, and n_enc / 8 uint8 bits")
    t = table
    return float(library().onebit_fold_encode(
        flat.data_ptr(), e.data_ptr(), bits.data_ptr(), off, n_enc, n_fold, t.start.data_ptr(),
        t.count.data_ptr(), t.g.data_ptr(), t.d.data_ptr(), t.scalars.data_ptr(), t.K, _isa(isa),
        _threads(n_enc)))


def decompress_update(bits: torch.Tensor, scale: torch.Tensor, flat: torch.Tensor, e: torch.Tensor | None,
                      worker_scale: torch.Tensor | None, off: int, n: int, table: Table, clip: float,
                      isa: int | None = None) -> None:
    """:func:`decompress` of ``flat[off : off + n]`` (one scale; ``e`` the whole worker error
    buffer, or None: no error update), then in the same pass ``p = p * decay + (-lr) *
    clamp(u / bc1, -clip, clip)`` for the parameters it covers."""
    if not (_f32(flat) and _f32(scale) and scale.numel() == 1 and bits.dtype == torch.uint8
            and bits.is_contiguous() and bits.numel() >= n // 8 and n % 8 == 0 and off + n <= flat.numel()
            and (e is None or (_f32(e) and off + n <= e.numel() and _f32(worker_scale)
                               and worker_scale.numel() == 1))):
        raise ValueError("cpu_simd.decompress_update: expected contiguous float32 flat covering the range, "
                         "n a multiple of 8, n / 8 uint8 bits and one float32 scale")
    t = table
    library().onebit_decompress_update(
        bits.data_ptr(), scale.data_ptr(), flat.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scale is None else worker_scale.data_ptr(), off, n, t.start.data_ptr(),
        t.count.data_ptr(), t.p.data_ptr(), t.scalars.data_ptr(), t.K, -clip, clip, _isa(isa), _threads(n))


def _rows(bits: torch.Tensor, C: int, W: int) -> bool:
    return (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.shape[0] == W and bits.shape[1] == C // 8
            and bits.stride(1) == 1)


def fold_encode_all(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int, n_enc: list[int],
                    n_fold: list[int], table: Table, isa: int | None = None) -> list[float]:
    """:func:`fold_encode` of every chunk of a bucket in one call: chunk j (elements ``[j C, j C +
    n_enc[j])``, its fold to ``j C + n_fold[j]``) into ``bits[j]`` (a message's ``[W, C / 8]``
    rows); returns each chunk's sum, bitwise those of W calls."""
    W = len(n_enc)
    if not (_f32(flat) and _f32(e) and _rows(bits, C, W) and len(n_fold) == W
            and all(a % 8 == 0 and 0 <= a <= b <= C and (b == 0 or (j * C + b <= flat.numel()
                                                                  and j * C + a <= e.numel()))
                    for j, (a, b) in enumerate(zip(n_enc, n_fold, strict=True)))):
        raise ValueError("cpu_simd.fold_encode_all: expected contiguous float32 flat and e, bits [W, C / 8] "
                         "with contiguous rows, and per chunk n_enc (a multiple of 8) <= n_fold <= C")
    enc, fold = torch.tensor(n_enc, dtype=torch.int64), torch.tensor(n_fold, dtype=torch.int64)
    threads = torch.get_num_threads()
    sums, part = torch.empty(W, dtype=torch.float64), torch.empty(W * threads, dtype=torch.float64)
    t = table
    library().onebit_fold_encode_all(
        flat.data_ptr(), e.data_ptr(), bits.data_ptr(), bits.stride(0), C, W, enc.data_ptr(), fold.data_ptr(),
        sums.data_ptr(), part.data_ptr(), t.start.data_ptr(), t.count.data_ptr(), t.g.data_ptr(),
        t.d.data_ptr(), t.scalars.data_ptr(), t.K, _isa(isa), threads)
    return sums.tolist()


def decompress_update_all(bits: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor,
                          e: torch.Tensor | None, worker_scales: torch.Tensor | None, C: int, n: list[int],
                          table: Table, clip: float, isa: int | None = None) -> None:
    """:func:`decompress_update` of every chunk of a bucket in one call: chunk j's elements ``[j C,
    j C + n[j])`` from ``bits[j]`` with ``scales[j]`` (and ``worker_scales[j]``; ``e`` None: no
    error update)."""
    W = len(n)
    if not (_f32(flat) and _rows(bits, C, W) and _f32(scales) and scales.numel() == W
            and all(a % 8 == 0 and 0 <= a <= C and (a == 0 or j * C + a <= flat.numel())
                    for j, a in enumerate(n))
            and (e is None or (_f32(e) and _f32(worker_scales) and worker_scales.numel() == W
                               and all(a == 0 or j * C + a <= e.numel() for j, a in enumerate(n))))):
        raise ValueError("cpu_simd.decompress_update_all: expected contiguous float32 flat, bits [W, C / 8] "
                         "with contiguous rows, W float32 scales and per chunk n (a multiple of 8) <= C")
    counts = torch.tensor(n, dtype=torch.int64)
    t = table
    library().onebit_decompress_update_all(
        bits.data_ptr(), bits.stride(0), scales.data_ptr(), flat.data_ptr(),
        None if e is None else e.data_ptr(), None if worker_scales is None else worker_scales.data_ptr(),
        C, W, counts.data_ptr(), t.start.data_ptr(), t.count.data_ptr(), t.p.data_ptr(), t.scalars.data_ptr(),
        t.K, -clip, clip, _isa(isa), torch.get_num_threads())


def update(flat: torch.Tensor, a: int, b: int, table: Table, clip: float, isa: int | None = None) -> None:
    """The update alone for flat elements ``[a, b)``."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd.update: expected contiguous float32 flat covering [a, b)")
    t = table
    library().onebit_update(flat.data_ptr(), a, b, t.start.data_ptr(), t.count.data_ptr(), t.p.data_ptr(),
                            t.scalars.data_ptr(), t.K, -clip, clip, _isa(isa))


def sumsq(x: torch.Tensor, isa: int | None = None) -> float:
    """The float64 sum of squares of a contiguous float32 CPU tensor (exact squares, float64 adds:
    what ``torch.linalg.vector_norm(x, dtype=torch.float64) ** 2`` estimates, without its float64
    copy of ``x``: 31 against 1.2 ms per 6.5M elements on one core)."""
    if not _f32(x):
        raise ValueError(f"cpu_simd.sumsq: expected a contiguous float32 CPU tensor, got {x.dtype} on "
                         f"{x.device}")
    return float(library().onebit_sumsq(x.data_ptr(), x.numel(), _isa(isa), _threads(x.numel())))


def hook_pre(g: torch.Tensor, m: torch.Tensor, d: torch.Tensor, factor: float,
             isa: int | None = None) -> float:
    """The DDP hook's pre-pass ``g = (g + m * factor) / d`` in place (float32, cpu_fused.hook_pre_'s
    order: bitwise the same), returning the float64 sum of squares of ``g`` as it came: the local
    gradient norm and the pass in one read."""
    n = g.numel()
    if not (_f32(g) and _f32(m) and _f32(d) and m.numel() == n and d.numel() == n):
        raise ValueError("cpu_simd.hook_pre: expected contiguous float32 CPU g, m and d of one size")
    k = float(torch.tensor(factor, dtype=torch.float32))  # rounded as cpu_fused rounds its scalars
    return float(library().onebit_hook_pre(g.data_ptr(), m.data_ptr(), d.data_ptr(), k, n, _isa(isa),
                                           _threads(n)))


def hook_table(parts: list) -> Table:
    """The DDP hook's table (its passes below): per parameter with momentum ``(lo, hi, m, factor)``
    (flat range, contiguous float32 momentum, factor) in flat order, with ``d`` set by
    :func:`hook_table_fill`: entry k's ``g`` is the momentum's address, ``d`` the denominators',
    ``scalars[k, 0]`` the factor (rounded to float32 as cpu_fused rounds its scalars)."""
    table = Table([lo for lo, _, _, _ in parts], [hi - lo for lo, hi, _, _ in parts])
    table.g.copy_(torch.tensor([m.data_ptr() for _, _, m, _ in parts], dtype=torch.int64))
    factors = torch.tensor([float(f) for _, _, _, f in parts], dtype=torch.float64)
    table.scalars[:, 0] = factors.to(torch.float32)
    return table


def hook_table_fill(table: Table, d: torch.Tensor) -> Table:
    """Point the table's denominators into the bucket's flat ``d`` (contiguous float32)."""
    table.d.copy_(table.start * d.element_size() + d.data_ptr())
    return table


def _hook_args(t: Table) -> tuple:
    return (t.start.data_ptr(), t.count.data_ptr(), t.g.data_ptr(), t.d.data_ptr(), t.scalars.data_ptr(), t.K)


def hook_encode(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, off: int, n: int, block: int | None,
                table: Table, isa: int | None = None) -> tuple[torch.Tensor | float, float]:
    """The DDP hook's pre-pass over ``flat[off : off + n]`` (:func:`hook_pre`'s, by the table) and
    the encode of ``flat + e`` there (n / 8 bytes of ``bits``), run by run in one pass. Returns the
    block sums (float64, as :func:`encode_blocks`) or, ``block`` None, the sum (as
    :func:`fold_encode` adds it); and the float64 sum of squares of the gradient as it came."""
    unit = block or 8
    if not (_f32(flat) and _f32(e) and bits.dtype == torch.uint8 and bits.is_contiguous()
            and bits.numel() >= n // 8 and n % unit == 0 and off >= 0
            and off + n <= min(flat.numel(), e.numel())):
        raise ValueError("cpu_simd.hook_encode: expected contiguous float32 flat and e covering the range, "
                         "n a multiple of the block (or of 8), and n / 8 uint8 bits")
    sums = torch.empty(n // block if block else 0, dtype=torch.float64)
    sq = ctypes.c_double(0.0)
    total = library().onebit_hook_encode(flat.data_ptr(), e.data_ptr(), bits.data_ptr(), sums.data_ptr(), off,
                                         n, block or 0, *_hook_args(table), ctypes.byref(sq), _isa(isa),
                                         _threads(n))
    return (sums if block else float(total)), sq.value


def hook_decompress(bits: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor, e: torch.Tensor | None,
                    worker_scales: torch.Tensor | None, off: int, n: int, block: int | None, table: Table,
                    isa: int | None = None) -> None:
    """:func:`decompress` of ``flat[off : off + n]`` (``scales``: one, or one per block of the range;
    ``e`` the whole worker error buffer, or None: no error update) with the hook's post-pass
    ``out = out * d - m * factor`` (by the table) inside, run by run."""
    nb = n // block if block else 1
    if not (_f32(flat) and _f32(scales) and scales.numel() == nb and bits.dtype == torch.uint8
            and bits.is_contiguous() and bits.numel() >= n // 8 and n % (block or 8) == 0
            and off >= 0 and off + n <= flat.numel()
            and (e is None or (_f32(e) and off + n <= e.numel() and _f32(worker_scales)
                               and worker_scales.numel() == nb))):
        raise ValueError("cpu_simd.hook_decompress: expected contiguous float32 flat covering the range, "
                         "n a multiple of the block (or of 8), n / 8 uint8 bits, float32 scales per block")
    step = 1 if block else 0
    library().onebit_hook_decompress(
        bits.data_ptr(), scales.data_ptr(), step, flat.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scales is None else worker_scales.data_ptr(), step, off, n, block or 0,
        *_hook_args(table), _isa(isa), _threads(n))


def hook_pre_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> float:
    """The hook's pre-pass alone over flat elements ``[a, b)``; the sum of squares of the gradient."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd.hook_pre_range: expected contiguous float32 flat covering [a, b)")
    return float(library().onebit_hook_pre_range(flat.data_ptr(), a, b, *_hook_args(table), _isa(isa)))


def hook_post_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> None:
    """The hook's post-pass alone over flat elements ``[a, b)``."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd.hook_post_range: expected contiguous float32 flat covering [a, b)")
    library().onebit_hook_post_range(flat.data_ptr(), a, b, *_hook_args(table), _isa(isa))
