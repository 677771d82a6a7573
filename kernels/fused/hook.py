"""The DDP / FSDP hooks' ``freeze_step`` passes (docs/ALGORITHMS.md 8.2), in every backend that has
them.

Unfused, a compressed iteration of a hook with ``freeze_step`` makes four passes over each bucket on
this rank: the pre-pass ``x = (g + c) / d`` with ``c = factor * m`` per parameter with a momentum (and
the local gradient norm), the worker's encode of ``x + e``, decompress (the deferred worker error and
the decode), and the post-pass ``out = out * d - c`` (``onebit.collectives._frozen_adam.frozen_pre_``:
the reference these passes are tested against, tests/test_triton_hook.py, test_hook_fused.py). Each
element takes the plain ops' float32 operations in their order (``c = m * factor``, ``g + c``, a
correctly rounded division; ``out * d``, ``- c``; contraction off): the bucket, the bits and the
errors are bitwise the unfused hook's; the norm's float64 sum of exact squares adds in another order.

- Triton (:func:`pre`, :func:`post`): one launch each way around the codec's own kernels (any block
  size, a mesh): ``_hook_pre_kernel`` reads g, the variances and the momenta, writes x over g and one
  float64 partial of ``sum g^2`` per program; ``_hook_post_kernel`` reads the average, the variances
  and the momenta.
- native C (:class:`NativePasses`, ``kernels/fused/hook.c``): the pre-pass inside the worker's encode
  and the post-pass inside decompress, run by run of about 4096 elements while they are in cache:
  two passes instead of four. :func:`hook_pre_range` and :func:`hook_post_range` are the passes alone
  over a range (a whole bucket where the codec's passes cannot take them: a mesh, a covered bucket).

The table (:mod:`onebit.kernels.fused.table`, :func:`table`, one for both backends): one entry per
parameter with a momentum (by offset), address columns ``ADDRESSES`` (its momentum; its frozen
variance, from which the passes make ``d`` as they read it, as the optimizers' passes do: no bucket of
denominators is made; or none, ``d = 1``; or, with the ``given`` scalar, float32 denominators as they
are), scalar columns ``SCALARS``. Elements of no entry (a parameter without a momentum, a gap) take
``c = 0`` and ``d = 1``. The C passes read and store a bfloat16 worker error themselves
(``BFLOAT16_ERRORS``: each run widened on the stack, stored rounded as :mod:`onebit.kernels.rounding`
stores it, bitwise) where the block is at most ``HOOK_RUN``."""

from __future__ import annotations

import ctypes

import torch

from .. import _chunks
from .._triton import AVAILABLE, constexpr, jit, tl
from ..cpu_simd import _f32, _isa, _threads, library
from ..layout import message_bits, message_scales
from .table import DENOMINATOR, Table, address, denominator, owned, scalar, tiles

if AVAILABLE:
    from ..triton_kernels import Launch

ADDRESSES = ("momentum", "var")
SCALARS = ("factor", "given", "unused2", "unused3", "unused4", *DENOMINATOR)
_MOM, _VAR = (constexpr(ADDRESSES.index(c)) for c in ADDRESSES)
_FACTOR, _GIVEN = constexpr(SCALARS.index("factor")), constexpr(SCALARS.index("given"))
BLOCK = 1024  # elements per program of the Triton passes
WARPS = 8
HOOK_RUN = 4096  # the C passes' runs (kernels/fused/hook.c): a bfloat16 error's buffer on the stack


def table(parts: list, sources: list, device="cpu") -> Table:
    """The table of ``parts`` (``(lo, hi, m, factor)`` as ``frozen_terms`` gives them) whose
    denominators come from ``sources`` (one per part: None, ``d = 1``; ``("v", v, (floor, r, eps))``,
    a frozen variance, float32 or bfloat16, contiguous: ``d = max(sqrt(v), floor) * r + eps``;
    ``("d", d)``, contiguous float32 denominators as they are), on ``device``; the factors rounded to
    float32 as the plain ``torch.mul(m, factor)`` rounds them."""
    rows, vars_ = [], []
    for (_, _, _, f), src in zip(parts, sources, strict=True):
        vars_.append(None if src is None else src[1])
        if src is not None and src[0] == "v":
            rows.append((float(f), 0.0, 0.0, 0.0, 0.0, *(float(x) for x in src[2])))
        else:
            rows.append((float(f), 0.0 if src is None else 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])
    t = Table([parts[i][0] for i in order], [parts[i][1] - parts[i][0] for i in order], ADDRESSES,
              SCALARS, device)
    t.fill({"momentum": [parts[i][2] for i in order], "var": [vars_[i] for i in order]},
           [rows[i] for i in order])
    return t


# ---- Triton ------------------------------------------------------------------------------------

@jit
def _terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr,
           BLOCK: tl.constexpr):
    # c = m * factor and d for the elements of each table entry the program meets (c 0 and d 1
    # elsewhere): d from the entry's variance (table.denominator), its given float32 denominators,
    # or 1 where it has neither (address 0)
    c = tl.zeros([BLOCK], dtype=tl.float32)
    d = tl.full([BLOCK], 1.0, tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        mp = address(addr_ptr, _MOM, K, k)
        c = tl.where(mine, tl.load(mp + off, mask=mine, other=0.0) * scalar(scal_ptr, k, _FACTOR), c)
        va = tl.load(addr_ptr + _VAR * K + k)
        has = (off * 0 + va) != 0  # (as a tensor of off's shape: the interpreter's masks are)
        given = (off * 0 + (scalar(scal_ptr, k, _GIVEN) != 0.0).to(tl.int32)) != 0
        made = denominator(addr_ptr, scal_ptr, _VAR, K, k, off, mine & has & (given == 0))
        kept = tl.load(va.to(tl.pointer_type(tl.float32)) + off, mask=mine & has & given, other=1.0)
        d = tl.where(mine & has, tl.where(given, kept, made), d)
    return c, d


@jit
def _hook_pre_kernel(buf_ptr, sq_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n,
                     BLOCK: tl.constexpr):
    # sq[pid] = sum g^2 (float64) of the program's elements; then g <- (g + c) / d in place
    pid = tl.program_id(0)  # int32 indices: the caller keeps n < 2^31
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    g = tl.load(buf_ptr + idx, mask=in_x, other=0.0)
    gd = g.to(tl.float64)
    tl.store(sq_ptr + pid, tl.sum(gd * gd, axis=0))
    c, d = _terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, BLOCK)
    tl.store(buf_ptr + idx, tl.div_rn(g + c, d), mask=in_x)


@jit
def _hook_post_kernel(buf_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n,
                      BLOCK: tl.constexpr):
    # out <- out * d - c in place
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    out = tl.load(buf_ptr + idx, mask=in_x, other=0.0)
    c, d = _terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, BLOCK)
    tl.store(buf_ptr + idx, out * d - c, mask=in_x)


def programs(n: int) -> int:
    return -(-n // BLOCK)


def pre_launches(buf, sq, t: Table, n: int) -> list:
    tl_ = tiles(t, -(-n // 8) * 8, BLOCK)
    return [Launch(_hook_pre_kernel, programs(n),
                   (buf, sq, tl_.lo, tl_.hi, t.start, t.count, t.addr, t.K, t.scal, n), dict(BLOCK=BLOCK),
                   WARPS)]


def post_launches(buf, t: Table, n: int) -> list:
    tl_ = tiles(t, -(-n // 8) * 8, BLOCK)
    return [Launch(_hook_post_kernel, programs(n),
                   (buf, tl_.lo, tl_.hi, t.start, t.count, t.addr, t.K, t.scal, n), dict(BLOCK=BLOCK),
                   WARPS)]


def pre(buf: torch.Tensor, t: Table) -> torch.Tensor:
    """``buf <- (buf + c) / d`` in one Triton launch; returns the float64 sum of squares of ``buf`` as it
    came (a 0-dimensional tensor on its device: no host synchronisation)."""
    n = buf.numel()
    sq = torch.empty(programs(n), dtype=torch.float64, device=buf.device)
    for launch in pre_launches(buf, sq, t, n):
        launch()
    return sq.sum()


def post(buf: torch.Tensor, t: Table) -> None:
    """``buf <- buf * d - c`` in one Triton launch."""
    for launch in post_launches(buf, t, buf.numel()):
        launch()


# ---- native C (kernels/fused/hook.c) -----------------------------------------------------------

def _args(t: Table) -> tuple:
    return (t.start.data_ptr(), t.count.data_ptr(), t.ptr("momentum"), t.ptr("var"), t.scal.data_ptr(), t.K)


def _error(e: torch.Tensor, block: int | None) -> int | None:
    """1 for a bfloat16 error the C reads and stores itself, 0 for a float32 one, None otherwise."""
    if _f32(e):
        return 0
    ok = e.dtype == torch.bfloat16 and e.is_contiguous() and e.device.type == "cpu"
    return 1 if ok and (block is None or block <= HOOK_RUN) else None


def hook_encode(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, off: int, n: int, block: int | None,
                table: Table, isa: int | None = None) -> tuple[torch.Tensor | float, float]:
    """The pre-pass over ``flat[off : off + n]`` (by :func:`table`'s) and the encode of
    ``flat + e`` there (n / 8 bytes of ``bits``; ``e`` float32, or bfloat16 with a block of at most
    ``HOOK_RUN``), run by run in one pass. Returns the block sums (float64, as
    :func:`onebit.kernels.cpu_simd.encode_blocks`) or, ``block`` None, the sum (as
    :func:`onebit.kernels.cpu_simd.encode_total` adds it); and the float64 sum of squares of the gradient
    as it came."""
    unit, ebf16 = block or 8, _error(e, block)
    if not (_f32(flat) and ebf16 is not None and bits.dtype == torch.uint8 and bits.is_contiguous()
            and bits.numel() >= n // 8 and n % unit == 0 and off >= 0
            and off + n <= min(flat.numel(), e.numel())):
        raise ValueError("hook.hook_encode: expected contiguous float32 flat and e (or a bfloat16 e, block "
                         "at most 4096) covering the range, n a multiple of the block (or of 8), and n / 8 "
                         "uint8 bits")
    sums = torch.empty(n // block if block else 0, dtype=torch.float64)
    sq = ctypes.c_double(0.0)
    total = library().onebit_hook_encode(flat.data_ptr(), e.data_ptr(), bits.data_ptr(), sums.data_ptr(), off,
                                         n, block or 0, *_args(table), ctypes.byref(sq), ebf16, _isa(isa),
                                         _threads(n))
    return (sums if block else float(total)), sq.value


def hook_decompress(bits: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor, e: torch.Tensor | None,
                    worker_scales: torch.Tensor | None, off: int, n: int, block: int | None, table: Table,
                    isa: int | None = None) -> None:
    """decompress of ``flat[off : off + n]`` (``scales``: one, or one per block of the range; ``e`` the
    whole worker error buffer, float32 or bfloat16 as :func:`hook_encode` takes it, or None: no error
    update) with the post-pass ``out = out * d - m * factor``
    (by the table) inside, run by run."""
    nb, ebf16 = n // block if block else 1, 0 if e is None else _error(e, block)
    if not (_f32(flat) and _f32(scales) and scales.numel() == nb and bits.dtype == torch.uint8
            and bits.is_contiguous() and bits.numel() >= n // 8 and n % (block or 8) == 0
            and off >= 0 and off + n <= flat.numel()
            and (e is None or (ebf16 is not None and off + n <= e.numel() and _f32(worker_scales)
                               and worker_scales.numel() == nb))):
        raise ValueError("hook.hook_decompress: expected contiguous float32 flat covering the range, n a "
                         "multiple of the block (or of 8), n / 8 uint8 bits, float32 scales per block")
    step = 1 if block else 0
    library().onebit_hook_decompress(
        bits.data_ptr(), scales.data_ptr(), step, flat.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scales is None else worker_scales.data_ptr(), step, off, n, block or 0, *_args(table),
        ebf16, _isa(isa), _threads(n))


def hook_pre_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> float:
    """The pre-pass alone over flat elements ``[a, b)`` (threaded); the float64 sum of squares of the
    gradient as it came (each thread's, added in thread order)."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("hook.hook_pre_range: expected contiguous float32 flat covering [a, b)")
    return float(library().onebit_hook_pre_range(flat.data_ptr(), a, b, *_args(table), _isa(isa),
                                                 _threads(b - a)))


def hook_post_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> None:
    """The post-pass alone over flat elements ``[a, b)`` (threaded)."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("hook.hook_post_range: expected contiguous float32 flat covering [a, b)")
    library().onebit_hook_post_range(flat.data_ptr(), a, b, *_args(table), _isa(isa), _threads(b - a))


class NativePasses:
    """``compressed_allreduce_passes``' worker and finish for one bucket's call in the C passes
    (``table``: :func:`table`'s); the worker hands the gradient's float64 sum of squares to
    ``norm(flat, sq)`` (the local norm). ``block``: the call's; with a block of at most ``HOOK_RUN``
    (or none) the passes read and store a bfloat16 worker error themselves."""

    def __init__(self, table: Table, norm, block: int | None = None) -> None:
        self.table, self.norm = table, norm
        self.BFLOAT16_ERRORS = block is None or block <= HOOK_RUN

    def worker(self, flat: torch.Tensor, worker_error: torch.Tensor, layout, msg: torch.Tensor) -> None:
        """The pre-pass and ``worker_compress(update_error=False)``, as the native codec computes it."""
        bits, n, sq = message_bits(msg, layout), flat.numel(), [0.0]

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            sums = []
            if mid > lo:
                got, q = hook_encode(flat, worker_error, bits[j], lo, mid - lo, layout.block, self.table)
                sums.append(got)  # per block a tensor, one per chunk a float
                sq[0] += q
            if min(hi, n) > mid:  # the padded chunk's data tail: the pre-pass alone, then the plain encode
                sq[0] += hook_pre_range(flat, mid, min(hi, n), self.table)
            return sums

        _chunks.encode_chunks(flat, worker_error, layout, msg, piece)
        self.norm(flat, sq[0])

    def finish(self, gathered: torch.Tensor, layout, flat: torch.Tensor, worker_error: torch.Tensor,
               msg: torch.Tensor) -> None:
        """decompress (the deferred worker error where the scales are finite) and the post-pass."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        update = bool(torch.isfinite(scales).all())
        s_w = message_scales(msg, layout) if update else None
        piece = _chunks.piece_scales
        for j in range(layout.W):
            lo, mid, hi = _chunks.split(layout, n, j)
            if mid > lo:
                hook_decompress(bits[j], piece(scales, layout, j, lo, lo, mid), flat,
                                worker_error if update else None,
                                piece(s_w, layout, j, lo, lo, mid) if update else None,
                                lo, mid - lo, layout.block, self.table)
            if hi == mid:
                continue
            e = worker_error if update else None  # the padded rest: the plain path's arithmetic
            _chunks.decode_tail(bits, scales, flat, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                hook_post_range(flat, mid, min(hi, n), self.table)
