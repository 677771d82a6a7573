"""The bindings of the C passes with an optimizer's maths inside (onebit.kernels.cpu_simd's library;
the C: kernels/fused/adam.c, zero_one.c, hook.c): OnebitAdam's fold and update
(optimizers/_fused_cpu.py), ZeroOneAdam's phase-1 step (optimizers/_fused_cpu_zoa.py) and the DDP
hook's pre- and post-pass (collectives/_hook_fused.py, collectives/_frozen_adam.py), each over a
table of the tensors a bucket covers. The codec's own passes are :mod:`onebit.kernels.cpu_simd`'s."""

from __future__ import annotations

import ctypes

import torch

from .cpu_simd import _f32, _isa, _threads, library


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
        self.m = torch.zeros(self.K, dtype=torch.int64)  # ZeroOneAdam's momentum (_fused_cpu_zoa.py)
        self.key = None  # what the caller last filled in (optimizers/_fused_cpu.py)


def _rows(bits: torch.Tensor, C: int, W: int) -> bool:
    return (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.shape[0] == W and bits.shape[1] == C // 8
            and bits.stride(1) == 1)


def _chunks_ok(name: str, flat: torch.Tensor, bits: torch.Tensor, C: int, W: int, n_enc: list[int],
               n_fold: list[int], e: torch.Tensor) -> None:
    if not (_f32(flat) and _f32(e) and _rows(bits, C, W) and len(n_fold) == W
            and all(a % 8 == 0 and 0 <= a <= b <= C and (b == 0 or (j * C + b <= flat.numel()
                                                                  and j * C + a <= e.numel()))
                    for j, (a, b) in enumerate(zip(n_enc, n_fold, strict=True)))):
        raise ValueError(f"cpu_simd_fused.{name}: expected contiguous float32 flat and e, bits [W, C / 8] "
                         "with contiguous rows, and per chunk n_enc (a multiple of 8) <= n_fold <= C")


def _encode_all(name: str, fn, flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int,
                n_enc: list[int], n_fold: list[int], table_args: tuple, isa: int | None) -> list[float]:
    """The call of a worker pass over every chunk: the chunks' sizes, the threads' partial sums."""
    W = len(n_enc)
    _chunks_ok(name, flat, bits, C, W, n_enc, n_fold, e)
    enc, fold = torch.tensor(n_enc, dtype=torch.int64), torch.tensor(n_fold, dtype=torch.int64)
    threads = torch.get_num_threads()
    sums, part = torch.empty(W, dtype=torch.float64), torch.empty(W * threads, dtype=torch.float64)
    fn(flat.data_ptr(), e.data_ptr(), bits.data_ptr(), bits.stride(0), C, W, enc.data_ptr(), fold.data_ptr(),
       sums.data_ptr(), part.data_ptr(), *table_args, _isa(isa), threads)
    return sums.tolist()


def fold_encode_all(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int, n_enc: list[int],
                    n_fold: list[int], table: Table, isa: int | None = None) -> list[float]:
    """Fold the gradients into ``flat`` (``u = u * b1 + (w * g) / d``) and encode ``flat + e`` into
    the message rows in the same pass, for every chunk of a bucket in one call: chunk j's elements
    ``[j C, j C + n_enc[j])`` encoded into ``bits[j]`` (a message's ``[W, C / 8]`` rows), its fold
    to ``j C + n_fold[j]``; returns each chunk's float64 sum of squares, bitwise what W calls, each
    with the other chunks empty, return."""
    t = table
    args = (t.start.data_ptr(), t.count.data_ptr(), t.g.data_ptr(), t.d.data_ptr(), t.scalars.data_ptr(), t.K)
    fn = library().onebit_fold_encode_all
    return _encode_all("fold_encode_all", fn, flat, e, bits, C, n_enc, n_fold, args, isa)


def decompress_update_all(bits: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor,
                          e: torch.Tensor | None, worker_scales: torch.Tensor | None, C: int, n: list[int],
                          table: Table, clip: float, isa: int | None = None) -> None:
    """Decompress (with the deferred worker error where ``e`` is given) then, in the same pass,
    ``p = p * decay + (-lr) * clamp(u / bc1, -clip, clip)`` for the parameters covered, for every
    chunk of a bucket in one call: chunk j's elements ``[j C, j C + n[j])`` from ``bits[j]`` with
    ``scales[j]`` (and ``worker_scales[j]``; ``e`` None: no error update)."""
    W = len(n)
    if not (_f32(flat) and _rows(bits, C, W) and _f32(scales) and scales.numel() == W
            and all(a % 8 == 0 and 0 <= a <= C and (a == 0 or j * C + a <= flat.numel())
                    for j, a in enumerate(n))
            and (e is None or (_f32(e) and _f32(worker_scales) and worker_scales.numel() == W
                               and all(a == 0 or j * C + a <= e.numel() for j, a in enumerate(n))))):
        raise ValueError("cpu_simd_fused.decompress_update_all: expected contiguous float32 flat, bits "
                         "[W, C / 8] with contiguous rows, W float32 scales and per chunk n (a multiple of "
                         "8) <= C")
    counts = torch.tensor(n, dtype=torch.int64)
    t = table
    library().onebit_decompress_update_all(
        bits.data_ptr(), bits.stride(0), scales.data_ptr(), flat.data_ptr(),
        None if e is None else e.data_ptr(), None if worker_scales is None else worker_scales.data_ptr(),
        C, W, counts.data_ptr(), t.start.data_ptr(), t.count.data_ptr(), t.p.data_ptr(), t.scalars.data_ptr(),
        t.K, -clip, clip, _isa(isa), torch.get_num_threads())


def zoa_encode_all(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int, n_enc: list[int],
                   n_fold: list[int], table: Table, isa: int | None = None,
                   sync: bool = False) -> list[float]:
    """ZeroOneAdam's worker pass (phase 1) of every chunk of a bucket: :func:`fold_encode_all`'s
    contract with ``x = g / d`` (0 without a gradient) encoded instead of the folded momentum and
    ``flat`` left as it is, but over each chunk's ``[j C + n_enc[j], j C + n_fold[j])``, which
    receives ``x`` (the padded rest's data, for the caller's plain encode). ``sync``: phase 2's
    synchronisation, ``x = p - sync_params`` (their addresses in the table's ``g``)."""
    t = table
    args = (t.start.data_ptr(), t.count.data_ptr(), t.g.data_ptr(), t.d.data_ptr(), t.p.data_ptr(), t.K,
            int(sync))
    fn = library().onebit_zoa_encode_all
    return _encode_all("zoa_encode_all", fn, flat, e, bits, C, n_enc, n_fold, args, isa)


def zoa_step_all(bits: torch.Tensor, scales: torch.Tensor, e: torch.Tensor | None,
                 worker_scales: torch.Tensor | None, C: int, n: list[int], table: Table, clip: float,
                 isa: int | None = None, sync: bool = False) -> None:
    """ZeroOneAdam's decompress pass (phase 1) of every chunk of a bucket: chunk j's elements ``[j C,
    j C + n[j])`` decoded (``scales[j]``), the deferred worker error from ``z = g / d + e`` (``e``
    None: not updated), ``m = fma((1 - b1) mean, d, b1 m)`` and the stale step ``p = p - lr (clamp(m /
    d, -clip, clip) [+ wd p])`` of the tensors they cover (the table's ``m`` and ``p``). ``sync``:
    phase 2's synchronisation instead: the error from ``z = p - sync_params + e``, ``m = mean d /
    nl`` (``nl``: the table's ``scalars[:, 4]``), ``sync_params = sync_params + mean``, ``p =
    sync_params``."""
    W = len(n)
    if not (_rows(bits, C, W) and _f32(scales) and scales.numel() == W
            and all(a % 8 == 0 and 0 <= a <= C for a in n)
            and (e is None or (_f32(e) and _f32(worker_scales) and worker_scales.numel() == W
                               and all(a == 0 or j * C + a <= e.numel() for j, a in enumerate(n))))):
        raise ValueError("cpu_simd_fused.zoa_step_all: expected bits [W, C / 8] with contiguous rows, W "
                         "float32 scales and per chunk n (a multiple of 8) <= C")
    counts = torch.tensor(n, dtype=torch.int64)
    t = table
    library().onebit_zoa_step_all(
        bits.data_ptr(), bits.stride(0), scales.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scales is None else worker_scales.data_ptr(), C, W, counts.data_ptr(),
        t.start.data_ptr(), t.count.data_ptr(), t.g.data_ptr(), t.d.data_ptr(), t.m.data_ptr(),
        t.p.data_ptr(), t.scalars.data_ptr(), t.K, -clip, clip, int(sync), _isa(isa), torch.get_num_threads())


def zoa_step_range(mean: torch.Tensor, a: int, b: int, table: Table, clip: float,
                   isa: int | None = None, sync: bool = False) -> None:
    """:func:`zoa_step_all`'s updates alone over flat elements ``[a, b)``, their decoded mean in
    ``mean`` (``b - a`` float32; a padded rest, its error updated by the caller)."""
    if not (_f32(mean) and mean.numel() == b - a and 0 <= a <= b):
        raise ValueError("cpu_simd_fused.zoa_step_range: expected b - a contiguous float32 means")
    t = table
    library().onebit_zoa_step_range(mean.data_ptr(), a, b, t.start.data_ptr(), t.count.data_ptr(),
                                    t.g.data_ptr(), t.d.data_ptr(), t.m.data_ptr(), t.p.data_ptr(),
                                    t.scalars.data_ptr(), t.K, -clip, clip, int(sync), _isa(isa))


def update(flat: torch.Tensor, a: int, b: int, table: Table, clip: float, isa: int | None = None) -> None:
    """The update alone for flat elements ``[a, b)``."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd_fused.update: expected contiguous float32 flat covering [a, b)")
    t = table
    library().onebit_update(flat.data_ptr(), a, b, t.start.data_ptr(), t.count.data_ptr(), t.p.data_ptr(),
                            t.scalars.data_ptr(), t.K, -clip, clip, _isa(isa))


def hook_pre(g: torch.Tensor, m: torch.Tensor, d: torch.Tensor, factor: float,
             isa: int | None = None) -> float:
    """The DDP hook's pre-pass ``g = (g + m * factor) / d`` in place (float32, cpu_fused.hook_pre_'s
    order: bitwise the same), returning the float64 sum of squares of ``g`` as it came: the local
    gradient norm and the pass in one read."""
    n = g.numel()
    if not (_f32(g) and _f32(m) and _f32(d) and m.numel() == n and d.numel() == n):
        raise ValueError("cpu_simd_fused.hook_pre: expected contiguous float32 CPU g, m and d of one size")
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
    :func:`onebit.kernels.cpu_simd.encode_total` adds it); and the float64 sum of squares of the
    gradient as it came."""
    unit = block or 8
    if not (_f32(flat) and _f32(e) and bits.dtype == torch.uint8 and bits.is_contiguous()
            and bits.numel() >= n // 8 and n % unit == 0 and off >= 0
            and off + n <= min(flat.numel(), e.numel())):
        raise ValueError("cpu_simd_fused.hook_encode: expected contiguous float32 flat and e covering the "
                         "range, n a multiple of the block (or of 8), and n / 8 uint8 bits")
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
        raise ValueError("cpu_simd_fused.hook_decompress: expected contiguous float32 flat covering the "
                         "range, n a multiple of the block (or of 8), n / 8 uint8 bits, float32 scales per "
                         "block")
    step = 1 if block else 0
    library().onebit_hook_decompress(
        bits.data_ptr(), scales.data_ptr(), step, flat.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scales is None else worker_scales.data_ptr(), step, off, n, block or 0,
        *_hook_args(table), _isa(isa), _threads(n))


def hook_pre_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> float:
    """The hook's pre-pass alone over flat elements ``[a, b)``; the sum of squares of the gradient."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd_fused.hook_pre_range: expected contiguous float32 flat covering [a, b)")
    return float(library().onebit_hook_pre_range(flat.data_ptr(), a, b, *_hook_args(table), _isa(isa)))


def hook_post_range(flat: torch.Tensor, a: int, b: int, table: Table, isa: int | None = None) -> None:
    """The hook's post-pass alone over flat elements ``[a, b)``."""
    if not (_f32(flat) and 0 <= a <= b <= flat.numel()):
        raise ValueError("cpu_simd_fused.hook_post_range: expected contiguous float32 flat covering [a, b)")
    library().onebit_hook_post_range(flat.data_ptr(), a, b, *_hook_args(table), _isa(isa))
