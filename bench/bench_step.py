"""End-to-end training step time on emulated links: Adam against OnebitAdam on the demo's task.

Each link speed gets a network namespace of its own with a shaped loopback (as in
bench_allreduce.py); examples/train_lm.py runs inside it for each optimizer. Reported per
link: the median step time of Adam (full-precision gradient all-reduce every step), the share
of Adam's step spent in optimizer.step() (the all-reduce plus a small update: an upper bound
on its communication share), and the median step time of OnebitAdam's compression stage.

  python bench/bench_step.py --links 100mbit 1gbit 10gbit none --steps 40

--overlap: OnebitAdam's compression stage with and without overlap=True (momentum buckets of
--bucket-cap-mb, each all-reduced from backward as soon as its gradients are in), per link.
The link's cost is what it adds to the synchronous step over the unshaped loopback
(sync(link) - sync(none)); the share hidden is (sync(link) - overlap(link)) / that cost.

  python bench/bench_step.py --overlap --ranks 2 --links 10mbit 100mbit none --steps 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_allreduce import DEFAULT_LINKS, LINKS, Namespace, can_shape  # noqa: E402


def run(link: str, optimizer: str, args, extra: tuple[str, ...] = ()) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as fh:
        log = fh.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           os.path.join(os.path.dirname(HERE), "examples", "train_lm.py"), "--optimizer", optimizer,
           "--steps", str(args.steps), "--freeze-step", str(args.freeze_step), "--log-jsonl", log,
           "--eval-batches", "1", *extra]
    ns = Namespace(LINKS[link]) if can_shape() is None else None
    try:
        out = subprocess.run((ns.prefix() if ns else []) + ["env", "OMP_NUM_THREADS=1", *cmd],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{link} {optimizer} failed:\n{out.stderr[-3000:]}")
        lines = [json.loads(line) for line in open(log)]
        rows = [row for row in lines if "step" in row]  # not the final stats
        skipped = lines[-1].get("stats", {}).get("skipped_steps", 0) if lines else 0
        if skipped or not all(math.isfinite(r["train_loss"]) for r in rows):
            # a skipped step sends no compressed all-reduce: its time would be a false speed-up
            raise RuntimeError(f"{link} {optimizer} {' '.join(extra)}: training went non-finite "
                               f"({skipped} skipped steps); its step times are not comparable (a later "
                               "--freeze-step or a lower --lr)")
    finally:
        if ns:
            ns.close()
        os.unlink(log)
    return rows[args.skip:]  # the first steps warm up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", nargs="+", default=DEFAULT_LINKS, choices=list(LINKS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--freeze-step", type=int, default=10)
    p.add_argument("--skip", type=int, default=3, help="leading steps left out of the medians")
    p.add_argument("--overlap", action="store_true", help="OnebitAdam with and without overlap=True")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="with --overlap: momentum bucket size")
    args = p.parse_args()
    reason = can_shape()
    links = args.links if reason is None else ["none"]
    if reason:
        print(f"cannot emulate links ({reason}): running unshaped only", file=sys.stderr)
    print(f"# {datetime.date.today()}, {args.ranks} gloo ranks, {args.steps} steps, "
          f"freeze at {args.freeze_step}")
    if args.overlap:
        overlap_table(links, args)
        return
    print("| link | Adam ms/step | share of Adam's step in optimizer.step() | OnebitAdam 1-bit ms/step "
          "| speedup |")
    print("|---|---|---|---|---|")
    for link in links:
        adam = run(link, "adam", args)
        onebit = [r for r in run(link, "onebit_adam", args) if r["stage"] == "compressed"]
        a = statistics.median(r["step_seconds"] for r in adam)
        share = statistics.median(r["opt_seconds"] / r["step_seconds"] for r in adam)
        o = statistics.median(r["step_seconds"] for r in onebit)
        print(f"| {link} | {1e3 * a:.1f} | {100 * share:.0f}% | {1e3 * o:.1f} | {a / o:.2f}x |", flush=True)


def overlap_table(links: list[str], args) -> None:
    cap = ("--bucket-cap-mb", str(args.bucket_cap_mb))
    order = ["none"] + [x for x in links if x != "none"]  # the unshaped step first: the links' cost needs it
    print(f"OnebitAdam compression stage, momentum buckets of {args.bucket_cap_mb} MB")
    print("| link | sync ms/step | overlap ms/step | link's cost ms | hidden ms | share of the link's cost "
          "hidden |")
    print("|---|---|---|---|---|---|")
    base = None
    for link in order:
        times = {}
        for mode, extra in (("sync", cap), ("overlap", (*cap, "--overlap"))):
            rows = [r for r in run(link, "onebit_adam", args, extra) if r["stage"] == "compressed"]
            times[mode] = statistics.median(r["step_seconds"] for r in rows)
        if link == "none":
            base = times["sync"]
        cost, hidden = times["sync"] - base, times["sync"] - times["overlap"]
        share = f"{100 * hidden / cost:.0f}%" if link != "none" and cost > 0 else "-"
        print(f"| {link} | {1e3 * times['sync']:.1f} | {1e3 * times['overlap']:.1f} | {1e3 * cost:.1f} | "
              f"{1e3 * hidden:.1f} | {share} |", flush=True)


if __name__ == "__main__":
    main()
