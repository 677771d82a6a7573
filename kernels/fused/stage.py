"""A fused step's buckets in one launch per pass (issue 57: launches independent of the bucket count).

A compression stage runs, per bucket, the worker pass, the all-to-all, the server, the all-gather and
the decompress pass. The collectives stay one call per bucket (each bucket's message is its own), but
no pass needs a launch of its own per bucket: each program of a stage launch finds its bucket in a
program map and that bucket's buffers and sizes in the stage's bucket table, then runs what the
per-bucket kernel runs on its ``pid``-th block. The float64 partial norms of each bucket's message are
its own programs', summed in the same fixed order by the last of them to arrive (a ticket per bucket):
every bit is the per-bucket launches'.

The bucket table (int64 [B, FIELDS], filled each step: the buffers change) holds the addresses of the
bucket's buffers (``U``: its float32 momentum, 0 where it is kept as a message; ``OLD``: that kept
message, 0 where none; ``E`` and ``SE``: its worker and server errors; ``MSG``, ``RECV``, ``SEG``,
``GATH``: this step's message, the W segments received, the served segment and the gathered message)
and its sizes (n, N, the chunk's bytes, a segment's bytes, the scale's word in a segment, the first
program and the programs of its passes, ``P0``/``P``, and of its server, ``Q0``/``Q``). The errors are
float32 or bfloat16 for the whole stage (``EBF16``), read and stored in the passes
(:func:`onebit.kernels.rounding.load_error`, ``store_error``: bitwise ``narrow_``).

The per-tensor table is one :class:`~onebit.kernels.fused.table.Table` over every bucket's tensors
(offsets within their bucket), and the program -> tensor ranges (``lo``, ``hi``) index it."""

from __future__ import annotations

import torch

from .._triton import AVAILABLE, constexpr, jit, tl
from ..layout import Layout, inverse_world
from ..rounding import SERVER
from .table import BLOCK_BYTES, _write_to, tile_ranges

FIELDS = ("U", "OLD", "E", "MSG", "GATH", "RECV", "SEG", "SE", "NUMEL", "PADDED", "CHUNK_BYTES",
          "SEG_BYTES", "SCALE_WORD", "P0", "P", "Q0", "Q")
(U, OLD, E, MSG, GATH, RECV, SEG, SE, NUMEL, PADDED, CHUNK_BYTES, SEG_BYTES, SCALE_WORD, P0, P, Q0,
 Q) = (constexpr(k) for k in range(len(FIELDS)))
_F = constexpr(len(FIELDS))
SERVER_BLOCK_BYTES = 512  # the codec's server programs (onebit.kernels.triton_kernels._settings)

if AVAILABLE:
    from ..rounding import load_error, store_error
    from ..triton_kernels import (
        _FINAL_BLOCK,
        _INF,
        Launch,
        _finish_scale,
        _segments_finite,
        _store_packed,
        decoded_rows,
        encode_rows,
    )


def programs(N: int, per_bytes: int = BLOCK_BYTES) -> int:
    return -(-(N // 8) // per_bytes)


class Stage:
    """The static part of a stage over buckets of ``numels`` elements (``layouts``: their padded
    layouts, one W, no block scales) whose tensors cover ``offsets``/``numels`` of each bucket: the
    program maps, the tensors' ranges per program, the partial norms and the tickets, on ``device``."""

    def __init__(self, layouts: list[Layout], numels: list[int], tensors: list[tuple[list[int], list[int]]],
                 device) -> None:
        if len({lay.W for lay in layouts}) != 1 or any(lay.block is not None for lay in layouts):
            raise ValueError("layouts: expected one W and no block scales")
        self.layouts, self.numels, self.device = list(layouts), list(numels), torch.device(device)
        self.W = layouts[0].W
        self.B = len(layouts)
        as_i32 = dict(dtype=torch.int32, device=self.device)
        p = [programs(lay.N) for lay in layouts]
        q = [-(-lay.chunk_bytes // SERVER_BLOCK_BYTES) for lay in layouts]
        self.p0 = [sum(p[:b]) for b in range(self.B)]
        self.q0 = [sum(q[:b]) for b in range(self.B)]
        self.P, self.Q = sum(p), sum(q)
        self.map = torch.tensor([b for b in range(self.B) for _ in range(p[b])], **as_i32)
        self.server_map = torch.tensor([b for b in range(self.B) for _ in range(q[b])], **as_i32)
        lo, hi, k0 = [], [], 0
        for (offsets, sizes), lay in zip(tensors, layouts, strict=True):
            a, z = tile_ranges(offsets, sizes, lay.N, BLOCK_BYTES * 8)
            lo += [k + k0 for k in a]
            hi += [k + k0 for k in z]
            k0 += len(offsets)
        self.lo, self.hi = torch.tensor(lo, **as_i32), torch.tensor(hi, **as_i32)
        self.partials = torch.empty(max(self.P, self.Q), dtype=torch.float64, device=self.device)
        self.tickets = torch.zeros(self.B, dtype=torch.int32, device=self.device)
        self.sizes = [[n, lay.N, lay.chunk_bytes, lay.segment_bytes, lay.scale_offset // 4, self.p0[b], p[b],
                       self.q0[b], q[b]] for b, (lay, n) in enumerate(zip(layouts, numels, strict=True))]
        self.table = torch.zeros(self.B, len(FIELDS), dtype=torch.int64, device=self.device)
        self.key = None

    def fill(self, addresses: list[tuple[int, ...]]) -> None:
        """Each bucket's eight buffer addresses (``FIELDS[:8]``) for this step (a no-op where none
        changed)."""
        rows = [list(a) + s for a, s in zip(addresses, self.sizes, strict=True)]
        if rows != self.key:
            _write_to(self.table, torch.tensor(rows, dtype=torch.int64))
            self.key = rows


def address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class StagePasses:
    """``collectives.allreduce.compressed_allreduce_stage``'s passes over a stage's buckets: ``buffers``
    per bucket (its float32 momentum or None, its kept message or None, its worker and server errors:
    float32, or all bfloat16), ``make(ebf16)`` the step's launches (``worker``, ``server``, ``finish``:
    ``adam.stage_launches``, ``zero_one.stage_launches``). The bucket table is written once per call,
    with every message's address."""

    def __init__(self, st: Stage, buffers: list[tuple], make) -> None:
        self.st, self.buffers, self.make = st, buffers, make
        self.device = st.device
        self.launches = None

    def worker(self, msgs, received, segments, gathered) -> None:
        self.st.fill([(address(u), address(old), address(e), address(m), address(g), address(r), address(s),
                       address(se))
                      for (u, old, e, se), m, r, s, g in zip(self.buffers, msgs, received, segments, gathered,
                                                             strict=True)])
        self.launches = self.make(self.buffers[0][2].dtype == torch.bfloat16)
        self._run("worker")

    def serve(self) -> None:
        self._run("server")

    def finish(self) -> None:
        self._run("finish")

    def _run(self, name: str) -> None:
        for launch in self.launches[name]:
            launch()


@jit
def bucket_of(bt_ptr, map_ptr, q, FIRST: tl.constexpr):
    # program q's bucket's row of the bucket table and q's index among that bucket's programs
    b = tl.load(map_ptr + q)
    row = bt_ptr + b * _F
    return b, row, q - tl.load(row + FIRST).to(tl.int32)


@jit
def field(row, column):
    return tl.load(row + column).to(tl.int32)


@jit
def bucket(bt_ptr, map_ptr, q, FIRST: tl.constexpr):
    # bucket_of, and the bucket's sizes: n, N, a chunk's bytes, a segment's bytes, the scale's word
    b, row, pid = bucket_of(bt_ptr, map_ptr, q, FIRST)
    return (b, row, pid, field(row, NUMEL), field(row, PADDED), field(row, CHUNK_BYTES),
            field(row, SEG_BYTES), field(row, SCALE_WORD))


@jit
def encode_bucket(z, live, i, g, pid, b, row, partial_ptr, ticket_ptr, W, FINAL_BLOCK: tl.constexpr):
    # encode_rows of z into the bucket's message (MSG), with its own partial norms and ticket
    N, seg_bytes, msg = field(row, PADDED), field(row, SEG_BYTES), tl.load(row + MSG)
    encode_rows(z, live, i, g, pid, msg.to(tl.pointer_type(tl.uint8)), partial_ptr + tl.load(row + P0),
                ticket_ptr + b, N // 8, field(row, CHUNK_BYTES), seg_bytes, N,
                msg.to(tl.pointer_type(tl.float32)), W, seg_bytes // 4, field(row, SCALE_WORD), field(row, P),
                FINAL_BLOCK)


@jit
def gathered_rows(row, pid, n, N, chunk_bytes, seg_bytes, scale_word, BLOCK_BYTES: tl.constexpr):
    # the program's rows of the bucket's gathered message (GATH) decoded (decoded_rows), and in_x
    gath = tl.load(row + GATH)
    g_ptr, g_words = gath.to(tl.pointer_type(tl.uint8)), gath.to(tl.pointer_type(tl.float32))
    idx, live, val = decoded_rows(g_ptr, g_words, pid, N // 8, chunk_bytes, seg_bytes, seg_bytes // 4,
                                  scale_word, BLOCK_BYTES)
    return idx, live, val, live[:, None] & (idx < n)


@jit
def gathered_finite(row, W, GATE_BLOCK: tl.constexpr):
    # whether every scale of the bucket's gathered message is finite
    words = tl.load(row + GATH).to(tl.pointer_type(tl.float32))
    return _segments_finite(words, W, field(row, SEG_BYTES) // 4, field(row, SCALE_WORD), GATE_BLOCK)


@jit
def _stage_server_kernel(bt_ptr, map_ptr, partial_ptr, ticket_ptr, W, inv_w, role, UPDATE: tl.constexpr,
                         EBF16: tl.constexpr, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr):
    # onebit.kernels.triton_kernels._server_kernel (its masked path) on each program's bucket: m = sum_r
    # sgn_r * (s_r * (1/W)) + e in rank order; first launch: the partial norms, packed sgn(m) and the
    # scale (NaN if a received scale is not finite); second (UPDATE): e <- m - s sgn(m) if s is finite
    q = tl.program_id(0)
    b, row, pid = bucket_of(bt_ptr, map_ptr, q, Q0)
    chunk_bytes, seg_bytes = field(row, CHUNK_BYTES), field(row, SEG_BYTES)
    scale_word = field(row, SCALE_WORD)
    seg_words = seg_bytes // 4
    recv = tl.load(row + RECV)
    out = tl.load(row + SEG)
    se = tl.load(row + SE)
    recv_ptr, recv_words = recv.to(tl.pointer_type(tl.uint8)), recv.to(tl.pointer_type(tl.float32))
    out_ptr, out_words = out.to(tl.pointer_type(tl.uint8)), out.to(tl.pointer_type(tl.float32))
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = g < chunk_bytes
    m = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for r in range(0, W):
        byte = tl.load(recv_ptr + r * seg_bytes + g, mask=live, other=0).to(tl.int32)
        s = tl.load(recv_words + r * seg_words + scale_word) * inv_w
        bit = (byte[:, None] >> (7 - i)[None, :]) & 1
        m += tl.where(bit == 1, s, -s)
    m += load_error(se, idx, live[:, None], EBF16)
    if UPDATE:
        s = tl.load(out_words + scale_word)
        if tl.abs(s) < _INF:
            store_error(se, idx, tl.where(m < 0, m + s, m - s), s, role, live[:, None], EBF16)
    else:
        first = tl.load(row + Q0)
        md = tl.where(live[:, None], m, 0.0).to(tl.float64)
        tl.store(partial_ptr + first + pid, tl.sum(tl.sum(md * md, axis=1), axis=0))
        _store_packed(out_ptr, m, i, g, chunk_bytes, chunk_bytes, seg_bytes, False)  # one segment
        _finish_scale(partial_ptr + first, ticket_ptr + b, field(row, Q), field(row, PADDED) // W, out_words,
                      1, seg_words, scale_word, recv_words, W, True, FINAL_BLOCK)


def server_launches(stage: Stage, ebf16: bool) -> list:
    """Every bucket's server (``server_reduce``: the scale, then the error update) in two launches."""
    args = (stage.table, stage.server_map, stage.partials, stage.tickets, stage.W, inverse_world(stage.W),
            SERVER)
    return [Launch(_stage_server_kernel, stage.Q, args,
                   dict(UPDATE=update, EBF16=ebf16, BLOCK_BYTES=SERVER_BLOCK_BYTES, FINAL_BLOCK=_FINAL_BLOCK),
                   4)
            for update in (False, True)]


@jit
def _stage_keep_kernel(bt_ptr, flag_ptr, W, J, GATE: tl.constexpr, GATE_BLOCK: tl.constexpr,
                       BLOCK: tl.constexpr):
    # program b * J + j: bytes [j BLOCK, (j + 1) BLOCK) of bucket b's gathered message (GATH) copied into
    # its kept message (OLD; none: 0, the caller keeps the gathered one). GATE: unless a gathered scale is
    # not finite; then the kept message stays and the flag (uint8) is set (the step skipped on the
    # device, issue 57)
    q = tl.program_id(0)
    b, j = q // J, q % J
    row = bt_ptr + b * _F
    size = W * field(row, SEG_BYTES)
    gath, old = tl.load(row + GATH), tl.load(row + OLD)
    fine = True
    if GATE:
        fine = gathered_finite(row, W, GATE_BLOCK)
    if fine:
        if old != 0:
            dst, src = old.to(tl.pointer_type(tl.uint8)), gath.to(tl.pointer_type(tl.uint8))
            offs = j * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < size), mask=offs < size)
    elif j == 0:
        tl.store(flag_ptr, 1)


KEEP_BLOCK = 4096


def keep_launches(stage: Stage, flag: torch.Tensor | None) -> list:
    """Every bucket's gathered message copied into its kept one (the momentum: the same buffer every
    step, what a captured step needs), in one launch; with ``flag`` (uint8 [1], or a 0-dim bool viewed
    so), not where a gathered scale is not finite: the kept message stays and ``flag`` is set to 1."""
    J = max(-(-lay.message_bytes // KEEP_BLOCK) for lay in stage.layouts)
    gate = flag is not None
    args = (stage.table, flag if gate else stage.tickets, stage.W, J)
    return [Launch(_stage_keep_kernel, stage.B * J, args, dict(GATE=gate, GATE_BLOCK=128, BLOCK=KEEP_BLOCK),
                   4)]
