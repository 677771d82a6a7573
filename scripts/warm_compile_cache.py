"""Build onebit's compiled CPU passes once, into torch.compile's on-disk cache, before the tests.

The compiled codec (onebit.kernels.cpu_compiled) and the fused optimizer passes
(onebit.kernels.cpu_fused) are built by torch.compile in every process that first uses them.
With inductor's cache empty (a fresh machine) each build generates and compiles C++: about 25 s
of one core for all of them, paid by every rank of every test that starts at once. Built here
first, every later process finds them in the cache (inductor's FX graph cache and AOTAutograd
cache, by default in the system's temporary folder) and only traces: about 1 s. The calls go
through the library's own entry points at a size no two of whose lengths are equal (sizes are
dynamic; see tests/test_cpu_fused.py, which counts the graphs), and the C sign-packing passes
(onebit.kernels.cpu_simd: one compiler run, cached likewise). Prints what it built and the
time; exits 0 where no compiler exists (the library then warns and runs the plain ops).

  python scripts/warm_compile_cache.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

from onebit.kernels import cpu_compiled, cpu_fused, cpu_simd
from onebit.kernels.layout import Layout, empty_message


@torch.no_grad()  # as the callers run them: the cache key includes the grad mode
def main() -> int:
    t0 = time.perf_counter()
    os.environ.pop(cpu_compiled._ENV, None)
    if not cpu_compiled.usable():
        print("no compiled CPU passes here (the library runs the plain ops)")
        return 0
    n = cpu_fused.MIN_NUMEL * 3  # 3 chunks: every piece and every fused tensor long enough
    layout, x = Layout(n, 3), torch.randn(n)
    e, out, message = torch.zeros(n), torch.empty(n), empty_message(layout, layout.W, x.device)
    cpu_compiled.worker_compress(x, e, layout, message, True)
    blocks = Layout(n, 3, 64)  # block scales (the hooks'): the 8-element sums' encode
    block_message = empty_message(blocks, 3, x.device)
    cpu_compiled.worker_compress(x, torch.zeros(n), blocks, block_message, False)
    segment = empty_message(blocks, 1, x.device)
    cpu_compiled.server_reduce(block_message, torch.zeros(blocks.C), blocks, segment)
    cpu_compiled.decompress(block_message.clone(), blocks, out, torch.zeros(n), block_message)
    cpu_compiled.decompress(message.clone(), layout, out, None, None)
    cpu_compiled.decompress(message.clone(), layout, out, torch.zeros(n), message)
    cpu_compiled.server_reduce(message, torch.zeros(layout.C), layout, empty_message(layout, 1, x.device))
    # the server unrolls its loop over the W ranks: one build per W; W = 4 with the hooks' blocks is
    # what the advisor's timed test (tests/test_advise.py) runs
    lw = Layout(cpu_fused.MIN_NUMEL * 4, 4, 64)
    received = empty_message(lw, 4, x.device)
    received.zero_()
    cpu_compiled.server_reduce(received, torch.zeros(lw.C), lw, empty_message(lw, 1, x.device))
    m, g, d = torch.zeros(n), torch.randn(n), torch.rand(n) + 0.5
    done = [cpu_fused.fold_preconditioned_(m, g, d, 0.9),
            cpu_fused.stale_update_(x, m, lr=1e-3, weight_decay=0.1, clip=1.0, bc1=0.5)]
    done += [cpu_fused.hook_pre_(g.clone(), m, d, 9.0), cpu_fused.hook_post_(g.clone(), m, d, 9.0),
             cpu_fused.frozen_adam_(x.clone(), m.clone(), g, d, torch.empty(n), beta1=0.9, decay=0.99,
                                    step=1e-3, eps=1e-8, bc2=0.1)]
    for wd in (0.0, 0.1):
        done.append(cpu_fused.stale_step_(x, m, d, lr=1e-3, weight_decay=wd, clip=1.0))
        done.append(cpu_fused.local_step_(x, m, g, d, beta1=0.9, lr=1e-3, weight_decay=wd, clip=1.0))
    assert all(done), done
    from torch._dynamo.utils import counters

    isa = f"ISA level {cpu_simd.best_isa()}" if cpu_simd.library() else "none"
    simd = f"C sign-packing passes: {isa}"
    print(f"compiled CPU passes built: {counters['stats']['unique_graphs']} graphs, "
          f"{time.perf_counter() - t0:.0f} s; {simd}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
