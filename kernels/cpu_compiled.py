"""The CPU codec compiled by torch's own compiler (inductor's C++ backend): the worker's pass
(sign bits and sum of squares in one loop over the bytes), the server's two passes (its sum over
the W ranks' bits with the bits and sums, then its error) and decompress (the deferred worker
error, then the decode, 32 elements per 4-byte word), against the half dozen passes per stage
of :mod:`onebit.kernels.torch_kernels`.

Same contracts and the same float32 arithmetic as the plain-torch path (``z = x + e``; the
server's sum in rank order; products with +-1 exact), so the packed bits and, for equal scales,
the errors and outputs are bitwise equal to it. The scales come from float64 sums of squares in
another order, so a scale can differ from the plain path's in its last float32 bit, and an error
with it (tests/test_cpu_compiled.py; the plain path stays the reference). Block scales compile
where ``block % 32 == 0`` and a chunk holds two blocks or more (:func:`_block_fns`); the stages
in ``SLOW_COMPILED`` run the plain path.

Work goes chunk by chunk over the elements that ``x`` (or ``out``) covers; the padded tail of
the last chunk (fewer than ``8 * W`` or ``block * W`` elements) goes through plain torch. The
compiled functions take symbolic sizes (one compile each, not one per size). Compiling needs
a C++ compiler: :func:`usable` tries once, and without one warns once and leaves every call
to the plain path. :mod:`onebit.kernels.api` picks this path for CPU tensors from
``MIN_NUMEL`` elements on (smaller calls would spend more on the first compile than they
save), or with ``backend="compiled"``; ``ONEBIT_CPU_CODEC=torch`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch

from . import cpu_simd, torch_kernels
from ._chunks import block_of, decode_tail, encode_chunks, minus_sgn_scaled, piece_scales, scaled, split
from ._warn import warn_user
from .layout import Layout, message_bits, message_scales

# What runs the plain path: the worker's error update with block scales (not on the collective's
# path, which defers it into decompress), and block lengths that are not multiples of 32 (a
# 4-byte word would straddle two blocks; with a symbolic block length the loops ran 4-40x slower).
SLOW_COMPILED = ("block-scale worker error update", "block lengths not a multiple of 32")
MIN_NUMEL = 1 << 20  # elements (padded N) from which api picks this path for CPU tensors
_ENV = "ONEBIT_CPU_CODEC"  # "torch": never this path; anything else: the default choice
_state: dict[str, bool] = {}


# element i of a 32-element word: bit 7 - i % 8 of byte i // 8 (bytes little-endian in the word)
_WORD_SHIFTS = [8 * (i // 8) + 7 - i % 8 for i in range(32)]


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """float32 +-1 of packed bits (element 8k+i in bit 7-i of byte k), length 8 * bits.numel()."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=bits.device)
    one = (bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return (one.to(torch.float32) * 2.0 - 1.0).reshape(-1)


def _encode(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of squares of each 8 elements, packed bits of ``sgn(z)``). The sums per
    scale block are added outside (an eager sum over ``N/8`` float64s: a reduction inside the
    compiled loop over a symbolic block length ran 4x slower than the whole pass)."""
    z8 = z.view(-1, 8)
    zd = z8.to(torch.float64)
    sums8 = zd[:, 0] * zd[:, 0]
    packed = (z8[:, 0] < 0).logical_not().to(torch.int32) * 128  # NaN and -0.0: bit 1, as pack_signs
    for k in range(1, 8):  # column by column: one loop over the bytes, vectorised along them
        sums8 = sums8 + zd[:, k] * zd[:, k]
        packed = packed + (z8[:, k] < 0).logical_not().to(torch.int32) * (1 << (7 - k))
    return sums8, packed.to(torch.uint8)


def _block_sums(sums8: torch.Tensor, block: int) -> torch.Tensor:
    return sums8.view(-1, block // 8).sum(-1)


def _worker_encode(x, e):
    return _encode(x.to(torch.float32) + e)


def _worker_encode_total(x, e):
    """(float64 sum of squares of the whole piece, packed bits): without block scales only the
    total is needed, and summing it inside the pass saves writing and reading 1 B per element
    of 8-element sums (the pass runs 15-30% faster)."""
    sums8, packed = _encode(x.to(torch.float32) + e)
    return sums8.sum(), packed


def _server_column(bits: torch.Tensor, w: torch.Tensor, e_k: torch.Tensor, k: int) -> torch.Tensor:
    """Column k of the server's ``m = sum_r sgn_r * w_r + e`` (elements 8j+k), ranks in order as
    the plain path adds them (products with +-1 exact): one loop over the bytes, W rows of bits
    read, no unpacked signs materialised. ``bits``: int32 [W, bytes...]; ``w``: [W] (or [W,
    blocks, 1]); ``e_k``: column k of e, [bytes...]."""
    shift = 7 - k
    m = torch.where(((bits[0] >> shift) & 1) == 1, w[0], -w[0])
    for r in range(1, bits.shape[0]):
        m = m + torch.where(((bits[r] >> shift) & 1) == 1, w[r], -w[r])
    return m + e_k


def _server_encode(bits, w, e):
    """(float64 sum of squares of each 8 elements of m, packed bits of ``sgn(m)``), as
    :func:`_encode` computes them, column by column (3x faster than stacking the columns)."""
    b, e8 = bits.to(torch.int32), e.view(-1, 8)
    sums8 = packed = None
    for k in range(8):
        m = _server_column(b, w, e8[:, k], k)
        md = m.to(torch.float64)
        bit = (m < 0).logical_not().to(torch.int32) * (1 << (7 - k))  # NaN and -0.0: bit 1
        sums8 = md * md if sums8 is None else sums8 + md * md
        packed = bit if packed is None else packed + bit
    return sums8, packed.to(torch.uint8)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.cache
def _fns() -> dict:
    """The compiled passes: the worker's encode, and the element-wise passes with one scale
    broadcast over the piece (no block scales; see SLOW_COMPILED for the rest). Built on first
    use: torch.compile imports torch._dynamo (about 2 s), which `import onebit` need not pay."""

    def worker_update(x, e, scales) -> None:
        e.copy_(minus_sgn_scaled(x.to(torch.float32) + e, scales, None))

    def decode32(bits, scales, out) -> None:
        # 32 elements per 4-byte word (the word assembled from the bytes: no alignment needed),
        # one AVX-512 float vector wide: 7x faster than 8 elements per byte, the same values
        b4 = bits.view(-1, 4).to(torch.int32)
        word = (b4[:, 0] | (b4[:, 1] << 8) | (b4[:, 2] << 16) | (b4[:, 3] << 24)).unsqueeze(-1)
        shifts = torch.tensor(_WORD_SHIFTS, dtype=torch.int32, device=bits.device)
        signs = torch.where(((word >> shifts) & 1) == 1, 1.0, -1.0)
        out.view(-1, 32).copy_((signs * scales).to(out.dtype))

    def server_update(bits, w, e, scale) -> None:  # m again from the bits and e, then its error
        b, e8 = bits.to(torch.int32), e.view(-1, 8)
        m = torch.stack([_server_column(b, w, e8[:, k], k) for k in range(8)], 1)
        e8.copy_(minus_sgn_scaled(m, scale, None))

    return {"worker_encode": _compile(_worker_encode), "worker_encode_total": _compile(_worker_encode_total),
            "worker_update": _compile(worker_update),
            "decode32": _compile(decode32),
            "server_encode": _compile(_server_encode), "server_update": _compile(server_update)}


def _marked(t: torch.Tensor, dynamic: int = 0) -> torch.Tensor:
    """``t`` for the block-scale passes: dimension ``dynamic`` (the blocks) dynamic, every other
    one static. With the block length static inside the loops they vectorise; with the whole
    shape symbolic (``dynamic=True``) the same loops ran 4-40x slower."""
    for d in range(t.dim()):
        (torch._dynamo.mark_dynamic if d == dynamic else torch._dynamo.mark_static)(t, d)
    return t


def _word_signs(b4: torch.Tensor) -> torch.Tensor:
    """+-1.0 of the 32 elements of each 4 bytes in the last dimension of ``b4`` (int32 [..., 4]):
    the word assembled from the bytes (no alignment needed), one AVX-512 float vector wide."""
    word = (b4[..., 0] | (b4[..., 1] << 8) | (b4[..., 2] << 16) | (b4[..., 3] << 24)).unsqueeze(-1)
    shifts = torch.tensor(_WORD_SHIFTS, dtype=torch.int32, device=b4.device)
    return torch.where(((word >> shifts) & 1) == 1, 1.0, -1.0)


def _server_encode_blocks(bits, w, e):
    """As :func:`_server_encode` on ``[W, blocks, block/8]`` bits, ``[W, blocks]`` weights (viewed
    as [W, blocks, 1] inside: 10% faster than taking that shape) and ``[blocks, block/8, 8]`` e;
    returns the float64 sums of squares of each 8 elements ``[blocks, block/8]`` (the caller sums
    each block's: the pass with that sum inside ran 1.7x slower) and the bits."""
    b = bits.to(torch.int32)
    w = w.view(w.shape[0], -1, 1)
    sums = packed = None
    for k in range(8):
        m = _server_column(b, w, e[..., k], k)
        md = m.to(torch.float64)
        bit = (m < 0).logical_not().to(torch.int32) * (1 << (7 - k))
        sums = md * md if sums is None else sums + md * md
        packed = bit if packed is None else packed + bit
    return sums, packed.to(torch.uint8)


def _server_update_words(bits, w, e, scales) -> None:
    """The server's error pass, 32 elements per word of each rank (4-5x faster than by columns):
    ``bits`` uint8 [W, rows, K, 4], ``w`` [W, rows or 1, 1, 1], ``e`` [rows, K, 32], ``scales``
    [rows or 1, 1, 1]; m recomputed in rank order as the plain path adds it."""
    b = bits.to(torch.int32)
    m = _word_signs(b[0]) * w[0]
    for r in range(1, b.shape[0]):
        m = m + _word_signs(b[r]) * w[r]
    m = m + e
    e.copy_(minus_sgn_scaled(m, scales, None))


def _server_update_blocks(bits, w, e, scales) -> None:
    """:func:`_server_update_words` with block scales: ``bits`` uint8 [W, blocks, block/32, 4],
    ``w`` [W, blocks], ``e`` [blocks, block/32, 32], ``scales`` [blocks]. The weights and scales
    come in without size-1 dimensions and are viewed inside: with them broadcast from [W, blocks,
    1, 1] and [blocks, 1, 1] arguments the same loop ran 2.5x slower."""
    b = bits.to(torch.int32)
    wv, sv = w.view(w.shape[0], -1, 1, 1), scales.view(-1, 1, 1)
    m = _word_signs(b[0]) * wv[0]
    for r in range(1, b.shape[0]):
        m = m + _word_signs(b[r]) * wv[r]
    m = m + e
    e.copy_(minus_sgn_scaled(m, sv, None))


def _error_update_blocks(x, scales, e) -> None:  # [blocks, block], [blocks, 1], [blocks, block]
    e.copy_(minus_sgn_scaled(x.to(torch.float32) + e, scales, None))


def _decode_blocks(bits, scales, out) -> None:  # [blocks, block/32, 4 | 1 | 32]
    out.copy_((_word_signs(bits.to(torch.int32)) * scales).to(out.dtype))


@functools.cache
def _block_fns() -> dict:
    """The block-scale passes (block % 32 == 0): the error update, the decode and the server's
    two passes, called on views whose block dimensions are static (see :func:`_marked`): one
    build per block length, every size. Callers: :func:`server_reduce`, :func:`decompress`."""
    def compiled(fn):
        return torch.compile(fn, dynamic=None, fullgraph=True)

    return {"error_update": compiled(_error_update_blocks), "decode": compiled(_decode_blocks),
            "server_encode": compiled(_server_encode_blocks),
            "server_update": compiled(_server_update_words),
            "server_update_blocks": compiled(_server_update_blocks)}


def _blocks_compiled(layout: Layout) -> bool:
    """Block scales the compiled passes take: words within blocks, two blocks or more a chunk (a
    dynamic dimension must not be 1)."""
    return layout.block is not None and layout.block % 32 == 0 and layout.C >= 2 * layout.block


def usable() -> bool:
    """Whether compiled functions run here (tried once: a compile and a check of its result);
    without a working C++ compiler warns once and answers False from then on."""
    if "ok" not in _state:
        try:
            z = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, float("nan")] * 3)[:16]
            # called as worker_compress calls it (views of pieces, autograd off): the graph
            # compiled here is the one every later call reuses, not a first of two
            with torch.no_grad():
                total, bits = _fns()["worker_encode_total"](z, torch.zeros(24)[:16])
            ok = torch.equal(bits, torch_kernels.pack_signs(z)) and total.isnan().item()
            why = "its result differed from the plain path's"
        except Exception as exc:  # noqa: BLE001 - any failure to compile means: not here
            ok, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _state["ok"] = ok
        if not ok:
            warn_user(f"onebit: the compiled CPU codec is not available ({why}); CPU tensors use the "
                          "plain-torch kernels (slower, same results). A C++ compiler for torch.compile "
                          f"enables it; {_ENV}=torch silences this", RuntimeWarning)
    return _state["ok"]


def chosen(layout: Layout) -> bool:
    """api's default choice for a CPU call of this layout."""
    return layout.N >= MIN_NUMEL and os.environ.get(_ENV, "") != "torch" and usable()


@torch.no_grad()
def worker_compress(x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor,
                    update_error: bool) -> None:
    """:func:`torch_kernels.worker_compress`, compiled."""
    bits, scales = message_bits(out, layout), message_scales(out, layout)
    simd = x.dtype == torch.float32 and x.is_contiguous() and e.is_contiguous() and cpu_simd.available()

    def piece(j: int, lo: int, mid: int, hi: int) -> list:
        if mid == lo:
            return []
        if simd:  # the C pass (onebit.kernels.cpu_simd): at copy bandwidth
            out_bits = bits[j, : (mid - lo) // 8]
            if layout.block is None:
                total = cpu_simd.encode_total(x[lo:mid], e[lo:mid], out_bits)
                return [torch.tensor([total], dtype=torch.float64)]
            return [cpu_simd.encode_blocks(x[lo:mid], e[lo:mid], out_bits, layout.block)]
        if layout.block is None:  # the piece's sum of squares inside the pass
            piece_sum, packed = _fns()["worker_encode_total"](x[lo:mid], e[lo:mid])
            bits[j, : (mid - lo) // 8] = packed
            return [piece_sum.view(1)]
        sums8, packed = _fns()["worker_encode"](x[lo:mid], e[lo:mid])
        bits[j, : (mid - lo) // 8] = packed
        return [_block_sums(sums8, block_of(layout, lo, mid))]

    encode_chunks(x, e, layout, out, piece)
    finite = bool(torch.isfinite(scales).all())
    if not (update_error and finite):
        return
    if layout.block is not None:  # per-block scales: the plain path's update (see SLOW_COMPILED)
        for j, lo, hi in torch_kernels._pieces(layout):
            a, b = lo - j * layout.C, hi - j * layout.C
            torch_kernels._minus_sgn_scaled_blocks(torch_kernels._z(x, e, lo, hi),
                                                   scales[j, a // layout.block : b // layout.block], e[lo:hi])
        return
    for j in range(layout.W):
        lo, mid, hi = split(layout, x.numel(), j)
        if mid > lo:
            _fns()["worker_update"](x[lo:mid], e[lo:mid], piece_scales(scales, layout, j, lo, lo, mid))
        if hi > mid:
            tail = piece_scales(scales, layout, j, lo, mid, hi)
            e[mid:hi] = minus_sgn_scaled(torch_kernels._z(x, e, mid, hi), tail, block_of(layout, mid, hi))


@torch.no_grad()
def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """:func:`torch_kernels.server_reduce`, compiled: one pass for the sums of squares and the
    bits, one for the error (m recomputed from the bits and e, as the Triton server does);
    with block scales the plain path's (see SLOW_COMPILED)."""
    if layout.block is not None and not _blocks_compiled(layout):
        torch_kernels.server_reduce(received, e, layout, out)
        return
    bits, received_scales = message_bits(received, layout), message_scales(received, layout)
    if layout.block is None and e.is_contiguous() and cpu_simd.available():
        seg_bits, seg_scale = message_bits(out, layout)[0], message_scales(out, layout)[:1]
        if seg_bits.is_contiguous():  # the whole call in C, as below
            cpu_simd.server_reduce_one(bits, received_scales, e, seg_bits, seg_scale)
            return
    weights = received_scales * (1.0 / layout.W)  # 1/W multiplied, as the plain path
    scales, finite = message_scales(out, layout)[0], bool(torch.isfinite(received_scales).all())
    B = layout.block
    fns = _fns()
    simd = cpu_simd.available() and e.is_contiguous()
    if simd:  # the C pass (onebit.kernels.cpu_simd), its bits straight into the segment
        packed, w = message_bits(out, layout)[0], weights.contiguous()
        if not packed.is_contiguous():
            packed = torch.empty(layout.C // 8, dtype=torch.uint8)
        if B is None:
            sums = torch.tensor(cpu_simd.server_total(bits, w, e, packed), dtype=torch.float64) / layout.C
        else:
            sums = cpu_simd.server_blocks(bits, w, e, packed, B) / B
        scale = torch.sqrt(sums).to(torch.float32)
    elif B is None:
        sums8, packed = fns["server_encode"](bits, weights, e)
        scale = torch.sqrt(sums8.sum() / layout.C).to(torch.float32)
    else:  # [W, blocks, B/8] bits, [W, blocks] weights, [blocks, B/8, 8] e
        fns = _block_fns()
        args = (_marked(bits.view(layout.W, -1, B // 8), 1), _marked(weights, 1),
                _marked(e.view(-1, B // 8, 8)))
        sums8, packed = fns["server_encode"](*args)
        scale = torch.sqrt(sums8.sum(-1) / B).to(torch.float32)
    target = message_bits(out, layout)[0]
    if packed.data_ptr() != target.data_ptr():
        target.copy_(packed.view(-1))
    scales.copy_(scale if finite else torch.full_like(scale, float("nan")))
    if not bool(torch.isfinite(scales).all()):  # any non-finite block: every scale NaN, e unchanged
        scales.fill_(float("nan"))
        return
    if simd:  # the C pass
        cpu_simd.server_update(bits, w, e, scales.view(-1), B)
        return
    W, words = layout.W, layout.C // 32 if B is None else layout.C // B
    if B is not None:
        _block_fns()["server_update_blocks"](_marked(bits.view(W, words, B // 32, 4), 1),
                                             _marked(weights.view(W, words), 1),
                                             _marked(e.view(words, B // 32, 32)), _marked(scales.view(words)))
        return
    update = _block_fns()["server_update"]
    if words < 2:  # a dynamic dimension must not be 1: all by columns
        fns["server_update"](bits, weights, e, scales.view(1))
        return
    rest = words * 32
    update(_marked(bits[:, : rest // 8].view(W, words, 1, 4), 1), weights.view(W, 1, 1, 1),
           _marked(e[:rest].view(words, 1, 32)), scales.view(1, 1, 1))
    if rest < layout.C:  # the last 8-24 elements, by columns
        fns["server_update"](bits[:, rest // 8 :], weights, e[rest:], scales.view(1))


@torch.no_grad()
def decompress(gathered: torch.Tensor, layout: Layout, out: torch.Tensor,
               worker_error: torch.Tensor | None, worker_message: torch.Tensor | None) -> None:
    """:func:`torch_kernels.decompress`, compiled; with block scales the plain path's (see
    SLOW_COMPILED)."""
    if layout.block is not None and not _blocks_compiled(layout):
        torch_kernels.decompress(gathered, layout, out, worker_error, worker_message)
        return
    scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), out.numel()
    blocks, B = (None, None) if layout.block is None else (_block_fns(), layout.block)
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout) if update else None
    simd = (cpu_simd.available() and out.dtype == torch.float32 and out.is_contiguous()
            and (worker_error is None or worker_error.is_contiguous()))
    for j in range(layout.W):
        lo, mid, hi = split(layout, n, j)
        if simd and mid > lo:  # both passes in one (onebit.kernels.cpu_simd)
            ws = piece_scales(s_w, layout, j, lo, lo, mid) if update else None
            cpu_simd.decompress(bits[j, : (mid - lo) // 8], piece_scales(scales, layout, j, lo, lo, mid),
                                out[lo:mid], B, worker_error[lo:mid] if update else None, ws)
        else:
            if B is not None and mid - lo < 2 * B:  # one block: the eager ops below (a dynamic
                mid = lo                            # dimension must not be 1)
            if mid > lo:
                fns, sj = _fns(), piece_scales(scales, layout, j, lo, lo, mid)
                if update:  # the deferred worker error first (it reads the input out holds), one pass
                    s_wj = piece_scales(s_w, layout, j, lo, lo, mid)
                    if blocks is None:
                        fns["worker_update"](out[lo:mid], worker_error[lo:mid], s_wj)
                    else:
                        blocks["error_update"](_marked(out[lo:mid].view(-1, B)), _marked(s_wj.view(-1, 1)),
                                               _marked(worker_error[lo:mid].view(-1, B)))
                wide = (mid - lo) // 32 * 32  # whole 4-byte words: the compiled decode; the rest eager
                if wide and blocks is None:
                    fns["decode32"](bits[j, : wide // 8], sj, out[lo : lo + wide])
                elif wide:
                    words = _marked(bits[j, : wide // 8].view(-1, B // 32, 4))
                    values = _marked(out[lo : lo + wide].view(-1, B // 32, 32))
                    blocks["decode"](words, _marked(sj.view(-1, 1, 1)), values)
                if mid > lo + wide:
                    rest = scaled(_signs(bits[j, wide // 8 : (mid - lo) // 8]), sj, None)
                    out[lo + wide : mid] = rest.to(out.dtype)
        if hi > mid:
            decode_tail(bits, scales, out, worker_error if update else None, s_w, layout, j, lo, mid, hi)
