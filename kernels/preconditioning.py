"""Adam's preconditioning from a frozen variance: the floor under ``sqrt(v)`` and the stale
denominator (docs/ALGORITHMS.md 6 and 8.2). Pure tensor maths, shared by the 1-bit optimizers
(``onebit.optimizers``) and the hooks that run torch's Adam in the same space
(``onebit.collectives``), so it lives below both.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

__all__ = ["inverse_sqrt_bc2", "sqrt_rn", "sqrt_v_floors", "stale_denominator"]


def sqrt_v_floors(variances: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Per tensor, ``ratio`` times the mean of its nonzero ``sqrt(v)`` (a 0-dim float32 on its
    device). A tensor whose variance is all zero (it never had a gradient) takes ``ratio``
    times the mean of the other tensors' means: nothing better is known about it, and a
    floor of zero would let one such coordinate's ``g / eps`` swamp its chunk's scale. No
    host synchronisation."""
    means = []
    for v in variances:
        s = v.float().sqrt()  # (a variance stored in bfloat16: widened, exactly)
        count = torch.count_nonzero(s).clamp_(min=1)
        means.append((s.sum(dtype=torch.float64) / count).to(torch.float32))
    if not means:
        return []
    stacked = torch.stack([m.to(means[0].device) for m in means])
    known = (stacked > 0).sum().clamp_(min=1)
    fallback = stacked.sum() / known
    return [(ratio * torch.where(m > 0, m, fallback.to(m.device))).to(torch.float32) for m in means]


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` correctly rounded to float32 (IEEE's, as the C ``sqrtf`` and Triton's ``sqrt_rn``
    give): torch's CPU float32 ``sqrt`` is not (torch 2.13, AVX-512: one value in five is 1 ulp off),
    so on a CPU it is taken in float64 and rounded once to float32 (exact: a float64 square root of a
    float32 rounds to the float32 one, double rounding is innocuous for sqrt). A new tensor."""
    if v.device.type == "cpu" and v.dtype in (torch.float32, torch.bfloat16):
        return torch.sqrt(v.to(torch.float64)).to(torch.float32)
    return v.float().sqrt()  # (a bfloat16 variance widened first, exactly)


@functools.lru_cache(maxsize=256)  # a few values per run, asked per tensor and step
def inverse_sqrt_bc2(bc2: float) -> float:
    """``1 / sqrt(bc2)`` as the stale denominator multiplies by it: ``sqrt(bc2)`` rounded to float32,
    its reciprocal divided in float32 (what a GPU's ``d.div_(sqrt(bc2))`` computes; the fused passes
    read this float32 value from their table). Exactly 1.0 for ``bc2 = 1``."""
    # in Python floats, each result rounded to float32: a float64 quotient of float32 values rounds to
    # the float32 quotient (double rounding is innocuous for division); no tensor read back
    return _f32(1.0 / _f32(math.sqrt(bc2)))


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def stale_denominator(
    v: torch.Tensor, floor: torch.Tensor | None, eps: float, bc2: float | torch.Tensor = 1.0,
    eps_inside_sqrt: bool = False,
) -> torch.Tensor:
    """Adam's denominator from a frozen (or not refreshed) variance, each ``sqrt(v)`` raised to
    at least ``floor`` first (None: no floor): ``max(sqrt(v), floor) * r + eps`` with ``r =``
    :func:`inverse_sqrt_bc2` (each operation correctly rounded to float32, :func:`sqrt_rn`: the fused
    passes compute it the same way from ``v``, docs/ALGORITHMS.md 6.2), or
    ``sqrt(max(v, floor^2) / bc2 + eps)`` with
    ``eps_inside_sqrt``. A new tensor. Without a floor and bias correction it is bitwise
    ``v.sqrt() + eps``, the reference's. ``bc2`` a 0-dim tensor (a step count kept on a GPU): the same
    maths on the device, with no host read."""
    on_device = isinstance(bc2, torch.Tensor)
    if eps_inside_sqrt:
        v = v.float()  # a variance stored in bfloat16 (``variance_dtype``): widened, exactly
        w = v.clamp(min=floor * floor) if floor is not None else v.clone()
        if on_device or bc2 != 1.0:
            w.div_(bc2)
        return w.add_(eps).sqrt_()
    if v.device.type == "cpu" and not on_device:  # one C pass where the library runs (float64 sqrt: slow)
        from . import cpu_fused

        d = cpu_fused.stale_denominator(v, (0.0 if floor is None else float(floor), inverse_sqrt_bc2(bc2),
                                            float(eps)))
        if d is not None:
            return d
    d = sqrt_rn(v)
    if floor is not None:
        d = torch.maximum(d, floor)
    if on_device:  # inverse_sqrt_bc2's roundings (a float64 root rounded once, a float32 quotient), there
        d.mul_(1.0 / bc2.to(device=d.device, dtype=torch.float64).sqrt().to(torch.float32))
    elif bc2 != 1.0:
        d.mul_(inverse_sqrt_bc2(bc2))
    return d.add_(eps)
