"""frozen_pre_ + post over one bucket of 4 parameters (16.8M float32), d from AdamW's exp_avg_sq
(Denominators), the route beside the codec (a mesh's): median of 15 timed calls."""
import statistics
import time

import torch

from onebit.collectives._frozen_adam import Denominators, FrozenAdam, frozen_pre_

torch.manual_seed(0)
torch.set_num_threads(2)
shapes = [(2048, 2048)] * 4
n = sum(a * b for a, b in shapes)
buffer = torch.randn(n)
fa = FrozenAdam(1, 0.1)
spans, parts, lo = [], [], 0
for a, b in shapes:
    hi = lo + a * b
    v = torch.rand(a * b) * 1e-4
    name = (0, len(spans))
    fa.scalars[name] = (1e-3, 1.0 - 0.999 ** 5, 1e-8)
    spans.append((lo, hi, ("v", v, fa._c_scalars(name), name)))
    parts.append((lo, hi, torch.randn(a * b), 9.0))
    lo = hi
times = []
for i in range(20):
    d = Denominators(fa, n, "cpu", spans)
    t0 = time.perf_counter()
    post = frozen_pre_(buffer, d, parts, fa)
    post(buffer)
    if i >= 5:
        times.append(time.perf_counter() - t0)
print(f"{statistics.median(times) * 1e3:.1f} ms")
