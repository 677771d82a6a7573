"""ZeroOneAdam's phase 2 with its state at rest after each sync (the default) against held, in time.

W gloo ranks (torchrun, one thread each) train the same parameters (``--tensors`` tensors of 2500 x
1000) with two ZeroOneAdam instances past the variance freeze, a sync every step (the local-step
interval's first 32678 steps), one at rest (the ``message`` route, the default: the momentum kept as
the sync's messages, ``sync_params`` as p) and one holding the state (``use_routes(message=False)``),
their steps interleaved; prints the median step, the wake's share (the momentum and sync_params made
again) and the bytes per parameter (docs/ALGORITHMS.md 6.4, issue 56).

  python bench/bench_zoa_rest.py --ranks 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import child_arguments, rank0_result, ranks_json, run_child  # noqa: E402


def child(args) -> None:
    from onebit import ZeroOneAdam
    from onebit.kernels.backends import use_routes
    from onebit.memory import bytes_per_parameter

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    runs = {}
    for keep in (True, False):
        params = [torch.nn.Parameter(torch.randn(2500, 1000)) for _ in range(args.tensors)]
        runs[keep] = (params, ZeroOneAdam(params, lr=1e-3, var_freeze_step=3, var_update_scaler=1))
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = [torch.randn(2500, 1000, generator=g) for _ in range(args.tensors)]
    times = {True: [], False: []}
    wake = []
    for step in range(args.steps):
        for keep, (params, opt) in runs.items():
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            dist.barrier()
            with use_routes(message=keep):
                start = time.perf_counter()
                opt._wake()  # what the step does first (nothing where the state is held)
                woke = time.perf_counter()
                opt.step()
            if step >= 6:  # past the freeze (3) and the first syncs
                times[keep].append(time.perf_counter() - start)
                if keep:
                    wake.append(woke - start)
    out = {f"{'rest' if keep else 'held'}_ms": 1e3 * statistics.median(t) for keep, t in times.items()}
    out["wake_ms"] = 1e3 * statistics.median(wake)
    for keep, (_, opt) in runs.items():
        out[f"{'rest' if keep else 'held'}_bytes"] = bytes_per_parameter(opt)
    rank0_result(args.out, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    res = ranks_json(__file__, args.ranks, ["--tensors", str(args.tensors), "--steps", str(args.steps)])
    n = args.tensors * 2_500_000
    print(f"# ZeroOneAdam phase 2, a sync every step, {args.ranks} gloo ranks, {n / 1e6:.0f}M parameters")
    print(f"at rest: {res['rest_ms']:.1f} ms/step (the wake {res['wake_ms']:.1f}), "
          f"{res['rest_bytes']:.2f} B/param")
    print(f"held:    {res['held_ms']:.1f} ms/step, {res['held_bytes']:.2f} B/param")


if __name__ == "__main__":
    main()
