"""What the DDP hook's momentum bases cost (docs/ALGORITHMS.md 8.4; issue 59), per matrix shape, against
Muon's own Newton-Schulz step on the same matrix: the bases (a full SVD of the momentum, made every
``MOMENTUM_BASES_EVERY`` iterations), the turn before the collective (``(U^T G V) / w``) and the turn
after (``U (A w) V^T``), the weights ``w`` made from the singular values at each, as the hook does
(collectives/_bases.py), and the bases' memory against the matrix's. Medians (bench/_common.py's
``timer``: triton's do_bench on a GPU, else ``--repeats`` wall-clock calls after one untimed).

  python bench/bench_bases.py --device cuda --shapes 1024x1024 4096x4096 4096x11008
  python bench/bench_bases.py --device cpu --shapes 128x512 512x512
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from onebit.collectives import _bases
from onebit.collectives.ddp_hook import MOMENTUM_BASES_EVERY

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import timer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=["1024x1024", "4096x4096", "4096x11008"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    time = timer(device, args.repeats)
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
        u, vh, sv = _bases.bases_of(m)  # (as the hook makes them)
        svd = time(lambda m=m: _bases.bases_of(m))[0]

        def both(u=u, vh=vh, sv=sv, grad=grad):  # the hook's turn and turn back, its weights made at each
            w = _bases.weights(grad.shape, sv)
            sent = (u.T @ grad @ vh.T).div_(w)
            return u @ (sent * _bases.weights(grad.shape, sv)) @ vh

        turn = time(both)[0]
        ns = time(lambda grad=grad: _muon._zeropower_via_newtonschulz(grad, abc, _muon.DEFAULT_NS_STEPS,
                                                                     _muon.EPS))[0]
        print(f"| {a}x{b} | {svd:.1f} | {svd / MOMENTUM_BASES_EVERY:.2f} | {turn:.2f} "
              f"| {ns:.2f} | {(a * a + b * b) / (a * b):.2f} |", flush=True)


if __name__ == "__main__":
    main()
