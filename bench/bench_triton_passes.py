"""The GPU's fused Triton passes around the collectives against the plain torch ops they replace.

- ``hook``: the DDP hook's ``freeze_step`` pre-pass (the local norm and ``(g + k m) / d``) and
  post-pass (``out d - k m``) over one bucket of ``--params`` parameters (onebit.kernels.fused.hook)
  against ``frozen_pre_``'s GPU route (a bucket of ``k m``, ``add_``, ``div_``; ``mul_``, ``sub_``).
- ``zoa_local``: ZeroOneAdam's phase-2 local step as one launch over every parameter
  (onebit.kernels.fused.zero_one.local_step) against its multi-tensor ops (optimizers/_multi.py).

2^--log2 elements in all; medians of --repeats calls (CUDA synchronised around each), the bytes per
element each path moves (bench/TRAFFIC.md sections 4 and 5) and the rate. On a CPU it runs the
kernels under the Triton interpreter (``TRITON_INTERPRET=1``, set here) as a smoke run: its times
say nothing.

  python bench/bench_triton_passes.py                    # CUDA: 2^24 elements, 16 parameters
  python bench/bench_triton_passes.py --device cpu --log2 12 --repeats 2   # the smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from onebit.kernels.backends import use_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, wall_ms, write_csv  # noqa: E402

BYTES = {"hook_plain": 76, "hook_triton": 32, "zoa_local_plain": 56, "zoa_local_triton": 24}


def sizes(n: int, k: int) -> list[int]:
    """k parameter sizes summing to n, unequal and not multiples of 16."""
    base = [n // k + (3 if i % 2 else -3) for i in range(k - 1)]
    return [*base, n - sum(base)]


def hook(n: int, k: int, device, triton: bool):
    from onebit.collectives._frozen_adam import FrozenAdam, frozen_pre_

    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(n, generator=g).to(device)
    d = (torch.rand(n, generator=g) + 0.5).to(device)
    parts, lo = [], 0
    for s in sizes(n, k):
        parts.append((lo, lo + s, torch.randn(s, generator=g).to(device), 9.0))
        lo += s
    fa = FrozenAdam(1, 0.1)

    @torch.no_grad()
    def run():
        with use_backend("triton" if triton else "plain", steps=["hook", "tensor"]):
            frozen_pre_(buffer, d, parts, fa)(buffer)
        fa.local_sq = None

    return run


def zoa_local(n: int, k: int, device, triton: bool):
    from onebit.optimizers import ZeroOneAdam, _fused

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in sizes(n, k)]
    opt = ZeroOneAdam(params, lr=1e-3, weight_decay=0.01)
    pairs = [(p, opt.param_groups[0]) for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.state[p]["exp_avg"] = torch.randn(p.shape, generator=g).to(device) * 0.1
        opt.state[p]["exp_avg_sq"] = torch.rand(p.shape, generator=g).to(device)
    masks = [None] * len(params)
    plan = _fused.LocalStep()

    @torch.no_grad()
    def run():
        if triton:
            with use_backend("triton", steps=["local"]):
                assert _fused.local_applies(opt, pairs, masks)
                plan.step(opt, pairs)
        elif not opt._local_step_all(pairs, masks):  # the multi-tensor ops on a GPU; per tensor on CPU
            opt._local_step_each(pairs, masks)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log2", type=int, default=24)
    p.add_argument("--params", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "triton_passes.csv"))
    args = p.parse_args()
    device = torch.device(args.device)
    n = 1 << args.log2
    meta, rows = provenance(device), []
    for name, make in (("hook", hook), ("zoa_local", zoa_local)):
        for triton in (False, True):
            run = make(n, args.params, device, triton)
            for _ in range(2):
                run()
            ms = statistics.median(wall_ms(run, device) for _ in range(args.repeats))
            path = f"{name}_{'triton' if triton else 'plain'}"
            rate = BYTES[path] * n / ms / 1e6
            print(f"{path:18} 2^{args.log2} elements, {args.params} tensors: {ms:8.3f} ms, "
                  f"{BYTES[path]} B/elem, {rate:7.1f} GB/s", file=sys.stderr)
            row = {"path": path, "elements": n, "tensors": args.params, "ms_median": f"{ms:.4f}"}
            rows.append({**meta, **row, "bytes_per_element": BYTES[path], "gb_per_s": f"{rate:.1f}"})
    print(write_csv(args.csv, rows, append=True))


if __name__ == "__main__":
    main()
