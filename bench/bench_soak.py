"""Soak: thousands of compressed_allreduce calls with random sizes, dtypes and groups.

W gloo ranks (spawned, file rendezvous, no port) make the same random choices (a shared
seed): for each call a group (the world or one of four sub-groups, two of them odd-sized),
a size (0 to 2^17 elements, log-uniform over 48 fixed sizes, so error buffers are reused
like an optimizer reuses them), a dtype, now and then ``check=True``, and now and then a NaN
injected on one member (the output must then be NaN on every member and the errors
unchanged). Checked: every call's output is bitwise identical on all members (fingerprints
compared at the end), the resident set size after warm-up stays within a bound, and the
numbers of threads and process groups are the same after the calls as before them.

  python bench/bench_soak.py --calls 2000 --world-size 4 --json bench/results/soak.json

Exit status 1 when a check fails. tests/test_soak.py runs a shorter soak through this script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import threading
import time

WARMUP = 100  # calls before the memory baseline is taken


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(rank: int, args, init_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from onebit.collectives import compressed_allreduce, fingerprints, padded_numel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=120))
    W = args.world_size
    pg_map = dist.distributed_c10d._world.pg_map
    members = [list(range(W)), [0, 1], list(range(1, W)), list(range(0, W, 2)), [W - 1, 0, 1]]
    members = [sorted(set(m)) for m in members if len(set(m)) >= 1]
    groups = [None] + [dist.new_group(m) for m in members[1:]]
    groups_before, threads_before = len(pg_map), _threads()
    rng = random.Random(args.seed)  # the same choices on every rank
    sizes = sorted({0, 1, 7, 8} | {int(2 ** rng.uniform(0, 17)) for _ in range(44)})
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    errors: dict = {}  # allocated up front, so that memory growth would be a leak, not state
    for gi, m in enumerate(members):
        if rank in m:
            for n in sizes:
                N = padded_numel(n, len(m))
                errors[(gi, N)] = (torch.zeros(N), torch.zeros(N // len(m)))
    prints, nan_calls, rss = [], 0, []
    t0 = time.perf_counter()
    for call in range(args.calls):
        gi = rng.randrange(len(groups))
        n, dtype = rng.choice(sizes), rng.choice(dtypes)
        check = rng.random() < 0.05
        poison = rng.random() < 0.02
        poison_rank = rng.choice(members[gi])
        data_seed = rng.randrange(2**31)
        if call == WARMUP or call % 50 == 0 or call == args.calls - 1:
            rss.append((call, _rss_mb()))
        if rank not in members[gi]:
            prints.append(None)
            continue
        Wg = len(members[gi])
        we, se = errors[(gi, padded_numel(n, Wg))]
        g = torch.Generator().manual_seed(data_seed + rank)
        x = torch.randn(n, generator=g).to(dtype)
        if poison and rank == poison_rank and n:
            x[n // 2] = float("nan")
            saved = (we.clone(), se.clone())
        compressed_allreduce(x, we, se, groups[gi], check=check)
        if poison and n and Wg > 1:
            nan_calls += 1
            if not bool(torch.isnan(x).all()):
                raise AssertionError(f"call {call}: a NaN input did not give NaN everywhere")
            if rank == poison_rank and not (torch.equal(we, saved[0]) and torch.equal(se, saved[1])):
                raise AssertionError(f"call {call}: a NaN input changed the error buffers")
        elif not bool(torch.isfinite(x).all()):
            raise AssertionError(f"call {call}: non-finite output from finite inputs")
        prints.append(fingerprints([x])[0].tolist())
    seconds = time.perf_counter() - t0
    groups_after, threads_after = len(pg_map), _threads()
    dist.barrier()
    for grp in groups[1:]:
        dist.destroy_process_group(grp)
    result = {
        "rank": rank, "prints": prints, "rss": rss, "seconds": seconds, "nan_calls": nan_calls,
        "groups_before": groups_before, "groups_after_calls": groups_after,
        "threads_before": threads_before, "threads_after": threads_after,
        "python_threads": threading.active_count(),
        "calls_here": sum(p is not None for p in prints),
    }
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mb", type=float, default=16.0,
                   help="allowed growth of each rank's resident set after the warm-up calls")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args()
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="onebit-soak-")
    out = os.path.join(tmp, "result")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, args, os.path.join(tmp, "rendezvous"), out))
             for r in range(args.world_size)]
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    wall = time.perf_counter() - t0
    if any(proc.exitcode != 0 for proc in procs):
        print(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
        return 1
    results = []
    for r in range(args.world_size):
        with open(f"{out}.{r}") as fh:
            results.append(json.load(fh))
    mismatches = 0
    for call in range(args.calls):
        seen = {json.dumps(res["prints"][call]) for res in results if res["prints"][call] is not None}
        mismatches += len(seen) > 1
    growth = [max(mb for c, mb in res["rss"] if c >= WARMUP) - next(mb for c, mb in res["rss"] if c >= WARMUP)
              for res in results]
    summary = {
        "calls": args.calls, "world_size": args.world_size, "seed": args.seed, "wall_seconds": round(wall, 1),
        "calls_per_rank": [res["calls_here"] for res in results],
        "nan_calls_per_rank": [res["nan_calls"] for res in results],
        "mismatched_calls": mismatches,
        "rss_mb_after_warmup": [round(next(mb for c, mb in res["rss"] if c >= WARMUP), 1) for res in results],
        "rss_growth_mb": [round(g, 2) for g in growth], "rss_bound_mb": args.rss_bound_mb,
        "rss_trace_rank0": [[c, round(mb, 1)] for c, mb in results[0]["rss"]
                            if c % 1000 == 0 or c in (WARMUP, args.calls - 1)],
        "threads_before_after": [[res["threads_before"], res["threads_after"]] for res in results],
        "process_groups_before_after": [[res["groups_before"], res["groups_after_calls"]] for res in results],
    }
    ok = (
        mismatches == 0
        and max(growth) <= args.rss_bound_mb
        and all(a == b for a, b in summary["threads_before_after"])
        and all(a == b for a, b in summary["process_groups_before_after"])
    )
    summary["ok"] = ok
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
