"""compressed_allreduce across local ranks: accuracy with error feedback, speed, bytes.

Run through torchrun (scripts/demo.sh does): gloo on CPU, NCCL when every rank has a GPU.
Each rank holds a fixed "gradient"; the demo compares one 1-bit all-reduce and the running
mean of many against the exact mean, then times both collectives on the same tensor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from onebit import finish
from onebit.collectives import compressed_allreduce, padded_numel


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() over ``repeats`` runs, all ranks started together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements per tensor")
    parser.add_argument("--calls", type=int, default=100, help="chained calls for accuracy")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    torch.manual_seed(1234 + rank)
    n = args.numel
    grad = (torch.randn(n) * 0.01 + 0.002 * rank).to(device)
    exact = grad.clone()
    dist.all_reduce(exact)
    exact /= W

    N = padded_numel(n, W)
    worker_error = torch.zeros(N, device=device)
    server_error = torch.zeros(N // W, device=device)
    running = torch.zeros(n, dtype=torch.float64, device=device)
    first_err = None
    for t in range(1, args.calls + 1):
        y = grad.clone()
        compressed_allreduce(y, worker_error, server_error, check=(t == 1))
        running += y
        if t == 1:
            first_err = float((y - exact).norm() / exact.norm())
    mean_err = float((running / args.calls - exact).norm() / exact.norm())

    y = grad.clone()
    t_onebit = _timed(lambda: compressed_allreduce(y, worker_error, server_error), args.repeats, device)
    z = grad.clone()
    t_fp32 = _timed(lambda: dist.all_reduce(z), args.repeats, device)

    onebit_bytes = 2 * (W - 1) / W * (N / 8 + 4 * W)
    fp32_bytes = 2 * (W - 1) / W * 4 * n
    if rank == 0:
        print(f"onebit demo: {W} ranks, backend {dist.get_backend()}, {n} float32 elements")
        print(f"  one call, relative error vs exact mean:          {first_err:.3f}")
        print(f"  mean of {args.calls} calls (error feedback) rel. error: {mean_err:.4f}")
        print(f"  compressed_allreduce median time: {t_onebit * 1e3:8.2f} ms")
        print(f"  dist.all_reduce float32 median:   {t_fp32 * 1e3:8.2f} ms  (unshaped local link)")
        print(f"  bytes sent per rank: {onebit_bytes / 1e6:.2f} MB vs {fp32_bytes / 1e6:.2f} MB "
              f"for a float32 ring all-reduce ({fp32_bytes / onebit_bytes:.1f}x fewer)")
    finish()


if __name__ == "__main__":
    main()
