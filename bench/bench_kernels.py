"""Throughput of the compression kernels against the copy bandwidth of the same device.

For each size, dtype and world size W: worker compress (as the collective runs it, and the
standalone form that also updates the error), server reduce (fed W received chunks of
N/W), decompress (with the deferred worker error update, as the collective runs it), and
the whole local compute of one compressed_allreduce on one rank (the three kernels with
preallocated outputs) and on all W ranks of a group (``local_compressed_allreduce``, which
allocates its messages as the collective does), next to the reference
implementation's chain of torch operations for the same compute (bench/reference_path.py;
it works in place on its input, like the reference). On CUDA, the peak memory one call
allocates beyond its inputs and buffers (transient_bytes) too. "bytes" is the fewest a
kernel must read and write (an implementation that re-reads moves more); GB/s is bytes /
median time, next to a float32 copy of N elements (read + write) timed in the same run.

  python bench/bench_kernels.py                      # CUDA if present, else CPU
  python bench/bench_kernels.py --device cpu --log2 16 20 24 --csv bench/out/kernels-cpu.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from onebit.collectives import local_compressed_allreduce
from onebit.kernels import Layout, decompress, message_scales, server_reduce, worker_compress
from onebit.kernels.layout import empty_message, padded_numel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, timer, write_csv  # noqa: E402
from reference_path import reference_local  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cases(n: int, W: int, dtype: torch.dtype, device: torch.device, block: int | None = None):
    """(name, fn, bytes moved) for each kernel on fresh buffers (``block``: block scales; the
    bytes then leave out the scales, 4 / block B per element)."""
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    C, bx = N // W, torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device).to(dtype)
    out = x.clone()
    we = torch.randn(N, generator=g, device=device) * 0.1
    se = torch.randn(C, generator=g, device=device) * 0.1
    msg = empty_message(layout, W, device)
    worker_compress(x, we.clone(), W, out=msg, block=block)
    recv = torch.randint(0, 256, (layout.message_bytes,), dtype=torch.uint8, generator=g, device=device)
    sc = message_scales(recv, layout)
    sc.copy_(torch.rand(sc.shape, generator=g, device=device) + 0.5)
    seg = empty_message(layout, 1, device)
    gathered = recv.clone()

    def local():  # one rank's whole compute: worker, its server chunk, decompress
        worker_compress(out, we, W, update_error=False, out=msg, block=block)
        server_reduce(recv, se, W, out=seg, block=block)
        decompress(gathered, out, W, worker_error=we, worker_message=msg, block=block)

    # The fewest bytes each kernel must move (read + write), whatever the implementation:
    b_worker = n * bx + 4 * N + N // 8  # read x, e; write the bits
    b_server = N // 8 + 8 * C + C // 8  # read W chunks of bits and e; write e and the bits
    b_decomp = N // 8 + 2 * n * bx + 8 * N  # read bits, x, e; write e and the result
    src = torch.randn(N, generator=g, device=device)
    dst = torch.empty_like(src)
    ref_we, ref_se = we.clone(), se.clone()
    group_x = [x.clone() for _ in range(W)]  # the W ranks of one group, in this process
    group_we, group_se = [we.clone() for _ in range(W)], [se.clone() for _ in range(W)]
    return [
        ("copy_f32", lambda: dst.copy_(src), 8 * N),
        ("worker", lambda: worker_compress(x, we, W, update_error=False, out=msg, block=block), b_worker),
        ("worker+update", lambda: worker_compress(x, we, W, out=msg, block=block), b_worker + 4 * N),
        ("server", lambda: server_reduce(recv, se, W, out=seg, block=block), b_server),
        ("decompress+update", lambda: decompress(gathered, out, W, worker_error=we, worker_message=msg,
                                                 block=block), b_decomp),
        ("local_total", local, b_worker + b_server + b_decomp),
        # every rank's compute of one call, as onebit.collectives.local_compressed_allreduce
        # runs it (allocating its messages like the collective): W times one rank's bytes
        ("local_allreduce_all_ranks",
         lambda: local_compressed_allreduce(group_x, group_we, group_se, block=block),
         W * (b_worker + b_server + b_decomp)),
        # the reference implementation's chain of torch operations (bench/reference_path.py)
        ("reference_local", lambda: reference_local(x, ref_we, ref_se, W), b_worker + b_server + b_decomp),
    ][: None if block is None else -1]  # the reference has no block scales


def transient_bytes(fn, device: torch.device) -> int | None:
    """Peak bytes allocated during one call beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log2", type=int, nargs="+", default=None, help="sizes as powers of two")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--block", type=int, default=None, help="block scales (default: one scale per chunk)")
    p.add_argument("--csv", default=None, help="output CSV (default bench/out/kernels-<device>.csv)")
    args = p.parse_args()
    device = torch.device(args.device)
    sizes = args.log2 or (list(range(20, 29, 2)) if device.type == "cuda" else [16, 20, 22, 24])
    path = args.csv or os.path.join(os.path.dirname(__file__), "out", f"kernels-{device.type}.csv")
    meta = provenance(device)
    time_fn = timer(device, args.repeats)
    if os.path.exists(path):
        os.unlink(path)  # rows are appended as they come: a run cut short keeps what it measured
    print(" | ".join(f"{k}={v}" for k, v in meta.items()), file=sys.stderr)
    for k in sizes:
        for dname in args.dtypes:
            for W in args.worlds:
                copy_gbps = None
                N = padded_numel(1 << k, W)
                for name, fn, nbytes in cases(1 << k, W, DTYPES[dname], device, args.block):
                    med, lo, hi = time_fn(fn)
                    whole = name in ("local_total", "reference_local")
                    extra = transient_bytes(fn, device) if whole else None
                    gbps = nbytes / med / 1e6
                    copy_gbps = gbps if name == "copy_f32" else copy_gbps
                    row = {**meta, "kernel": name, "dtype": dname, "W": W, "log2_n": k,
                           "ms_median": f"{med:.4f}", "ms_p20": f"{lo:.4f}", "ms_p80": f"{hi:.4f}",
                           "bytes": nbytes, "gb_per_s": f"{gbps:.2f}",
                           "copy_gb_per_s": f"{copy_gbps:.2f}",
                           "fraction_of_copy": f"{gbps / copy_gbps:.3f}",
                           "transient_bytes": "" if extra is None else extra,
                           "transient_per_N": "" if extra is None else f"{extra / N:.3f}"}
                    write_csv(path, [row], append=True)
                    mem = "" if extra is None else f", transient {extra / N:.3f} x N bytes"
                    print(f"2^{k:<2} {dname:8} W={W:<2} {name:18} {med:9.3f} ms {gbps:8.1f} GB/s "
                          f"({gbps / copy_gbps:5.2f} of copy){mem}", file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()
