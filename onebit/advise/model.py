"""The advisor's model: what one all-reduce of n float32 elements costs on a measured link.

Each collective is an affine function fitted to this run's timings (docs/speedup.md):

    t_float32(n) = a_f + b_f * 4n                 (torch.distributed.all_reduce)
    t_1bit(n)    = c_0 + c_1 * n                  (encode + server reduce + decode: compute)
                 + a_c + b_c * wire(n)            (all-to-all + all-gather of the bits)

``wire(n)`` is the bytes each rank sends in one compressed call (``compressed_bytes``);
``a`` terms are latencies, ``b`` terms inverse bandwidths as the link delivers them to W
ranks at once (they absorb the ring's ``2 (W-1) / W``, a shared link, the backend's own
overheads). A training step with ``c`` seconds of compute, of whose dense all-reduce a
fraction ``o`` is already hidden behind backward (DDP's overlap), then takes

    step_float32 = c + (1 - o) * t_float32(P)
    step_1bit    = c + t_codec(P) + (1 - o) * t_comm(P)

(the compute of the compression is never hidden: it competes with backward for the same
device; the DDP hook overlaps its communication as DDP does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..collectives.wire import compressed_bytes
from ..kernels.layout import padded_numel

__all__ = ["Affine", "LinkModel", "project_step", "verdict"]

THRESHOLD = 1.0  # compress when the predicted speedup is at least this (see verdict)
MARGIN = 0.1  # within THRESHOLD +- MARGIN the reason says the call is close


@dataclass(frozen=True)
class Affine:
    """``t(x) = latency + per_unit * x`` (seconds), both non-negative."""

    latency: float
    per_unit: float

    def __call__(self, x: float) -> float:
        return self.latency + self.per_unit * x

    @classmethod
    def fit(cls, xs: Sequence[float], ts: Sequence[float]) -> Affine:
        """Weighted least squares, residuals weighted by ``1 / t`` (timing noise that grows with
        the time), constrained to non-negative coefficients. Between plain least squares (the
        largest size decides everything) and relative error (the latency-bound small sizes
        decide the slope: on a token-bucket link whose burst lets small messages through at
        once, that underestimated the per-byte cost of the large ones by 13-50% here)."""
        pts = [(float(x), float(t)) for x, t in zip(xs, ts, strict=True) if t > 0 and math.isfinite(t)]
        if not pts:
            raise ValueError("ts: expected at least one positive, finite time")
        w = [1.0 / t for _, t in pts]  # weights of the squared residuals
        sw = sum(w)
        sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
        st = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
        sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
        sxt = sum(wi * x * t for wi, (x, t) in zip(w, pts, strict=True))
        det = sw * sxx - sx * sx
        if len(pts) > 1 and det > 1e-12 * sw * sxx:
            b = (sw * sxt - sx * st) / det
            a = (st - b * sx) / sw
            if a >= 0 and b >= 0:
                return cls(a, b)
        # the unconstrained optimum has a negative coefficient: the better of the two edges
        edges = [cls(st / sw, 0.0)]
        if sxx > 0:
            edges.append(cls(0.0, max(sxt / sxx, 0.0)))
        return min(edges, key=lambda f: sum(wi * (f(x) - t) ** 2 for wi, (x, t) in zip(w, pts, strict=True)))


@dataclass(frozen=True)
class LinkModel:
    """Both all-reduces on one link (one process group of ``world_size`` ranks)."""

    world_size: int
    block: int | None
    dense: Affine  # seconds against the tensor's float32 bytes, 4n
    codec: Affine  # seconds against elements: encode + server reduce + decode
    comm: Affine  # seconds against the bytes one rank sends in a compressed call
    bf16: Affine | None = None  # seconds against the tensor's bf16 bytes, 2n (reported only)

    def wire(self, n: int) -> int:
        """Bytes one rank sends in one compressed_allreduce of n elements."""
        return compressed_bytes(padded_numel(n, self.world_size, self.block), self.world_size, self.block)

    def float32_seconds(self, n: int) -> float:
        return self.dense(4 * n)

    def bf16_seconds(self, n: int) -> float | None:
        return None if self.bf16 is None else self.bf16(2 * n)

    def onebit_seconds(self, n: int) -> float:
        return self.codec(n) + self.comm(self.wire(n))

    def speedup(self, n: int) -> float:
        """float32 all-reduce time over 1-bit all-reduce time for n elements."""
        return self.float32_seconds(n) / self.onebit_seconds(n)

    def break_even(self, high: int = 1 << 40) -> int | None:
        """The smallest n (to 1%) from which the 1-bit all-reduce is the faster one, None if
        it never is up to ``high`` (the speedup rises with n: latencies first, then the ratio
        of the per-element costs)."""
        if self.speedup(high) < 1.0:
            return None
        if self.speedup(1) >= 1.0:
            return 1
        lo, hi = 1, high
        while hi > lo * 1.01 + 1:
            mid = int(math.sqrt(lo * hi))
            if self.speedup(mid) >= 1.0:
                hi = mid
            else:
                lo = mid
        return hi

    def step_seconds(self, n: int, compute: float, overlap: float) -> tuple[float, float]:
        """(float32, 1-bit) seconds of a step with ``compute`` seconds of compute, a fraction
        ``overlap`` of the dense all-reduce hidden behind it (module docstring)."""
        dense = compute + (1.0 - overlap) * self.float32_seconds(n)
        onebit = compute + self.codec(n) + (1.0 - overlap) * self.comm(self.wire(n))
        return dense, onebit

    def as_dict(self) -> dict:
        return asdict(self)


def verdict(speedup: float, what: str, detail: str) -> tuple[str, str]:
    """("compress" or "do not compress", the reason in one line) for a predicted ``speedup`` of
    ``what`` ("the all-reduce", "the step"); ``detail`` says where the time goes."""
    close = abs(speedup - THRESHOLD) < MARGIN
    if speedup >= THRESHOLD:
        reason = f"{what} is predicted {speedup:.2f}x faster with 1-bit compression ({detail})"
        if close:
            reason += "; a small gain: measure a few steps of your own job before switching"
        return "compress", reason
    reason = f"{what} is predicted {1 / speedup:.2f}x slower with 1-bit compression ({detail})"
    if close:
        reason += "; close to break-even: a slower link would tip it"
    return "do not compress", reason


def project_step(link_bits_per_second: float, compute: float, float32_bytes: float, onebit_bytes: float,
                 codec: float) -> tuple[float, float]:
    """(float32, 1-bit) seconds of one step on a link of that speed per rank, from quantities
    counted on this machine: ``compute`` seconds of the step outside communication and
    compression, the bytes one rank sends per step in a float32 all-reduce and with 1-bit
    compression, and ``codec`` seconds of compression per step. The model's bandwidth terms
    with each rank's bytes on a link of its own (``b = 8 / link_bits_per_second``), no latency
    and no overlap: an estimate of the order of magnitude, not a measurement."""
    per_byte = 8.0 / link_bits_per_second
    return compute + float32_bytes * per_byte, compute + codec + onebit_bytes * per_byte
