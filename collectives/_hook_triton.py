"""The DDP hook's ``freeze_step`` pre- and post-pass on a GPU bucket: one Triton launch each
(:mod:`onebit.kernels.triton_hook`) instead of the local norm, a bucket of zeros, a ``mul`` per
parameter, ``add_``, ``div_``, ``mul_`` and ``sub_``; the bucket bitwise the plain ops' (the norm
to float64 rounding: tests/test_triton_hook.py). The codec between them is untouched (any block
size). x86 CPUs take the passes inside the C codec instead (collectives/_hook_fused.py).

Used by :func:`onebit.collectives._frozen_adam.frozen_pre_` where :func:`applies`: a float32
contiguous bucket whose ``hook`` step's backend is ``triton`` (CUDA; a CPU one when forced, for
the tests under ``TRITON_INTERPRET=1``)
whose momenta are float32 contiguous on its device, and Triton importable.
"""

from __future__ import annotations

import torch

from ..kernels import backends

_CACHE_LIMIT = 256  # tables kept (one per bucket and set of momenta; addresses rarely change)


def _plain(t: torch.Tensor, device: torch.device) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device == device


def applies(buffer: torch.Tensor, d: torch.Tensor, parts: list) -> bool:
    device = buffer.device
    if not (parts and backends.select(device, "hook").name == "triton"):
        return False
    if not (_plain(buffer, device) and _plain(d, device) and d.numel() == buffer.numel()
            and buffer.numel() < 2**31):
        return False
    if not all(_plain(m, device) and m.numel() == hi - lo for lo, hi, m, _ in parts):
        return False
    try:
        from ..kernels import triton_hook  # noqa: F401  (triton may be missing)
    except ImportError:
        return False
    return True


def pre_(buffer: torch.Tensor, d: torch.Tensor, parts: list, fa=None):
    """``frozen_pre_``'s contract: ``buffer <- (g + c) / d`` (the bucket counted into ``fa``'s local
    norm), returning ``post(out)``: ``out <- out * d - c``."""
    from ..kernels import triton_hook as th

    tables = fa.tables if fa is not None else {}
    key = (buffer.device, buffer.numel(), tuple((lo, hi, m.data_ptr(), float(f)) for lo, hi, m, f in parts))
    t = tables.get(key)
    if t is None:
        if len(tables) >= _CACHE_LIMIT:
            tables.clear()
        t = tables[key] = th.table(parts, buffer.numel(), buffer.device)
    alive = [m for _, _, m, _ in parts]  # the table's addresses, until the post-pass ran
    sq = th.pre(buffer, d, t)
    if fa is not None:
        fa.add_local(buffer, sq)

    def post(out: torch.Tensor) -> torch.Tensor:
        if out.data_ptr() != buffer.data_ptr() or out.numel() != buffer.numel():
            raise AssertionError("the post-pass expects the bucket the pre-pass wrote")
        th.post(out, d, t)
        del alive[:]
        return out

    return post
