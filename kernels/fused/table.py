"""One table format for every fused step and every backend: what a bucket's passes read besides
the codec's buffers.

A bucket's K tensors lie end to end in its flat buffer: tensor k covers flat elements ``[start[k],
start[k] + count[k])``. Per tensor the table holds the addresses of the tensors the step reads or
writes (int64 ``addr`` [A, K], one row per named column, 0 for a None gradient: a zero one) and
its float32 scalars (``scal`` [K, 8], named columns, unused ones 0). Each step names its
columns (``ADDRESSES``, ``SCALARS`` in its file); the C reads a row of ``addr`` as an array and
``scal`` as 8 floats per tensor (``kernels/native/native.h``'s ``table_t``, ``SC``), the Triton
kernels the same two tensors on the device (``addr + column * K + k``, ``scal + k * 8 + column``).

A step that reads a frozen variance ``v`` (address column ``var``) has its stale denominator's
scalars in the last three columns (``DENOMINATOR``: the tensor's floor, ``r = 1 / sqrt(bc2)``,
``eps``) and computes ``d = max(sqrt(v), floor) * r + eps`` as it reads ``v`` (docs/ALGORITHMS.md
6.2: the optimizers keep ``v`` only), float32 or bfloat16 (a variance frozen for good, stored so:
``variance_dtype``), widened exactly as it is read: a bfloat16 variance's address has bit 0 set in
the table (:func:`_address`; its data is 2-byte aligned, so the bit is free), which the C
(``native.h``'s ``var_of``) and the Triton passes (:func:`denominator`) read per tensor.

The Triton passes also read which tensors each program's 1024 elements meet (:func:`tiles`); the
C walks the table itself (``table_first`` / ``table_part``)."""

from __future__ import annotations

import bisect

import torch

from .._triton import constexpr, jit, tl

SCALARS = 8  # float32 scalars per tensor
DENOMINATOR = ("floor", "r", "eps")  # the last three scalar columns of a step that reads ``var``
BLOCK_BYTES = 128  # bytes of packed bits per program of a fused Triton pass (1024 elements)
WARPS = 4  # the gathered gradients, denominators and scalars would spill at the codec's 4096
_S = constexpr(SCALARS)
_FLOOR = constexpr(SCALARS - 3)


class Table:
    """A bucket's table (see the module): ``offsets``/``numels`` of its tensors, the step's address
    column names and scalar column names (at most 8; a step with a ``var`` column ends them with
    ``DENOMINATOR``), on ``device``."""

    def __init__(self, offsets: list[int], numels: list[int], addresses: tuple[str, ...],
                 scalars: tuple[str, ...], device) -> None:
        if len(scalars) > SCALARS:
            raise ValueError(f"scalars: expected at most {SCALARS} names, got {len(scalars)}")
        if "var" in addresses and tuple(scalars[SCALARS - 3:]) != DENOMINATOR:
            raise ValueError(f"scalars: a step that reads var ends its scalars with {DENOMINATOR}")
        self.offsets, self.numels = list(offsets), list(numels)
        self.addresses, self.scalars = tuple(addresses), tuple(scalars)
        self.K, self.device = len(self.offsets), torch.device(device)
        as_i64 = dict(dtype=torch.int64, device=self.device)
        self.start = torch.tensor(self.offsets, **as_i64)
        self.count = torch.tensor(self.numels, **as_i64)
        self.addr = torch.zeros(len(self.addresses), self.K, **as_i64)
        self.scal = torch.zeros(self.K, SCALARS, dtype=torch.float32, device=self.device)
        self.key = None  # what fill last wrote: usually the same tensors and scalars every step
        self.tiles: Tiles | None = None  # the Triton passes' (made on their first call)

    def column(self, name: str) -> int:
        """The ``addr`` row of address column ``name``."""
        return self.addresses.index(name)

    def ptr(self, name: str) -> int:
        """The address of column ``name``'s K addresses (what the C reads)."""
        # row arithmetic on the contiguous [columns, K] int64 table: no indexing op per call
        return self.addr.data_ptr() + self.column(name) * self.K * self.addr.element_size()

    def fill(self, tensors: dict[str, list[torch.Tensor | None]], rows: list[tuple[float, ...]],
             floors: torch.Tensor | None = None) -> None:
        """Point the columns at ``tensors`` (one list of K per address column; None: none) and set
        the scalars (one tuple per tensor, in ``SCALARS`` order, each rounded to float32 as the plain
        ops round a Python scalar); a no-op where neither changed since the last fill. ``floors``: the
        ``floor`` column (``DENOMINATOR``'s first) from this float32 tensor of K on the table's device
        instead of the rows (a copy on the device: the floors are never read back to the host), written
        where it or the rows changed. The table holds addresses only: the caller keeps the tensors alive
        while a pass reads it."""
        addrs = [[_address(t, name) for t in tensors[name]] for name in self.addresses]
        old = self.key or (None, None, None)
        if old[0] != addrs:
            _write_to(self.addr, torch.tensor(addrs, dtype=torch.int64).view(len(self.addresses), self.K))
        rewritten = old[1] != rows
        if rewritten:  # every step with a learning-rate schedule or bias correction
            padded = [tuple(r) + (0.0,) * (SCALARS - len(r)) for r in rows]
            values = torch.tensor(padded, dtype=torch.float64).view(self.K, SCALARS).to(torch.float32)
            _write_to(self.scal, values)
        if floors is not None and (rewritten or floors is not old[2]):
            self.scal[:, SCALARS - 3].copy_(floors)
        self.key = (addrs, list(rows), floors)


def _address(t: torch.Tensor | None, column: str) -> int:
    """A table entry: 0 for None, else ``t``'s address; in the ``var`` column a bfloat16 variance's with
    bit 0 set (the passes read its dtype from it), a float32 one's as it is."""
    if t is None:
        return 0
    if column == "var" and t.dtype == torch.bfloat16:
        return t.data_ptr() | 1
    return t.data_ptr()


def _write_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (on a table's device) = ``src`` (CPU), in place. On a GPU from pinned memory without
    waiting (issue 57: a copy from pageable memory synchronises the host with the device); the caching
    host allocator keeps the pinned block until the copy is done."""
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class Tiles:
    """Which tensors each program of a bucket's Triton passes meets: ``lo[t] <= k < hi[t]`` for
    program t's ``per`` elements of N (int32 [programs] each, on the table's device)."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, N: int, per: int) -> None:
        self.lo, self.hi, self.key = lo, hi, (N, per)


def tile_ranges(offsets: list[int], numels: list[int], N: int, per: int) -> tuple[list[int], list[int]]:
    """For each program of ``per`` elements over N (padded) elements of a bucket whose tensors cover
    ``[offsets[k], offsets[k] + numels[k])``: the first tensor it meets and one past the last."""
    ends = [o + c for o, c in zip(offsets, numels, strict=True)]
    lo, hi = [], []
    for t in range(-(-N // per)):
        a, b = t * per, (t + 1) * per
        k0 = bisect.bisect_right(ends, a)  # the first tensor ending after a
        lo.append(k0)
        hi.append(max(k0, bisect.bisect_left(offsets, b)))  # the first starting at or after b
    return lo, hi


def tiles(table: Table, N: int, per: int = BLOCK_BYTES * 8) -> Tiles:
    """The program -> tensor ranges of ``table`` over N (padded) elements, ``per`` elements per
    program; kept on the table."""
    if table.tiles is not None and table.tiles.key == (N, per):
        return table.tiles
    lo, hi = tile_ranges(table.offsets, table.numels, N, per)
    as_i32 = dict(dtype=torch.int32, device=table.device)
    table.tiles = Tiles(torch.tensor(lo, **as_i32), torch.tensor(hi, **as_i32), N, per)
    return table.tiles


def programs(N: int) -> int:
    """Programs per fused pass over a bucket of N (padded) elements."""
    return -(-(N // 8) // BLOCK_BYTES)


@jit
def owned(idx, k, start_ptr, count_ptr):
    # the offsets of idx in tensor k and which elements of idx are k's
    off = idx - tl.load(start_ptr + k).to(tl.int32)
    return off, (off >= 0) & (off < tl.load(count_ptr + k))


@jit
def end_to_end_block(n, agreed_ptr, BLOCK: tl.constexpr, GATE: tl.constexpr):
    # this program's elements of tensors laid end to end (n in all; int32 indices: the caller keeps
    # n < 2^31): idx, which are in the data (in_x) and which of those the step may store (kept: all of
    # in_x, or none where GATE and the ranks' agreed poison, float32 0 or NaN, is NaN)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    kept = in_x
    if GATE:
        agreed = idx.to(tl.float32) * 0.0 + tl.load(agreed_ptr)  # (a tensor: a scalar mask is refused)
        kept = in_x & (agreed == agreed)
    return idx, in_x, kept


@jit
def elements(n, total_bytes, BLOCK_BYTES: tl.constexpr):
    # this program's byte rows of a message (g) and their elements: indices [BLOCK_BYTES, 8] (idx;
    # i the bit within a byte), which rows are in the message (live) and which elements in the data
    # (in_x); int32 indices: the caller keeps N < 2^31
    return elements_at(tl.program_id(0), n, total_bytes, BLOCK_BYTES)


@jit
def elements_at(pid, n, total_bytes, BLOCK_BYTES: tl.constexpr):
    # elements() for the pid-th block of a message (a stage's program: its index within its bucket)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = (g < total_bytes)[:, None]
    return g, i, idx, live, live & (idx < n)


@jit
def grad_denom(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K,
               GRAD: tl.constexpr, VAR: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    # the program's elements' gradients (0 where a tensor's gradient is None: address 0, and outside
    # every tensor) and stale denominators (1 outside every tensor), read through columns GRAD and VAR:
    # d = max(sqrt(v), floor) * r + eps, each operation rounded (docs/ALGORITHMS.md 6.2; the
    # launchers turn contraction off)
    grad = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    den = tl.full([BLOCK_BYTES, 8], 1.0, tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        ga = tl.load(addr_ptr + GRAD * K + k)
        gp = ga.to(tl.pointer_type(tl.float32))
        grad = tl.where(mine, tl.load(gp + off, mask=mine & ((off * 0 + ga) != 0), other=0.0), grad)
        den = tl.where(mine, denominator(addr_ptr, scal_ptr, VAR, K, k, off, mine), den)
    return grad, den


@jit
def denominator(addr_ptr, scal_ptr, VAR: tl.constexpr, K, k, off, mine):
    # tensor k's stale denominators at offsets off (where mine; elsewhere those of v = 1), from its
    # variance in column VAR (float32, or bfloat16 where bit 0 of its address is set): max(sqrt(v),
    # floor) * r + eps, each operation rounded
    a = tl.load(addr_ptr + VAR * K + k)
    tag = a & 1  # 1: a bfloat16 variance (bit 0 of its address: _address), widened exactly
    base = a - tag
    narrow = (off * 0 + tag) != 0  # (as a tensor of off's shape: the interpreter's masks are)
    v = tl.load(base.to(tl.pointer_type(tl.float32)) + off, mask=mine & (narrow == 0), other=1.0)
    v16 = tl.load(base.to(tl.pointer_type(tl.bfloat16)) + off, mask=mine & narrow, other=1.0)
    v = tl.where(narrow, v16.to(tl.float32), v)
    d = tl.maximum(tl.sqrt_rn(v), scalar(scal_ptr, k, _FLOOR), propagate_nan=tl.PropagateNan.ALL)
    return d * scalar(scal_ptr, k, _FLOOR + 1) + scalar(scal_ptr, k, _FLOOR + 2)


@jit
def address(addr_ptr, column, K, k):
    # tensor k's float32 data pointer in address column `column`
    return tl.load(addr_ptr + column * K + k).to(tl.pointer_type(tl.float32))


@jit
def scalar(scal_ptr, k, column):
    # tensor k's scalar in column `column`
    return tl.load(scal_ptr + k * _S + column)
