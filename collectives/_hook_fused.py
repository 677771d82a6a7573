"""The hooks' ``freeze_step`` passes fused (their maths, every backend: :mod:`onebit.kernels.fused.hook`):
when a bucket takes them, and their call.

- native (CPU): the pre-pass inside the worker's encode and the post-pass inside decompress
  (:func:`passes`, for ``compressed_allreduce_passes``): two passes over the bucket instead of four;
  where the codec's passes cannot take them (a mesh, a covered bucket), one threaded pass each way
  around the collective (:func:`pre_`).
- triton (CUDA; a CPU bucket when forced, for the tests under ``TRITON_INTERPRET=1``): one launch each
  way around the codec's own kernels (:func:`pre_`, ``frozen_pre_``'s contract), so any block size and
  a mesh keep them.

Either applies to a float32 contiguous bucket whose momenta are float32 contiguous tensors on its
device, where the ``hook`` step's backend (:func:`onebit.kernels.backends.select`) is that one;
``use_backend("plain", steps=["hook"])`` (tests, A/B) keeps the unfused passes.
"""

from __future__ import annotations

import torch

from ..kernels import backends
from ..kernels.fused import hook

_CACHE_LIMIT = 256  # Triton tables kept (one per bucket and set of momenta; addresses rarely change)


def backend(buffer: torch.Tensor, d, parts: list) -> str | None:
    """``native`` or ``triton``: the backend that takes this bucket's passes fused (``d``: its
    denominators, a flat float32 tensor or :class:`onebit.collectives._frozen_adam.Denominators`;
    ``parts`` as ``frozen_terms`` gives them); None: the unfused passes."""
    device = buffer.device

    def f32(t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.is_contiguous() and t.device == device

    def source_ok(src, n: int) -> bool:  # a span's denominators as the fused passes read them
        if src is None:
            return True
        t = src[1]
        return (t.numel() == n and t.is_contiguous() and t.device == device
                and (t.dtype == torch.float32 or (src[0] == "v" and t.dtype == torch.bfloat16)))

    if not (parts and f32(buffer) and d.numel() == buffer.numel()
            and all(f32(m) and m.numel() == hi - lo for lo, hi, m, _ in parts)):
        return None
    if not (f32(d) if isinstance(d, torch.Tensor)  # (both backends read each span's as laid out)
            else all(source_ok(d.source(lo), hi - lo) for lo, hi, _, _ in parts)):
        return None
    name = backends.select(device, "hook").name
    if name == "triton" and buffer.numel() >= 2**31:  # the Triton passes' int32 indices
        return None
    return None if name == "plain" else name


def sources(d, parts: list) -> list:
    """Each part's denominator source for :func:`onebit.kernels.fused.hook.table` (``d`` as
    :func:`backend` takes it: a flat tensor's spans are given denominators)."""
    if isinstance(d, torch.Tensor):
        return [("d", d[lo:hi]) for lo, hi, _, _ in parts]
    return [None if s is None else s[:3] for s in (d.source(lo) for lo, _, _, _ in parts)]


def passes(d, parts: list, fa=None, block: int | None = None) -> hook.NativePasses:
    """The native passes of one bucket's call (``d`` as :func:`backend` takes it; ``block``: the
    call's); the worker counts the bucket into ``fa``'s local norm (None: the caller counted it)."""
    found = sources(d, parts)
    t = hook.table(parts, found)
    t.alive = (d, found, [m for _, _, m, _ in parts])  # the addresses in the table, until the call ends
    return hook.NativePasses(t, (lambda flat, sq: None) if fa is None else fa.add_local, block)


def pre_(buffer: torch.Tensor, d, parts: list, fa=None, name: str = "triton", tables: dict | None = None):
    """``frozen_pre_``'s contract in backend ``name``'s passes (as :func:`backend` chose it) over the
    whole bucket: ``buffer <- (g + c) / d`` (the bucket counted into ``fa``'s local norm; ``d`` made as
    the pass reads it), returning ``post(out)``: ``out <- out * d - c``. Triton: one launch each way;
    native: one threaded pass each way (where the codec's passes cannot take them: a mesh, a covered
    bucket). ``tables``: the tables kept between calls (None: made for this call)."""
    tables = {} if tables is None else tables
    found = sources(d, parts)
    key = (buffer.device, buffer.numel(), tuple((lo, hi, m.data_ptr(), float(f)) for lo, hi, m, f in parts),
           tuple(None if s is None else (s[0], s[1].data_ptr(), s[1].dtype, *s[2:]) for s in found))
    t = tables.get(key)  # (the addresses and scalars the table holds: after the freeze, every step's)
    if t is None:
        if len(tables) >= _CACHE_LIMIT:
            tables.clear()
        t = tables[key] = hook.table(parts, found, buffer.device)
    alive = [d, found] + [m for _, _, m, _ in parts]  # the table's addresses, until the post-pass ran
    n = buffer.numel()
    sq = hook.pre(buffer, t) if name == "triton" else hook.hook_pre_range(buffer, 0, n, t)
    if fa is not None:
        fa.add_local(buffer, sq)

    def post(out: torch.Tensor) -> torch.Tensor:
        if out.data_ptr() != buffer.data_ptr() or out.numel() != n:
            raise AssertionError("the post-pass expects the bucket the pre-pass wrote")
        if name == "triton":
            hook.post(out, t)
        else:
            hook.hook_post_range(out, 0, n, t)
        del alive[:]
        return out

    return post
