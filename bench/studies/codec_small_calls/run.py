"""Whether small CPU calls should take the plain-torch codec (session 26): one rank's whole codec
compute of a W = 4 compressed all-reduce (worker_compress, server_reduce, decompress, as kernels/api.py
runs them) on n float32 elements, the native C against plain torch, medians of 15 calls after 3.

  python bench/studies/codec_small_calls/run.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from onebit.kernels.api import decompress, server_reduce, worker_compress


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    W = 4
    print(f"threads {args.threads}, W = {W}; microseconds per call (worker + server + decompress)")
    for log2 in range(8, 21, 2):
        n = 2**log2 * W
        x = torch.randn(n)
        row = []
        for backend in ("torch", "native"):
            e, se, out = torch.zeros(n), torch.zeros(n // W), torch.empty(n)

            def call():
                msg = worker_compress(x, e, W, backend=backend)  # noqa: B023
                seg = server_reduce(msg, se, W, backend=backend)  # noqa: B023
                decompress(torch.cat([seg] * W), out, W, backend=backend)  # noqa: B023

            for _ in range(3):
                call()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            row.append(statistics.median(times) * 1e6)
        print(f"n = {n:>9}: plain {row[0]:9.1f}  native {row[1]:9.1f}  plain / native {row[0] / row[1]:.2f}")


if __name__ == "__main__":
    main()
