"""The C passes' message scale from the chunks' float64 sums in Python floats (onebit.kernels._chunks.rms):
bitwise what ``torch.sqrt(t / N).to(torch.float32)`` gives for a float64 tensor ``t``, on fresh random sums
over many magnitudes, zero, the smallest subnormals, float32's overflow (inf), inf and NaN."""

from __future__ import annotations

import math

import torch

from onebit.kernels._chunks import rms


def test_rms_is_bitwise_the_float64_tensor_arithmetic():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    exponents = torch.randint(-320, 320, (20000,), generator=g).to(torch.float64)
    sums = torch.rand(20000, generator=g, dtype=torch.float64) * torch.pow(10.0, exponents.clamp(max=307))
    special = torch.tensor([0.0, 5e-324, 1e-300, 3.4e48, 1.7e308, math.inf, math.nan], dtype=torch.float64)
    for N in (8, 1000, 12345, 2**26):
        for t in torch.cat([sums, special]):
            want = torch.sqrt(t / N).to(torch.float32).item()
            got = rms(t.item(), N)
            assert want == got or (math.isnan(want) and math.isnan(got)), (t.item(), N, want, got)
