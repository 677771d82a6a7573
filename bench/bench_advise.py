"""Validate ``python -m onebit.advise`` on emulated links: its predicted speedup against an
independent timing of ``dist.all_reduce`` and ``compressed_allreduce`` on the same link.

For each link, a network namespace of its own whose loopback is shaped with ``tc`` (as in
bench_allreduce.py: every rank's traffic crosses the one shaped device); inside it, first the
advisor (``torchrun -m onebit.advise --params P --json``), then this file's ``--child``: P
float32 elements, one warm-up and ``--repeats`` timed calls of each, median of the slowest
rank. Needs root and iproute2 (else only the unshaped loopback runs, and the output says so).

  python bench/bench_advise.py                                   # 100mbit, 1gbit, none; W=4, P=2^22
  python bench/bench_advise.py --links 1gbit --params 1048576 --world 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import child_arguments, run_child, slowest_rank_times  # noqa: E402
from bench_allreduce import LINKS, Namespace, can_shape, shapeable  # noqa: E402

TOLERANCE = 0.35  # the acceptance: predicted within 35% of measured


def child(args) -> None:
    """One rank of the independent timing: float32 all_reduce and compressed_allreduce of P."""
    import torch
    import torch.distributed as dist

    from onebit.collectives import compressed_allreduce, padded_numel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    W, rank = dist.get_world_size(), dist.get_rank()
    block = None if args.block == "none" else int(args.block)
    x = torch.randn(args.params, generator=torch.Generator().manual_seed(rank))
    N = padded_numel(args.params, W, block)
    we, se = torch.zeros(N), torch.zeros(N // W)
    out = {}
    for name, fn in (("float32", lambda: dist.all_reduce(x.clone())),
                     ("onebit", lambda: compressed_allreduce(x.clone(), we, se, block=block))):
        out[name] = statistics.median(slowest_rank_times(fn, args.repeats))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(W: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(W), *argv]


def validate(link: str, W: int, params: int, block: str, repeats: int, shaped: bool,
             advisor_args: tuple[str, ...] = ()) -> dict:
    """Advisor and independent timing on one emulated link; the comparison as a dict."""
    ns = Namespace(LINKS[link]) if shaped and LINKS[link] else None
    prefix = (ns.prefix() if ns else []) + ["env", "OMP_NUM_THREADS=1"]
    try:
        t0 = time.perf_counter()
        run = subprocess.run(prefix + _torchrun(W, "-m", "onebit.advise", "--params", str(params), "--json",
                                                "--quiet", "--block", block, *advisor_args),
                             capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"advisor on {link} failed ({run.returncode}):\n{run.stderr[-3000:]}")
        advice = json.loads(run.stdout.strip().splitlines()[-1])
        advisor_seconds = time.perf_counter() - t0
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            path = fh.name
        cmd = _torchrun(W, os.path.abspath(__file__), "--child", "--params", str(params), "--block", block,
                        "--repeats", str(repeats), "--out", path)
        run = subprocess.run(prefix + cmd, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"independent timing on {link} failed:\n{run.stderr[-3000:]}")
        measured = json.load(open(path))
        os.unlink(path)
    finally:
        if ns:
            ns.close()
    speedup = measured["float32"] / measured["onebit"]
    predicted = advice["predicted_speedup"]
    expected_verdict = "compress" if speedup > 1.1 else "do not compress" if speedup < 0.9 else None
    return {
        "link": link, "W": W, "params": params, "block": block,
        "predicted_speedup": predicted, "measured_speedup": speedup,
        "relative_error": abs(predicted - speedup) / speedup,
        "float32_s": measured["float32"], "onebit_s": measured["onebit"],
        "predicted_float32_s": advice["predicted"]["float32_s"],
        "predicted_onebit_s": advice["predicted"]["onebit_s"],
        "measured_at_params": advice["measured_at_params"], "model_speedup": advice["model_speedup"],
        "model_error": abs(advice["model_speedup"] - speedup) / speedup,
        "verdict": advice["verdict"], "verdict_ok": expected_verdict in (None, advice["verdict"]),
        "reason": advice["reason"], "advisor_seconds": advisor_seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", nargs="+", default=["100mbit", "1gbit", "none"], choices=list(LINKS))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--params", type=int, default=1 << 22)
    p.add_argument("--block", default="64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-seconds", default=None,
                   help="the advisor's --max-seconds (a small one makes it extrapolate P from smaller sizes)")
    p.add_argument("--json", default=None, help="also write the rows here")
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    links = shapeable(args.links)
    rows = []
    print("| link | W | P | predicted speedup | measured speedup | error | model alone (error) | float32 s "
          "(measured / predicted) | 1-bit s (measured / predicted) | verdict | advisor s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for link in links:
        extra = () if args.max_seconds is None else ("--max-seconds", args.max_seconds)
        r = validate(link, args.world, args.params, args.block, args.repeats, can_shape() is None, extra)
        rows.append(r)
        print(f"| {link} | {r['W']} | {r['params']:,} | {r['predicted_speedup']:.2f}x | "
              f"{r['measured_speedup']:.2f}x | {r['relative_error']:.0%} | {r['model_speedup']:.2f}x "
              f"({r['model_error']:.0%}) | {r['float32_s']:.3f} / "
              f"{r['predicted_float32_s']:.3f} | {r['onebit_s']:.3f} / {r['predicted_onebit_s']:.3f} | "
              f"{r['verdict']}{'' if r['verdict_ok'] else ' (WRONG)'} | {r['advisor_seconds']:.0f} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    bad = [r["link"] for r in rows if r["relative_error"] > TOLERANCE or not r["verdict_ok"]]
    if bad:
        print(f"outside the acceptance (35%, verdict): {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
