"""OnebitAdam's compression step inside the codec's two passes, in every backend that has it.

The step, per bucket (flat momentum ``u``, worker error ``e``; per tensor its gradient ``g``, frozen
variance ``v`` (its stale denominator ``d`` computed from it as it is read: :mod:`.table`) and
parameter ``p``; per group b1, lr, wd, bc1):

- worker pass: ``u = u * b1 + ((1 - b1) * g) / d`` (``g = 0`` for a None gradient), then the worker's
  encode of ``pad(u) + e`` (packed signs and the scale, as ``worker_compress(update_error=False)``);
- the collective's all-to-all, server and all-gather (``compressed_allreduce_passes``);
- decompress pass: the deferred worker error (where every scale is finite), ``u = s_j sgn`` (the
  decoded mean), then ``p = p * (1 - lr wd) + (-lr) * clamp(u / bc1, -clip, clip)``.

Unfused, that is the fold per tensor, the codec, and the update per tensor
(``onebit.optimizers.onebit_adam``: the reference these passes are tested against,
tests/test_triton_fused.py, test_fused_cpu.py). Each element takes the plain path's float32
operations in its order (contraction off, divisions correctly rounded): the momentum, the bits and
the errors are bitwise the unfused step's; the parameters too, or one rounding apart where the plain
``p.add_`` fuses its multiply-add.

The table (:mod:`onebit.kernels.fused.table`): address columns ``ADDRESSES``, scalar columns
``SCALARS``. Backends: Triton (:class:`TritonPasses`: ``_fold_worker_kernel`` and
``_decompress_update_kernel``, 1024 elements per program) and native C (:class:`NativePasses`:
``kernels/fused/adam.c``, every chunk of a bucket in one call per pass, run by run of 4096 elements
while they are in cache)."""

from __future__ import annotations

import torch

from .._triton import AVAILABLE, constexpr, jit, tl
from ..cpu_simd import _f32, _isa, library
from ..layout import Layout
from ..rounding import WORKER
from . import _native, stage
from .table import (
    BLOCK_BYTES,
    DENOMINATOR,
    WARPS,
    Table,
    address,
    denominator,
    elements,
    elements_at,
    owned,
    programs,
    scalar,
    tiles,
)

if AVAILABLE:
    from ..rounding import load_error, store_error
    from ..triton_kernels import (
        _FINAL_BLOCK,
        Launch,
        _partials,
        _segments_finite,
        _store_decompressed,
        decoded_rows,
        encode_rows,
        ticket,
    )

ADDRESSES = ("grad", "var", "param")
# b1, 1 - b1, 1 - lr wd, -lr, bc1; the stale denominator's floor, r, eps
SCALARS = ("b1", "w1", "decay", "neg_lr", "bc1", *DENOMINATOR)
_GRAD, _VAR, _PARAM = (constexpr(ADDRESSES.index(c)) for c in ADDRESSES)
_B1, _W1, _DECAY, _NEG_LR, _BC1 = (constexpr(SCALARS.index(c)) for c in SCALARS[:5])


def table(offsets: list[int], numels: list[int], device) -> Table:
    """A bucket's table for this step."""
    return Table(offsets, numels, ADDRESSES, SCALARS, device)


def rows(group: dict, t: int, denominator: tuple[float, float, float]) -> tuple[float, ...]:
    """A tensor's scalars at step ``t`` (``SCALARS``): its group's, then its stale denominator's
    ``(floor, r, eps)``."""
    b1, lr, wd = group["betas"][0], float(group["lr"]), group["weight_decay"]  # (a capturable step's
    # tensor lr outside the Triton stage: read here)
    bc1 = 1.0 - b1**t if group["bias_correction"] else 1.0
    return (b1, 1.0 - b1, 1.0 - lr * wd if wd else 1.0, -lr, bc1, *denominator)


# ---- Triton ------------------------------------------------------------------------------------

@jit
def _fold_worker_kernel(
    u_ptr, e_ptr, msg_ptr, partial_ptr, ticket_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K,
    scal_ptr, n, total_bytes, chunk_bytes, seg_bytes, length, words_ptr, num_slots, seg_words, scale_word,
    poison_ptr, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, POISON: tl.constexpr,
):
    # u <- b1 u + ((1 - b1) g) / d for the elements of each tensor (g = 0 where its gradient is
    # None); then as _worker_pack_kernel on z = pad(u) + e: packed sgn(z), one float64 partial norm
    # per program, the last program writes the scale. POISON: z + poison, poison 0 or NaN (this rank's
    # gradients not all finite: the scale NaN, which the collectives carry to every rank, issue 57)
    pid = tl.program_id(0)
    g, i, idx, live, in_x = elements(n, total_bytes, BLOCK_BYTES)
    u = tl.load(u_ptr + idx, mask=in_x, other=0.0)
    u = _fold(u, idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, BLOCK_BYTES)
    tl.store(u_ptr + idx, u, mask=in_x)
    z = u + tl.load(e_ptr + idx, mask=live, other=0.0)
    if POISON:
        z = z + tl.load(poison_ptr)
    encode_rows(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes,
                length, words_ptr, num_slots, seg_words, scale_word, tl.num_programs(0), FINAL_BLOCK)


@jit
def _decompress_update_kernel(
    g_ptr, g_words_ptr, u_ptr, e_ptr, w_words_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K,
    scal_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word, W, clip,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr, GATE: tl.constexpr,
):
    # as _decompress_kernel with HAS_ERROR (the deferred worker error update if every scale is
    # finite, then u <- s_j sgn), then p <- p (1 - lr wd) + (-lr) clamp(u / bc1, -clip, clip);
    # GATE: p too only if every scale is finite (the step skipped on the device, issue 57)
    pid = tl.program_id(0)  # int32 indices: the caller keeps N < 2^31
    ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    idx, live, val = decoded_rows(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words,
                                  scale_word, BLOCK_BYTES)
    in_x = live[:, None] & (idx < n)
    sw = tl.load(w_words_ptr + scale_word)
    _store_decompressed(u_ptr, e_ptr, idx, live, in_x, val, sw, ok, True, False)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        _update(idx, in_x, val, ok, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, GATE)


@jit
def _update(idx, in_x, val, ok, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, GATE: tl.constexpr):
    # tensor k's update from its decoded mean: p <- p (1 - lr wd) + (-lr) clamp(u / bc1, -clip, clip); GATE:
    # only where ok (every gathered scale finite)
    off, mine = owned(idx, k, start_ptr, count_ptr)
    mine = mine & in_x
    pp = address(addr_ptr, _PARAM, K, k) + off
    step = tl.div_rn(val, scalar(scal_ptr, k, _BC1))
    step = tl.minimum(tl.maximum(step, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                      propagate_nan=tl.PropagateNan.ALL)
    p = tl.load(pp, mask=mine, other=0.0)
    p = p * scalar(scal_ptr, k, _DECAY) + scalar(scal_ptr, k, _NEG_LR) * step
    if GATE:
        if ok:
            tl.store(pp, p, mask=mine)
    else:
        tl.store(pp, p, mask=mine)


def fold_worker_launches(u, e, msg, words, partial, ticket_, table: Table, n: int, layout: Layout,
                        poison: torch.Tensor | None = None):
    t = tiles(table, layout.N)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    return [Launch(_fold_worker_kernel, programs(layout.N),
                   (u, e, msg, partial, ticket_, t.lo, t.hi, table.start, table.count, table.addr, table.K,
                    table.scal, n, layout.N // 8, layout.chunk_bytes, layout.segment_bytes, layout.N, words,
                    layout.W, seg_words, scale_word, partial if poison is None else poison),
                   dict(BLOCK_BYTES=BLOCK_BYTES, FINAL_BLOCK=_FINAL_BLOCK, POISON=poison is not None), WARPS)]


def decompress_update_launches(gathered, g_words, u, e, w_words, table: Table, n: int, layout: Layout,
                               clip: float, gate: bool = False):
    t = tiles(table, layout.N)
    return [Launch(_decompress_update_kernel, programs(layout.N),
                   (gathered, g_words, u, e, w_words, t.lo, t.hi, table.start, table.count, table.addr,
                    table.K, table.scal, n, layout.N // 8, layout.chunk_bytes, layout.segment_bytes,
                    layout.segment_bytes // 4, layout.scale_offset // 4, layout.W, clip),
                   dict(BLOCK_BYTES=BLOCK_BYTES, GATE_BLOCK=128, GATE=gate), WARPS)]


def fold_worker(u: torch.Tensor, e: torch.Tensor, layout: Layout, msg: torch.Tensor, table: Table,
                poison: torch.Tensor | None = None) -> None:
    """The worker pass over a bucket in Triton: fold every tensor's gradient into u (flat, n
    elements), then compress ``pad(u) + e`` into ``msg`` as ``worker_compress(update_error=False)``.
    ``poison``: a float32 scalar on the device, 0 or NaN, added to every z (NaN: the message's scale NaN)."""
    partial = _partials(programs(layout.N), e.device)
    for launch in fold_worker_launches(u, e, msg, msg.view(torch.float32), partial, ticket(e.device), table,
                                       u.numel(), layout, poison):
        launch()


def decompress_update(gathered: torch.Tensor, layout: Layout, u: torch.Tensor, e: torch.Tensor,
                      msg: torch.Tensor, table: Table, clip: float, gate: bool = False) -> None:
    """The decompress pass over a bucket in Triton: ``decompress(gathered, u, worker_error=e,
    worker_message=msg)``, then every tensor's update from its part of u (``clip``: inf for none).
    ``gate``: the parameters too only where every gathered scale is finite."""
    for launch in decompress_update_launches(gathered, gathered.view(torch.float32), u, e,
                                             msg.view(torch.float32), table, u.numel(), layout, clip, gate):
        launch()


class TritonPasses:
    """``compressed_allreduce_passes``' worker and finish in the Triton passes. ``poison`` (a float32
    scalar on the device, 0 or NaN): the step's agreement on the device (issue 57): a NaN makes this
    rank's message scales NaN, so every rank's gathered scales are, and the decompress pass then leaves
    the error and the parameters as they were."""

    def __init__(self, table: Table, clip: float, poison: torch.Tensor | None = None) -> None:
        self.table, self.clip, self.poison = table, clip, poison
        self.gathered = self.layout = None

    def worker(self, flat, worker_error, layout, msg) -> None:
        fold_worker(flat, worker_error, layout, msg, self.table, self.poison)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        self.gathered, self.layout = gathered, layout  # kept: the momentum's message
        decompress_update(gathered, layout, flat, worker_error, msg, self.table, self.clip,
                          gate=self.poison is not None)


# ---- Triton, every bucket of the stage in one launch per pass (kernels/fused/stage.py) ----------

@jit
def _kept_or_buffer(row, idx, g, i, in_x, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word):
    # the bucket's momentum at idx: its float32 buffer (column U), or its kept message (OLD) decoded;
    # with U and which elements each holds (the addresses broadcast: a scalar mask is refused)
    u_addr, old = tl.load(row + stage.U), tl.load(row + stage.OLD)
    wide = (idx * 0).to(tl.int64)
    in_u, in_old = in_x & ((wide + u_addr) != 0), in_x & ((wide + old) != 0)
    u = tl.load(u_addr.to(tl.pointer_type(tl.float32)) + idx, mask=in_u, other=0.0)
    kept = (g < total_bytes) & ((g * 0).to(tl.int64) + old != 0)
    j = g // chunk_bytes
    byte = tl.load(old.to(tl.pointer_type(tl.uint8)) + j * seg_bytes + g % chunk_bytes, mask=kept,
                   other=0).to(tl.int32)
    s = tl.load(old.to(tl.pointer_type(tl.float32)) + j * seg_words + scale_word, mask=kept, other=0.0)
    bit = (byte[:, None] >> (7 - i)[None, :]) & 1
    return tl.where(in_old, tl.where(bit == 1, s[:, None], -s[:, None]), u), u_addr, in_u, in_old


@jit
def _fold(u, idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr,
          BLOCK_BYTES: tl.constexpr):
    # u * b1 + ((1 - b1) g) / d per element, each operation rounded (fold_preconditioned_); one loop over
    # the program's tensors, w g kept instead of w and g (fewer live registers: the decompress pass folds too)
    wg = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)  # 0 where no tensor's, or its gradient is None
    b1 = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    den = tl.full([BLOCK_BYTES, 8], 1.0, tl.float32)
    for k in range(tl.load(lo_ptr + q), tl.load(hi_ptr + q)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        ga = tl.load(addr_ptr + _GRAD * K + k)
        grad = tl.load(ga.to(tl.pointer_type(tl.float32)) + off, mask=mine & ((off * 0 + ga) != 0), other=0.0)
        wg = tl.where(mine, scalar(scal_ptr, k, _W1) * grad, wg)
        b1 = tl.where(mine, scalar(scal_ptr, k, _B1), b1)
        den = tl.where(mine, denominator(addr_ptr, scal_ptr, _VAR, K, k, off, mine), den)
    return u * b1 + tl.div_rn(wg, den)


@jit
def _stage_fold_worker_kernel(
    bt_ptr, map_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, partial_ptr, ticket_ptr, W,
    poison_ptr, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, POISON: tl.constexpr,
    EBF16: tl.constexpr,
):
    # _fold_worker_kernel on each program's bucket; the momentum read from its buffer (and the folded
    # one stored there) or decoded from its kept message (nothing stored: the decompress pass folds again)
    q = tl.program_id(0)
    b, row, pid, n, N, chunk_bytes, seg_bytes, scale_word = stage.bucket(bt_ptr, map_ptr, q, stage.P0)
    total_bytes, seg_words = N // 8, seg_bytes // 4
    g, i, idx, live, in_x = elements_at(pid, n, total_bytes, BLOCK_BYTES)
    u, u_addr, in_u, _ = _kept_or_buffer(row, idx, g, i, in_x, total_bytes, chunk_bytes, seg_bytes, seg_words,
                                         scale_word)
    u = _fold(u, idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, BLOCK_BYTES)
    tl.store(u_addr.to(tl.pointer_type(tl.float32)) + idx, u, mask=in_u)
    z = u + load_error(tl.load(row + stage.E), idx, live, EBF16)
    if POISON:
        z = z + tl.load(poison_ptr)
    stage.encode_bucket(z, live, i, g, pid, b, row, partial_ptr, ticket_ptr, W, FINAL_BLOCK)


@jit
def _stage_decompress_update_kernel(
    bt_ptr, map_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, W, clip, role,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr, GATE: tl.constexpr, EBF16: tl.constexpr,
):
    # _decompress_update_kernel on each program's bucket: this rank's u (its buffer, or folded again
    # from the kept message: bitwise the worker pass's) and the error give the deferred error update
    # (every gathered scale finite), the decoded mean goes to the buffer (none where kept), then the update
    q = tl.program_id(0)
    b, row, pid, n, N, chunk_bytes, seg_bytes, scale_word = stage.bucket(bt_ptr, map_ptr, q, stage.P0)
    total_bytes, seg_words = N // 8, seg_bytes // 4
    ok = stage.gathered_finite(row, W, GATE_BLOCK)
    idx, live, val, in_x = stage.gathered_rows(row, pid, n, N, chunk_bytes, seg_bytes, scale_word,
                                               BLOCK_BYTES)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    x, u_addr, in_u, refold = _kept_or_buffer(row, idx, g, i, in_x, total_bytes, chunk_bytes, seg_bytes,
                                              seg_words, scale_word)
    x = tl.where(refold, _fold(x, idx, refold, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr,
                               BLOCK_BYTES), x)
    e_addr = tl.load(row + stage.E)
    z = x + load_error(e_addr, idx, live[:, None], EBF16)
    sw = tl.load(tl.load(row + stage.MSG).to(tl.pointer_type(tl.float32)) + scale_word)
    if ok:
        store_error(e_addr, idx, tl.where(z < 0, z + sw, z - sw), sw, role, live[:, None], EBF16)
    tl.store(u_addr.to(tl.pointer_type(tl.float32)) + idx, val, mask=in_u)
    for k in range(tl.load(lo_ptr + q), tl.load(hi_ptr + q)):
        _update(idx, in_x, val, ok, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, GATE)


def stage_launches(st, table: Table, clip: float, ebf16: bool, poison: torch.Tensor | None = None) -> dict:
    """The stage's passes over every bucket (``st``: its :class:`~onebit.kernels.fused.stage.Stage`,
    ``table`` every bucket's tensors): ``worker`` (one launch), ``server`` (two), ``finish`` (one)."""
    common = (st.table, st.map, st.lo, st.hi, table.start, table.count, table.addr, table.K, table.scal)
    worker = Launch(_stage_fold_worker_kernel, st.P,
                    (*common, st.partials, st.tickets, st.W, st.partials if poison is None else poison),
                    dict(BLOCK_BYTES=BLOCK_BYTES, FINAL_BLOCK=_FINAL_BLOCK, POISON=poison is not None,
                         EBF16=ebf16), WARPS)
    finish = Launch(_stage_decompress_update_kernel, st.P, (*common, st.W, clip, WORKER),
                    dict(BLOCK_BYTES=BLOCK_BYTES, GATE_BLOCK=128, GATE=poison is not None, EBF16=ebf16),
                    WARPS)
    return {"worker": [worker], "server": stage.server_launches(st, ebf16), "finish": [finish]}


# ---- native C (kernels/fused/adam.c) -----------------------------------------------------------

def fold_encode_all(flat: torch.Tensor | None, e: torch.Tensor, bits: torch.Tensor, C: int, n_enc: list[int],
                    n_fold: list[int], table: Table, isa: int | None = None, old=None,
                    tails: torch.Tensor | None = None, n: int | None = None) -> list[float]:
    """Fold the gradients into ``flat`` (``u = u * b1 + (w * g) / d``, d from v) and encode
    ``flat + e`` into the message rows in the same pass, for every chunk of a bucket in one call:
    chunk j's elements ``[j C, j C + n_enc[j])`` encoded into ``bits[j]`` (a message's ``[W, C / 8]``
    rows), its fold to ``j C + n_fold[j]``; returns each chunk's float64 sum of squares, bitwise what W
    calls, each with the other chunks empty, return. ``old``: the ``(bits, scales)`` of the message that
    holds the momentum instead (``flat`` None, the bucket's ``n`` elements): each run decoded from it as
    it is read and folded on the stack, nothing stored but the message and the padded rests' folded
    data, 8 floats per chunk, into ``tails`` (the decompress pass folds again)."""
    t = table
    if old is not None and (tails is None or not _f32(tails) or tails.numel() < 8 * len(n_enc)):
        raise ValueError("adam.fold_encode_all: a kept message needs 8 W float32 tails")
    kept = (None, 0, None, None) if old is None else (old[0].data_ptr(), old[0].stride(0), old[1].data_ptr(),
                                                      tails.data_ptr())
    args = (t.start.data_ptr(), t.count.data_ptr(), t.ptr("grad"), t.ptr("var"), t.scal.data_ptr(), t.K,
            *kept, int(e.dtype == torch.bfloat16))
    return _native.encode_all("adam.fold_encode_all", library().onebit_fold_encode_all, flat, e, bits, C,
                              n_enc, n_fold, args, isa, n=n, bfloat16_errors=True)


def decompress_update_all(bits: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor | None,
                          e: torch.Tensor | None, worker_scales: torch.Tensor | None, C: int, n: list[int],
                          table: Table, clip: float, isa: int | None = None, old=None,
                          update: bool = True) -> None:
    """Decompress (with the deferred worker error where ``e`` is given) then, in the same pass,
    ``p = p * decay + (-lr) * clamp(u / bc1, -clip, clip)`` for the tensors covered, for every chunk
    of a bucket in one call: chunk j's elements ``[j C, j C + n[j])`` from ``bits[j]`` with
    ``scales[j]`` (and ``worker_scales[j]``; ``e`` None: no error update; bfloat16: widened and stored
    rounded run by run). ``old``: the ``(bits, scales)`` of the message that holds the momentum
    (``flat`` None): each run's worker u folded again from it (bitwise the worker pass's), then the
    same decode, the error updated only with ``update``; the decoded mean is not stored."""
    if (flat is None) != (old is not None):
        raise ValueError("adam.decompress_update_all: expected flat or a kept message, not both")
    _native.check_step("adam.decompress_update_all", bits, scales, e, worker_scales, C, n, flat,
                       bfloat16_errors=True)
    counts, t = _native.int64(n), table
    kept = (None, 0, None) if old is None else (old[0].data_ptr(), old[0].stride(0), old[1].data_ptr())
    library().onebit_decompress_update_all(
        bits.data_ptr(), bits.stride(0), scales.data_ptr(), None if flat is None else flat.data_ptr(),
        None if e is None else e.data_ptr(), None if worker_scales is None else worker_scales.data_ptr(),
        C, len(n), counts.data_ptr(), t.start.data_ptr(), t.count.data_ptr(), t.ptr("grad"), t.ptr("var"),
        t.ptr("param"), t.scal.data_ptr(), t.K, -clip, clip, *kept, int(update),
        int(e is not None and e.dtype == torch.bfloat16), _isa(isa), torch.get_num_threads())


def update(u: torch.Tensor, a: int, b: int, table: Table, clip: float, isa: int | None = None) -> None:
    """The update alone for flat elements ``[a, b)``, their decoded mean ``u`` (``b - a`` elements)."""
    if not (_f32(u) and 0 <= a <= b and u.numel() == b - a):
        raise ValueError("adam.update: expected b - a contiguous float32 values for flat elements [a, b)")
    t = table
    library().onebit_update(u.data_ptr(), a, b, t.start.data_ptr(), t.count.data_ptr(), t.ptr("param"),
                            t.scal.data_ptr(), t.K, -clip, clip, _isa(isa))


class NativePasses(_native.NativePasses):
    """``compressed_allreduce_passes``' worker and finish in the C passes. They read and store a
    bfloat16 worker error themselves (the collective then hands it over as it is): each pass widens
    each run as it reads it, the decompress pass stores each run's new error rounded
    (onebit.kernels.rounding): bitwise what widening the whole buffer and storing it after the call
    gives. With the momentum kept as a message the worker pass writes nothing but the message (and
    the padded rests' 8 floats per chunk): it can run before the ranks agree (``prepare``)."""

    BFLOAT16_ERRORS = True

    def encode_all(self, flat, e, bits, C, n_enc, n_fold) -> list[float]:
        old = self.old()
        return fold_encode_all(flat, e, bits, C, n_enc, n_fold, self.table, old=old,
                               tails=None if old is None else self.tails.values, n=self.n)

    def step_all(self, bits, scales, flat, e, ws, C, n, update: bool = True) -> None:
        decompress_update_all(bits, scales, flat, e, ws, C, n, self.table, self.clip, old=self.old(),
                              update=update)

    def tail(self, values, a: int, b: int) -> None:
        update(values[a:b], a, b, self.table, self.clip)
