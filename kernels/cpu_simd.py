"""The bindings of the native codec's C passes (``onebit/kernels/native/codec.c``), built with the
system's C compiler on first use (:mod:`onebit.kernels.native.build`) and loaded with ctypes.

The worker's encode (``z = x + e``, the float64 sum of ``z * z``, the bits of ``not z < 0``), the
server's two passes (the sum over the ranks' bits with its bits and sums; the error), decompress
(the deferred worker error, then the decode), the worker's error update and a float64 sum of
squares, each at copy bandwidth: one AVX-512 compare gives the 16 bits of 16 elements (AVX2: a
movemask, 8), a table reverses the bit order within each byte, and sums accumulate in float64
vectors.

The bits are bitwise the plain path's (NaN and -0.0 give 1); the sums are exact squares added in
float64 in another order (a scale can differ in its last float32 bit). Each block of ``block``
elements is summed on its own in a fixed order, so a block's sum does not depend on where a piece
starts or on the thread count (the sliced calls of onebit.collectives._pipeline stay bitwise the
unsliced ones); the whole-piece sum adds per-thread partial sums in thread order.

Used by :mod:`onebit.kernels.native.codec` where :func:`available`; the same library holds the
passes with an optimizer's maths inside, bound in each fused step's file (onebit.kernels.fused). A failed
build warns once and leaves CPU tensors to the plain path. ``ONEBIT_CPU_SIMD=off``: never this
path (A/B runs). Each function takes ``isa`` (2: AVX-512, 1: AVX2 + FMA, 0: portable C; None: the
best this CPU has, at most a forced ``native:<isa>``'s) so that the tests run every variant the machine
supports against the plain path.
"""

from __future__ import annotations

import ctypes
import os

import torch

from ._forcing import native_isa
from ._warn import warn_user
from .native import build

_ENV = "ONEBIT_CPU_SIMD"
_state: dict = {}


def library() -> ctypes.CDLL | None:
    """The built library, or None (``ONEBIT_CPU_SIMD=off``, or the build failed: warned once)."""
    if os.environ.get(_ENV, "") == "off":
        return None
    if "lib" not in _state:
        try:
            _state["lib"] = build.build()
        except Exception as exc:  # noqa: BLE001 - any failure to build means: not here
            _state["lib"] = None
            warn_user(f"onebit: the native CPU passes (C) could not be built ({type(exc).__name__}: {exc}); "
                      f"CPU tensors take the plain torch path (slower, the same bits). "
                      f"ONEBIT_BACKEND=plain silences this", RuntimeWarning)
    return _state["lib"]


def available() -> bool:
    """Whether the native passes can run here: the library built (on any CPU: AVX-512, AVX2 or its
    portable C). Whether they do is :func:`onebit.kernels.backends.select`'s answer."""
    if "available" not in _state:
        _state["available"] = library() is not None
    return _state["available"]


def best_isa() -> int:
    """The ISA level the passes use: this CPU's best (2: AVX-512, 1: AVX2 + FMA, 0: portable C), at
    most a forced ``native:<isa>``'s (:func:`onebit.kernels.backends.native_isa`)."""
    lib = library()
    return 0 if lib is None else min(int(lib.onebit_best_isa()), native_isa())


def _isa(isa: int | None) -> int:
    return best_isa() if isa is None else min(int(isa), best_isa())


def _threads(n: int) -> int:
    return 1 if n < (1 << 16) else torch.get_num_threads()


BF16_RUN = 4096  # the C's runs on a bfloat16 error (rounding.c's ENC16_RUN): a block at most this


def _bf16(e: torch.Tensor, block: int | None) -> bool:
    """Whether ``e`` is a bfloat16 error the C reads (and stores) run by run, ``block`` allowing it."""
    return (e.dtype == torch.bfloat16 and e.is_contiguous() and e.device.type == "cpu"
            and (block is None or block <= BF16_RUN))


def _ok(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, n: int, block: int | None = None) -> None:
    if not (x.dtype == torch.float32 and (e.dtype == torch.float32 or _bf16(e, block))
            and bits.dtype == torch.uint8 and x.is_contiguous()
            and e.is_contiguous() and bits.is_contiguous() and x.numel() == e.numel() == n
            and bits.numel() == n // 8 and n % 8 == 0 and x.device.type == "cpu"):
        raise ValueError("cpu_simd: expected contiguous float32 x and e (or a bfloat16 e, block at most "
                         "4096) of n elements (a multiple of 8) and n / 8 contiguous uint8 bits on the CPU")


def encode_total(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, isa: int | None = None) -> float:
    """Writes the packed bits of ``sgn(x + e)`` into ``bits`` and returns the float64 sum of
    ``(x + e)^2`` (``e`` bfloat16: widened run by run, the same bits and sum)."""
    n = x.numel()
    _ok(x, e, bits, n)
    fn = library().onebit_encode_total16 if e.dtype == torch.bfloat16 else library().onebit_encode_total
    return float(fn(x.data_ptr(), e.data_ptr(), bits.data_ptr(), n, _isa(isa), _threads(n)))


def encode_blocks(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, block: int,
                  isa: int | None = None) -> torch.Tensor:
    """Writes the packed bits of ``sgn(x + e)`` into ``bits``; returns each ``block``'s float64
    sum of squares (``block`` a multiple of 8 dividing ``x.numel()``; ``e`` bfloat16 with a block of at
    most ``BF16_RUN``)."""
    n = x.numel()
    _ok(x, e, bits, n, block)
    if block % 8 or n % block:
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    sums = torch.empty(n // block, dtype=torch.float64)
    fn = library().onebit_encode_blocks16 if e.dtype == torch.bfloat16 else library().onebit_encode_blocks
    fn(x.data_ptr(), e.data_ptr(), bits.data_ptr(), sums.data_ptr(), n, block, _isa(isa), _threads(n))
    return sums


def _server_ok(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, out: torch.Tensor, blocks: int,
               block: int | None = None) -> None:
    W, n = bits.shape[0], e.numel()
    bf16 = block is not None and _bf16(e, block)  # with block scales only (one scale: server_reduce_one)
    if not (bits.dtype == out.dtype == torch.uint8 and w.dtype == torch.float32
            and (e.dtype == torch.float32 or bf16)
            and bits.dim() == 2 and bits.stride(1) == 1 and bits.shape[1] == n // 8 and w.is_contiguous()
            and w.numel() == W * blocks and e.is_contiguous() and out.is_contiguous()
            and out.numel() == n // 8 and n % 8 == 0 and bits.device.type == "cpu"):
        raise ValueError("cpu_simd: expected bits uint8 [W, n/8] with contiguous rows, weights float32 "
                         "[W, blocks], e float32 [n] (a multiple of 8; bfloat16 with blocks of at most 4096) "
                         "and out uint8 [n/8], contiguous, on the CPU")


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
    """The server's whole call with one scale per chunk (:func:`onebit.kernels.native.codec.server_reduce`
    in one call): ``scales`` the W received scales (float32, any stride), the packed bits of
    ``m`` into ``out``, its scale into ``scale`` (one float32, NaN where a received scale or the
    sum is not finite), then the error pass where the scale is finite; returns whether it ran. ``e``
    bfloat16: read run by run, stored rounded (:mod:`onebit.kernels.rounding`), the same bits as
    widening it and storing it after."""
    n = e.numel()
    bf16 = e.dtype == torch.bfloat16 and e.is_contiguous() and e.device.type == "cpu"
    if not (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.stride(1) == 1 and bits.shape[1] == n // 8
            and scales.dtype == torch.float32 and scales.dim() == 1 and scales.numel() == bits.shape[0]
            and (_f32(e) or bf16) and n % 8 == 0 and out.dtype == torch.uint8 and out.is_contiguous()
            and out.numel() == n // 8 and scale.dtype == torch.float32 and scale.numel() == 1):
        raise ValueError("cpu_simd.server_reduce_one: expected bits uint8 [W, n/8] with contiguous rows, W "
                         "float32 scales, e float32 or bfloat16 [n] (a multiple of 8), out uint8 [n/8] and "
                         "one float32 scale")
    fn = library().onebit_server_reduce_one16 if bf16 else library().onebit_server_reduce_one
    return bool(fn(bits.data_ptr(), bits.stride(0), bits.shape[0], scales.data_ptr(), scales.stride(0),
                   e.data_ptr(), out.data_ptr(), scale.data_ptr(), n, _isa(None), _threads(n)))


def server_blocks(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, out: torch.Tensor, block: int,
                  isa: int | None = None) -> torch.Tensor:
    """As :func:`server_total` with ``w`` [W, n / block] (rank r's weight for each block); returns
    each block's float64 sum of squares."""
    n = e.numel()
    if block % 8 or n % block:
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    _server_ok(bits, w, e, out, n // block, block)
    sums = torch.empty(n // block, dtype=torch.float64)
    fn = library().onebit_server_blocks16 if e.dtype == torch.bfloat16 else library().onebit_server_blocks
    fn(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(), e.data_ptr(), out.data_ptr(),
       sums.data_ptr(), n, block, _isa(isa), _threads(n))
    return sums


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"


def decompress(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int | None,
               worker_error: torch.Tensor | None = None, worker_scales: torch.Tensor | None = None,
               isa: int | None = None, index: int = 0) -> None:
    """One pass over ``out`` (n elements): with ``worker_error``, first the deferred worker error
    ``e = z - copysign(ws, z + 0)``, ``z = out + e``; then the decode ``out = sgn * s`` of
    ``bits``. ``scales`` and ``worker_scales``: one scale (``block`` None) or one per ``block``. A
    bfloat16 ``worker_error`` (block at most ``BF16_RUN``) is widened and stored run by run, rounded as
    :func:`onebit.kernels.rounding.narrow_` rounds element ``index + i`` of its buffer (``index``: where
    this piece starts in it)."""
    n = out.numel()
    per = 1 if block is None else n // block
    if not (_f32(out) and _f32(scales) and scales.numel() == per and bits.dtype == torch.uint8
            and bits.is_contiguous() and bits.numel() == n // 8 and n % 8 == 0
            and (block is None or (block % 8 == 0 and n % block == 0))
            and (worker_error is None or ((_f32(worker_error) or _bf16(worker_error, block))
                                          and worker_error.numel() == n
                                          and _f32(worker_scales) and worker_scales.numel() == per))):
        raise ValueError("cpu_simd.decompress: expected contiguous float32 out (n, a multiple of 8 and of "
                         "block), n / 8 uint8 bits, float32 scales, one or one per block, and a float32 "
                         "worker error (or bfloat16, block at most 4096)")
    step = 0 if block is None else 1
    e = None if worker_error is None else worker_error.data_ptr()
    ws = None if worker_scales is None else worker_scales.data_ptr()
    size = n if block is None else block
    if worker_error is not None and worker_error.dtype == torch.bfloat16:
        library().onebit_decompress16(bits.data_ptr(), scales.data_ptr(), step, out.data_ptr(), e, ws, step,
                                      n, size, index, _isa(isa), _threads(n))
        return
    library().onebit_decompress(bits.data_ptr(), scales.data_ptr(), step, out.data_ptr(), e, ws, step, n,
                                size, _isa(isa), _threads(n))


def error_update(x: torch.Tensor, e: torch.Tensor, scales: torch.Tensor, block: int | None,
                 isa: int | None = None) -> None:
    """The worker's error update ``e = z - copysign(s, z + 0)``, ``z = x + e``, in one pass over n
    elements (a multiple of 8): ``scales`` one scale (``block`` None) or one per ``block``."""
    n = x.numel()
    per = 1 if block is None else n // (block or 1)
    if not (_f32(x) and _f32(e) and e.numel() == n and _f32(scales) and scales.numel() == per and n % 8 == 0
            and (block is None or (block % 8 == 0 and n % block == 0))):
        raise ValueError("cpu_simd.error_update: expected contiguous float32 x and e of n elements (a "
                         "multiple of 8 and of block) and float32 scales, one or one per block, on the CPU")
    step = 0 if block is None else 1
    library().onebit_error_update(x.data_ptr(), e.data_ptr(), scales.data_ptr(), step, n,
                                  n if block is None else block, _isa(isa), _threads(n))


def server_update(bits: torch.Tensor, w: torch.Tensor, e: torch.Tensor, scales: torch.Tensor,
                  block: int | None, isa: int | None = None, index: int = 0) -> None:
    """The server's error pass: ``m`` again as :func:`server_total` / :func:`server_blocks` sum
    it, then ``e = m - copysign(s, m + 0)`` (every ISA level: AVX-512 16 elements, AVX2 8 at a time).
    ``e`` bfloat16 (block scales of at most ``BF16_RUN``): widened and stored rounded run by run, element
    ``i`` as element ``index + i`` of its buffer."""
    n = e.numel()
    blocks = 1 if block is None else n // block
    if block is not None and (block % 8 or n % block):
        raise ValueError(f"block: expected a multiple of 8 dividing {n}, got {block}")
    _server_ok(bits, w, e, torch.empty(n // 8, dtype=torch.uint8), blocks, block)
    if not (_f32(scales) and scales.numel() == blocks):
        raise ValueError("cpu_simd.server_update: expected float32 scales, one or one per block")
    if e.dtype == torch.bfloat16:  # stored rounded run by run (onebit.kernels.rounding, the server's role)
        library().onebit_server_update16(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(),
                                         e.data_ptr(), scales.data_ptr(), n, block, index, _isa(isa),
                                         _threads(n))
        return
    step = 0 if block is None else 1
    library().onebit_server_update(bits.data_ptr(), bits.stride(0), bits.shape[0], w.data_ptr(), step,
                                   e.data_ptr(), scales.data_ptr(), step, n, n if block is None else block,
                                   _isa(isa), _threads(n))


def sumsq(x: torch.Tensor, isa: int | None = None) -> float:
    """The float64 sum of squares of a contiguous float32 CPU tensor (exact squares, float64 adds:
    what ``torch.linalg.vector_norm(x, dtype=torch.float64) ** 2`` estimates, without its float64
    copy of ``x``)."""
    if not _f32(x):
        raise ValueError(f"cpu_simd.sumsq: expected a contiguous float32 CPU tensor, got {x.dtype} on "
                         f"{x.device}")
    return float(library().onebit_sumsq(x.data_ptr(), x.numel(), _isa(isa), _threads(x.numel())))
