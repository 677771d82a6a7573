"""Float64 reference of compressed_allreduce: W ranks simulated in one process.

This is the oracle for tests and benchmarks (docs/ALGORITHMS.md section 2). It favours
clarity over speed and computes everything in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ReferenceResult", "reference_allreduce", "reference_compress", "sgn"]


def sgn(z: torch.Tensor) -> torch.Tensor:
    """-1 where ``z < 0``, +1 elsewhere (``+0.0``, ``-0.0`` and NaN give +1)."""
    return torch.where(z < 0, -1.0, 1.0).to(z.dtype)


def _scales(z: torch.Tensor, block: int | None) -> torch.Tensor:
    """RMS of ``z`` (0-dim), or of each ``block`` consecutive elements (``[len / block]``)."""
    if block is None:
        return torch.sqrt(torch.sum(z * z) / z.numel()) if z.numel() else z.new_zeros(())
    return torch.sqrt(torch.sum((z * z).view(-1, block), 1) / block)


def _per_element(scales: torch.Tensor, block: int | None) -> torch.Tensor:
    return scales if block is None else scales.repeat_interleave(block)


def reference_compress(
    z: torch.Tensor, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(bits, scale, new_error)`` for ``z`` (already error-compensated); with
    ``block``, ``scale`` holds one RMS per ``block`` elements.

    ``bits`` is ``uint8`` with element ``8k+i`` in bit ``7-i`` of byte ``k``.
    """
    z = z.to(torch.float64)
    scale = _scales(z, block)
    s = sgn(z)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int64)
    bits = ((s > 0).to(torch.int64).view(-1, 8) * weights).sum(1).to(torch.uint8)
    return bits, scale, z - _per_element(scale, block) * s


@dataclass
class ReferenceResult:
    output: torch.Tensor  # float64, shape of the inputs: the value every rank ends with
    worker_errors: list[torch.Tensor]  # float64 [N] per rank
    server_errors: list[torch.Tensor]  # float64 [C] per rank
    worker_scales: torch.Tensor  # float64 [W] ([W, N / block] with block scales)
    server_scales: torch.Tensor  # float64 [W] ([W, C / block] with block scales)
    finite: bool


def reference_allreduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    compress_single_rank: bool = False,
    block: int | None = None,
) -> ReferenceResult:
    """One compressed_allreduce over ``W = len(tensors)`` simulated ranks, in float64;
    ``block``: one scale per ``block`` elements on both stages (docs/ALGORITHMS.md 7).

    Inputs are not modified. A non-finite value anywhere gives an all-NaN output and
    unchanged errors (docs/ALGORITHMS.md 1.1). ``W == 1`` is the identity unless
    ``compress_single_rank`` (the forced mode used to measure the local compute alone).
    """
    W = len(tensors)
    shape, n = tensors[0].shape, tensors[0].numel()
    we = [e.to(torch.float64).clone() for e in worker_errors]
    se = [e.to(torch.float64).clone() for e in server_errors]
    if W == 1 and not compress_single_rank:
        return ReferenceResult(
            tensors[0].to(torch.float64).clone(), we, se,
            torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), True,
        )
    N = we[0].numel()
    C = N // W
    z = []
    for t, e in zip(tensors, we, strict=True):
        zr = e.clone()
        zr[:n] += t.reshape(-1).to(torch.float64)
        z.append(zr)
    w_scales = torch.stack([_scales(zr, block) for zr in z])
    w_spread = [_per_element(s, block) for s in w_scales]
    signs = [sgn(zr) for zr in z]
    finite = bool(torch.isfinite(w_scales).all())
    out = torch.empty(N, dtype=torch.float64)
    s_scales = []
    new_se = []
    for j in range(W):
        m = torch.zeros(C, dtype=torch.float64)
        for r in range(W):
            part = slice(j * C, (j + 1) * C)
            m += signs[r][part] * (w_spread[r][part] if block else w_scales[r]) * (1.0 / W)
        m += se[j]
        s = _scales(m, block)
        s_scales.append(s)
        out[j * C : (j + 1) * C] = _per_element(s, block) * sgn(m)
        new_se.append(m - _per_element(s, block) * sgn(m))
        finite = finite and bool(torch.isfinite(s).all())
    s_scales = torch.stack(s_scales)
    if not finite:
        return ReferenceResult(
            torch.full(shape, float("nan"), dtype=torch.float64), we, se, w_scales, s_scales, False
        )
    new_we = [zr - w_spread[r] * signs[r] for r, zr in enumerate(z)]
    return ReferenceResult(out[:n].reshape(shape), new_we, new_se, w_scales, s_scales, True)
