"""What the DDP hook's momentum bases cost (docs/ALGORITHMS.md 8.4; issue 59), per matrix shape, against
Muon's own Newton-Schulz step on the same matrix: the bases (a full SVD of the momentum, made every
``MOMENTUM_BASES_EVERY`` iterations), the turn before the collective (``U^T G V``) and the turn after
(``U A V^T``), and the bases' memory against the matrix's. Median of ``--repeats`` timed calls after one
untimed, synchronised on a GPU.

  python bench/bench_bases.py --device cuda --shapes 1024x1024 4096x4096 4096x11008
  python bench/bench_bases.py --device cpu --shapes 128x512 512x512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from onebit.collectives.ddp_hook import MOMENTUM_BASES_EVERY


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=["1024x1024", "4096x4096", "4096x11008"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    from torch.optim import _muon

    abc = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, new bases every {MOMENTUM_BASES_EVERY} iterations")
    print("| shape | SVD (ms, every K) | per iteration: SVD / K (ms) | turn + turn back (ms) "
          "| Muon's NS (ms) | bases / matrix bytes |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        a, b = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(0)
        m = torch.randn(a, b, device=device, generator=g)
        grad = torch.randn(a, b, device=device, generator=g)
        u, _, vh = torch.linalg.svd(m, full_matrices=True)  # (as the hook makes them)
        svd = _timed(lambda m=m: torch.linalg.svd(m, full_matrices=True), device, args.repeats)
        turn = _timed(lambda u=u, vh=vh, grad=grad: u @ (u.T @ grad @ vh.T) @ vh, device, args.repeats)
        ns = _timed(lambda grad=grad: _muon._zeropower_via_newtonschulz(grad, abc, _muon.DEFAULT_NS_STEPS,
                                                                       _muon.EPS), device, args.repeats)
        print(f"| {a}x{b} | {svd * 1e3:.1f} | {svd * 1e3 / MOMENTUM_BASES_EVERY:.2f} | {turn * 1e3:.2f} "
              f"| {ns * 1e3:.2f} | {(a * a + b * b) / (a * b):.2f} |", flush=True)


if __name__ == "__main__":
    main()
