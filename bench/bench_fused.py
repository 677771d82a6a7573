"""The fused CPU passes (onebit.kernels.cpu_fused) against the plain torch ops they replace.

OnebitAdam's compression-stage fold (``u = b1 u + (1-b1) g / d``, ``d`` the stale denominator
computed from the frozen variance ``v``: by the plain ops as a new tensor each call, by the C pass as
it reads ``v``) and update
(``p = p (1 - lr wd) - lr clip(u / bc1)``), ZeroOneAdam's stale step (``p -= lr (clip(m / d) +
wd p)``) and its phase-2 local step (the fold ``m = b1 m + (1-b1) g`` then that step) on one
float32 tensor of 2^k elements: median
milliseconds of --repeats calls after two warm-up calls, each path's
bytes read and written per element (bench/TRAFFIC.md), and a copy of the same size for scale.

  python bench/bench_fused.py                 # 2^22 elements
  python bench/bench_fused.py --log2 24 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from onebit.kernels import cpu_fused
from onebit.kernels.preconditioning import inverse_sqrt_bc2, stale_denominator
from onebit.optimizers._functional import fold_, fold_preconditioned_, stale_direction


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log2", type=int, default=22)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    n = 1 << args.log2
    g = torch.Generator().manual_seed(0)
    param, u = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    grad, v = torch.randn(n, generator=g), (torch.rand(n, generator=g) + 0.1) ** 2
    lr, wd, clip, bc1, b1 = 1e-5, 0.01, 1.0, 0.9, 0.9
    floor, bc2, eps = torch.tensor(0.2), 0.3, 1e-8
    den = (float(floor), inverse_sqrt_bc2(bc2), eps)

    def d():  # the plain path's stale denominator, made where it is read
        return stale_denominator(v, floor, eps, bc2)

    def plain_update():
        step = stale_direction(param, u, None, 0.0, clip, bc1)
        param.mul_(1.0 - lr * wd)
        param.add_(step, alpha=-lr)

    def fused_update():
        if not cpu_fused.stale_update_(param, u, lr=lr, weight_decay=wd, clip=clip, bc1=bc1):
            raise SystemExit("the fused update does not run here (no C library, or ONEBIT_BACKEND=plain)")

    def plain_fold():
        fold_preconditioned_(u, grad, d(), b1)

    def fused_fold():
        if not cpu_fused.fold_preconditioned_(u, grad, v, den, b1):
            raise SystemExit("the fused fold does not run here")

    m = u.clone()

    def plain_stale_step():
        param.add_(stale_direction(param, m, d(), wd, clip), alpha=-lr)

    def fused_stale_step():
        if not cpu_fused.stale_step_(param, m, v, den, lr=lr, weight_decay=wd, clip=clip):
            raise SystemExit("the fused stale step does not run here")

    def plain_local_step():
        fold_(m, grad, b1)
        plain_stale_step()

    def fused_local_step():
        if not cpu_fused.local_step_(param, m, grad, v, den, beta1=b1, lr=lr, weight_decay=wd, clip=clip):
            raise SystemExit("the fused local step does not run here")

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n = 2^{args.log2}, "
          f"median of {args.repeats}")
    print("| pass | plain ms | fused ms | speedup | B/elem plain / fused |")
    print("|---|---|---|---|---|")
    # plain "+ d": the stale denominator made from v first (a float64 square root: 7 passes)
    for name, plain, fused, traffic in (("update", plain_update, fused_update, "44 / 12"),
                                        ("fold", plain_fold, fused_fold, "24 + d / 16"),
                                        ("ZeroOneAdam stale step", plain_stale_step, fused_stale_step,
                                         "44 + d / 16"),
                                        ("ZeroOneAdam local step", plain_local_step, fused_local_step,
                                         "64 + d / 24")):
        a, b = median_ms(plain, args.repeats), median_ms(fused, args.repeats)
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {traffic} |")
    print(f"copy of the same size (8 B/elem): {median_ms(lambda: param.copy_(u), args.repeats):.2f} ms")


if __name__ == "__main__":
    main()
