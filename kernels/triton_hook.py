"""The DDP hook's ``freeze_step`` pre- and post-pass (docs/ALGORITHMS.md 8.2) as one Triton launch
each over a GPU bucket.

Unfused on a GPU, a compressed iteration's pre-pass is the local gradient norm (a float64 copy of
the bucket), a bucket of zeros for ``c``, one ``mul`` per parameter into it (``c = factor * m``),
``add_`` and ``div_``; the post-pass ``mul_`` and ``sub_``: about 6 + P launches and 76 B per
element around the codec (bench/TRAFFIC.md section 4). Here:

- ``_hook_pre_kernel``: reads g, d and each parameter's momentum m (through a table of addresses);
  writes ``x = (g + c) / d`` over g and one float64 partial of ``sum g^2`` per program (the local
  norm, summed by the caller): 12 + 4 B;
- ``_hook_post_kernel``: reads the decompressed average, d and m; writes ``out d - c``: 12 + 4 B.

The codec's kernels between them are untouched, so every block size and the mesh work as before.
Each element takes the plain ops' float32 operations in their order (``c = m * factor``, ``g + c``,
a correctly rounded division; ``out * d``, ``- c``; contraction off), so the bucket is bitwise the
unfused passes' (tests/test_triton_hook.py); the norm's float64 partials add in another order.

A program covers 1024 consecutive elements; ``tiles`` (onebit.kernels.triton_fused's) gives it the
range of table entries (the parameters with a momentum, by offset) its elements meet. Elements of
no entry (a parameter without a momentum, a gap) take ``c = 0`` and their ``d`` (1 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_fused import Tiles, tiles
from .triton_kernels import Launch

BLOCK = 1024  # elements per program: triton_fused's tiles
WARPS = 8


@triton.jit
def _c_terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, maddr_ptr, factor_ptr,
             BLOCK: tl.constexpr):
    # c = m * factor for the elements of each table entry the program meets (0 elsewhere)
    c = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off = idx - tl.load(start_ptr + k).to(tl.int32)
        mine = in_x & (off >= 0) & (off < tl.load(count_ptr + k))
        mp = tl.load(maddr_ptr + k).to(tl.pointer_type(tl.float32))
        c = tl.where(mine, tl.load(mp + off, mask=mine, other=0.0) * tl.load(factor_ptr + k), c)
    return c


@triton.jit
def _hook_pre_kernel(buf_ptr, d_ptr, sq_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, maddr_ptr, factor_ptr, n,
                     BLOCK: tl.constexpr):
    # sq[pid] = sum g^2 (float64) of the program's elements; then g <- (g + c) / d in place
    pid = tl.program_id(0)  # int32 indices: the caller keeps n < 2^31
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    g = tl.load(buf_ptr + idx, mask=in_x, other=0.0)
    gd = g.to(tl.float64)
    tl.store(sq_ptr + pid, tl.sum(gd * gd, axis=0))
    c = _c_terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, maddr_ptr, factor_ptr, BLOCK)
    d = tl.load(d_ptr + idx, mask=in_x, other=1.0)
    tl.store(buf_ptr + idx, tl.div_rn(g + c, d), mask=in_x)


@triton.jit
def _hook_post_kernel(buf_ptr, d_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, maddr_ptr, factor_ptr, n,
                      BLOCK: tl.constexpr):
    # out <- out * d - c in place
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    out = tl.load(buf_ptr + idx, mask=in_x, other=0.0)
    d = tl.load(d_ptr + idx, mask=in_x, other=1.0)
    c = _c_terms(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, maddr_ptr, factor_ptr, BLOCK)
    tl.store(buf_ptr + idx, out * d - c, mask=in_x)


@dataclass(frozen=True)
class Table:
    """A bucket's table entries (its parameters with a momentum, by offset): where each starts in
    the bucket and its size (int64 [P]), its momentum's address (int64 [P]), its factor (float32
    [P], as the plain ``torch.mul(m, factor)`` rounds it), and each program's range of entries."""

    tiles: Tiles
    start: torch.Tensor
    count: torch.Tensor
    maddr: torch.Tensor
    factor: torch.Tensor


def programs(n: int) -> int:
    return triton.cdiv(n, BLOCK)


def table(parts: list, n: int, device) -> Table:
    """The table of ``parts`` (``(lo, hi, m, factor)`` as ``frozen_terms`` gives them) in a bucket of
    ``n`` elements."""
    parts = sorted(parts, key=lambda part: part[0])
    los = [lo for lo, _, _, _ in parts]
    counts = [hi - lo for lo, hi, _, _ in parts]
    as_i64 = dict(dtype=torch.int64, device=device)
    return Table(tiles(0, los, counts, -(-n // 8) * 8, device), torch.tensor(los, **as_i64),
                 torch.tensor(counts, **as_i64),
                 torch.tensor([m.data_ptr() for _, _, m, _ in parts], **as_i64),
                 torch.tensor([factor for _, _, _, factor in parts], dtype=torch.float32).to(device))


def pre_launches(buf, d, sq, t: Table, n: int) -> list[Launch]:
    return [Launch(_hook_pre_kernel, programs(n),
                   (buf, d, sq, t.tiles.lo, t.tiles.hi, t.start, t.count, t.maddr, t.factor, n),
                   dict(BLOCK=BLOCK), WARPS)]


def post_launches(buf, d, t: Table, n: int) -> list[Launch]:
    return [Launch(_hook_post_kernel, programs(n),
                   (buf, d, t.tiles.lo, t.tiles.hi, t.start, t.count, t.maddr, t.factor, n),
                   dict(BLOCK=BLOCK), WARPS)]


def pre(buf: torch.Tensor, d: torch.Tensor, t: Table) -> torch.Tensor:
    """``buf <- (buf + c) / d``; returns the float64 sum of squares of ``buf`` as it came (a
    0-dimensional tensor on its device: no host synchronisation)."""
    n = buf.numel()
    sq = torch.empty(programs(n), dtype=torch.float64, device=buf.device)
    for launch in pre_launches(buf, d, sq, t, n):
        launch()
    return sq.sum()


def post(buf: torch.Tensor, d: torch.Tensor, t: Table) -> None:
    """``buf <- buf * d - c``."""
    for launch in post_launches(buf, d, t, buf.numel()):
        launch()
