"""compressed_allreduce against dist.all_reduce (float32 and bf16) on emulated links.

All ranks of a configuration run inside a network namespace made for it, whose loopback is
shaped with ``tc`` (token bucket) to the link rate; every rank's traffic crosses that one
shaped device, so the rate is shared by all ranks like a single shared link. Needs root and
iproute2; without them only the unshaped configuration runs (and the output says so).

  python bench/bench_allreduce.py                                  # the full matrix
  python bench/bench_allreduce.py --worlds 4 --log2 24 --links 1gbit none

Per (link, W, size): medians over repeats of the slowest rank's time per call, speedups of
compressed_allreduce over float32 and bf16 all-reduce, the algorithm bandwidth (float32
bytes of the tensor / time) and the bytes each rank puts on the wire (counted). A call
expected to take longer than --max-seconds is not run (marked skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import child_arguments, provenance, pyplot, run_child, save_png, write_csv  # noqa: E402

LINKS = {"1mbit": 1e6, "3mbit": 3e6, "10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9,
         "none": None}
DEFAULT_LINKS = ["100mbit", "1gbit", "10gbit", "none"]  # the slower ones only when asked
OPS = ("onebit", "allreduce_fp32", "allreduce_bf16")


# --------------------------------------------------------------------------- child (one rank)
def child(args) -> None:
    import torch
    import torch.distributed as dist

    from onebit.collectives import compressed_allreduce, padded_numel, ring_allreduce_bytes, traffic

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    rows = []
    rate = LINKS[args.link]
    block = None if args.block == "none" else int(args.block)
    from onebit.collectives import _pipeline

    if args.slices:
        _pipeline.MAX_SLICES = args.slices
    for k in args.log2:
        n = 1 << k
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        N = padded_numel(n, W)
        edt = getattr(torch, args.error_dtype)
        we, se = torch.zeros(N, dtype=edt), torch.zeros(N // W, dtype=edt)
        Nb = padded_numel(n, W, block)
        web, seb = torch.zeros(Nb, dtype=edt), torch.zeros(Nb // W, dtype=edt)
        ops = {
            "onebit": lambda t, we=we, se=se: compressed_allreduce(t, we, se),
            "onebit_block": lambda t, we=web, se=seb: compressed_allreduce(t, we, se, block=block),
            "allreduce_fp32": lambda t: dist.all_reduce(t),
            "allreduce_bf16": lambda t: dist.all_reduce(t),
        }
        for op in OPS + (("onebit_block",) if block else ()):
            dtype = torch.bfloat16 if op.endswith("bf16") else torch.float32
            wire = ring_allreduce_bytes(n, W, 2 if op.endswith("bf16") else 4)
            if op.startswith("onebit"):
                traffic.reset()
                ops[op](x.clone())
                wire = traffic.compressed
            # all ranks share one shaped device: W ranks' bytes cross it
            expected = W * wire * 8 / rate if rate else 0.0
            if expected > args.max_seconds:
                rows.append(dict(op=op, W=W, log2_n=k, status=f"skipped (about {expected:.0f} s per call)",
                                 wire_bytes_per_rank=wire))
                continue
            times = []
            for rep in range(args.repeats + 1):
                t = x.to(dtype)
                dist.barrier()
                t0 = time.perf_counter()
                ops[op](t)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:  # the first call warms up
                    times.append(elapsed.item())
            med = statistics.median(times)
            rows.append(dict(op=op, W=W, log2_n=k, status="ok", seconds_median=med,
                             seconds_min=min(times), seconds_max=max(times), repeats=len(times),
                             algbw_gbps=4 * n / med / 1e9, wire_bytes_per_rank=wire))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump([{**row, "max_slices": _pipeline.MAX_SLICES} for row in rows], fh)
    dist.barrier()  # gloo aborts now and then if a peer tears down mid-collective
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent
def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def can_shape() -> str | None:
    """None if namespaces and tc are usable here, else the reason they are not."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    return None


def shapeable(links: list[str]) -> list[str]:
    """``links``, or only the unshaped one (said on stderr) where links cannot be emulated here."""
    reason = can_shape()
    if reason is None:
        return links
    print(f"cannot emulate links ({reason}): running unshaped only", file=sys.stderr)
    return ["none"]


class Namespace:
    """A network namespace of our own with loopback up, optionally rate-limited."""

    def __init__(self, rate_bps: float | None) -> None:
        self.name = f"onebit-bench-{os.getpid()}"
        _run(["ip", "netns", "add", self.name])
        self.exec(["ip", "link", "set", "lo", "up"])
        if rate_bps:
            # burst: at least one 64 KiB loopback packet; latency bounds the queue
            self.exec(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bps)}bit",
                       "burst", str(max(1 << 18, int(rate_bps / 8 / 250))), "latency", "500ms"])

    def exec(self, cmd: list[str]) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", self.name, *cmd])

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        _run(["ip", "netns", "delete", self.name], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--log2", type=int, nargs="+", default=[20, 22, 24, 26])
    p.add_argument("--links", nargs="+", default=DEFAULT_LINKS, choices=list(LINKS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=30.0)
    p.add_argument("--block", default="none", help="also time compressed_allreduce(block=B) (row "
                   "onebit_block): the hooks' default is 64")
    p.add_argument("--slices", type=int, default=None,
                   help="at most this many slices per block-scale call on CPU (onebit.collectives._pipeline."
                   "MAX_SLICES; 1: unsliced; default: the library's)")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "allreduce.csv"))
    p.add_argument("--plot", default=None, help="PNG path (default: next to the CSV)")
    p.add_argument("--error-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compressed_allreduce's error buffers (the hooks' and DiLoCo's default: bfloat16)")
    p.add_argument("--link", default="none", help=argparse.SUPPRESS)
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)

    links = shapeable(args.links)
    meta = {**provenance(None, backend="gloo"), "error_dtype": args.error_dtype}
    rows = []
    for link in links:
        for W in args.worlds:
            ns = Namespace(LINKS[link]) if can_shape() is None else None
            try:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                    out = fh.name
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(W), os.path.abspath(__file__), "--child", "--link", link, "--out", out,
                       "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds),
                       "--block", args.block, "--error-dtype", args.error_dtype,
                       *(["--slices", str(args.slices)] if args.slices else []),
                       "--log2", *map(str, args.log2)]
                env_cmd = (ns.prefix() if ns else []) + ["env", "OMP_NUM_THREADS=1", *cmd]
                t0 = time.perf_counter()
                run = subprocess.run(env_cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(f"link {link}, W={W} failed:\n{run.stderr[-3000:]}")
                for row in json.load(open(out)):
                    rows.append({**meta, "link": link, **row})
                print(f"link {link:8} W={W}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                os.unlink(out)
            finally:
                if ns:
                    ns.close()
    write(rows, args, meta)


def write(rows, args, meta) -> None:
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k not in meta, k))
    write_csv(args.csv, rows, fields=fields)
    index = {(r["link"], r["W"], r["log2_n"], r["op"]): r for r in rows}
    print("| link | W | n | onebit s | fp32 s | bf16 s | speedup vs fp32 | vs bf16 | onebit algbw GB/s | "
          "wire MB/rank onebit / fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    speedups = {}
    order = sorted(index.items(), key=lambda kv: (list(LINKS).index(kv[0][0]), *kv[0][1:]))
    for (link, W, k, op), r in order:
        if not op.startswith("onebit"):
            continue
        f32, b16 = index[(link, W, k, "allreduce_fp32")], index[(link, W, k, "allreduce_bf16")]

        def sec(x):
            return f"{x['seconds_median']:.4f}" if x["status"] == "ok" else "skipped"

        def ratio(a, b):
            if a["status"] == "ok" and b["status"] == "ok":
                return b["seconds_median"] / a["seconds_median"]
            return None

        s32, s16 = ratio(r, f32), ratio(r, b16)
        if op == "onebit":
            speedups[(link, W, k)] = s32
        algbw = f"{r['algbw_gbps']:.3f}" if r["status"] == "ok" else "-"
        x32 = "-" if s32 is None else f"{s32:.1f}x"
        x16 = "-" if s16 is None else f"{s16:.1f}x"
        size = f"2^{k}" + ("" if op == "onebit" else f", block {args.block}")
        print(f"| {link} | {W} | {size} | {sec(r)} | {sec(f32)} | {sec(b16)} | {x32} | {x16} | {algbw} | "
              f"{r['wire_bytes_per_rank'] / 1e6:.2f} / {f32['wire_bytes_per_rank'] / 1e6:.2f} |")
    plot(speedups, args)


def plot(speedups, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    path = args.plot or os.path.splitext(args.csv)[0] + ".png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(W, k) for (_, W, k) in speedups})
    for W, k in series:
        xs, ys = [], []
        for link, rate in LINKS.items():
            s = speedups.get((link, W, k))
            if rate and s:
                xs.append(rate / 1e9)
                ys.append(s)
        if xs:
            ax.plot(xs, ys, marker="o", label=f"W={W}, 2^{k}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("emulated link bandwidth (Gbit/s, shared by all ranks)")
    ax.set_ylabel("speedup of compressed_allreduce over float32 all_reduce")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
