"""Two emulated nodes: float32 all_reduce, the flat 1-bit all-reduce and the hierarchical one.

Two network namespaces made for the run (``onebit-hA-PID``, ``onebit-hB-PID``), each a "node"
with ``--per-node`` ranks started by its own torchrun (``--nnodes 2``); the namespaces are
joined by a veth pair whose two ends are shaped with ``tc`` (token bucket, ``--rate``), so only
traffic between the nodes crosses the shaped link; inside a node the ranks talk over the
namespace's own loopback, unshaped. ``GLOO_SOCKET_IFNAME`` points gloo at the veth address.
Bytes across the node link are counted by the kernel (the veth's transmit counters, TCP/IP
headers included) and compared with the formula (docs/ALGORITHMS.md section 9). Needs root
and iproute2; both namespaces are deleted at the end, whatever happens.

  python bench/bench_hierarchical.py --rates 1gbit 10gbit            # W = 4 as 2 x 2, 2^24
  python bench/bench_hierarchical.py --rates 1gbit --log2 22 --per-node 3
  python bench/bench_hierarchical.py --rates 100mbit 1gbit \
      --ops step_adam step_onebit_flat step_onebit_hierarchical      # a step of the demo's LM
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
from bench_allreduce import can_shape  # noqa: E402

RATES = {"10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}
OPS = ("float32", "onebit_flat", "onebit_hierarchical",
       "step_adam", "step_onebit_flat", "step_onebit_hierarchical")
STEPS = OPS[3:]  # one training step of the demo's LM (examples/train_lm.py defaults), per call


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class TwoNodes:
    """Two namespaces joined by a shaped veth pair: node A at 10.77.0.1, node B at 10.77.0.2."""

    def __init__(self, rate_bps: float) -> None:
        pid = os.getpid()
        self.ns = [f"onebit-hA-{pid}", f"onebit-hB-{pid}"]
        self.dev = [f"obA{pid % 100000}", f"obB{pid % 100000}"]
        self.addr = ["10.77.0.1", "10.77.0.2"]
        try:
            for ns in self.ns:
                _run(["ip", "netns", "add", ns])
                _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            _run(["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]])
            burst = str(max(1 << 18, int(rate_bps / 8 / 250)))
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _run(["ip", "link", "set", dev, "netns", ns])
                self.exec(ns, ["ip", "addr", "add", f"{addr}/24", "dev", dev])
                self.exec(ns, ["ip", "link", "set", dev, "up"])
                self.exec(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
                               "burst", burst, "latency", "500ms"])
        except BaseException:
            self.close()
            raise

    def exec(self, ns: str, cmd: list[str]) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", ns, *cmd])

    def tx_bytes(self) -> list[int]:
        """Bytes each node's veth end has sent so far."""
        out = []
        for ns, dev in zip(self.ns, self.dev, strict=True):
            text = self.exec(ns, ["cat", f"/sys/class/net/{dev}/statistics/tx_bytes"]).stdout
            out.append(int(text.strip()))
        return out

    def close(self) -> None:
        for ns in self.ns:
            _run(["ip", "netns", "delete", ns], check=False)


def child(args) -> None:
    """One rank: time each op (median of the slowest rank), and for the byte count run each op
    ``--count-calls`` times between two barriers while the parent reads the veth counters."""
    import torch
    import torch.distributed as dist

    from onebit.collectives import compressed_allreduce, error_buffers, node_mesh, traffic

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = node_mesh()  # torchrun's LOCAL_WORLD_SIZE: the ranks of this namespace
    n = 1 << args.log2
    block = None if args.block == "none" else int(args.block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    fw, fs = error_buffers(n, None, block=block)
    hw, hs = error_buffers(n, mesh, block=block)
    ops = {"float32": lambda: dist.all_reduce(x.clone()),
           "onebit_flat": lambda: compressed_allreduce(x.clone(), fw, fs, block=block),
           "onebit_hierarchical": lambda: compressed_allreduce(x.clone(), hw, hs, mesh, block=block)}
    if any(name in STEPS for name in args.ops):
        ops.update(_demo_steps(rank, mesh, args.ops))
    ops = {name: fn for name, fn in ops.items() if name in args.ops}
    rows = {}
    for name, fn in ops.items():
        times = slowest_rank_times(fn, args.repeats)
        traffic.reset()
        fn()
        rows[name] = {"seconds": statistics.median(times), "seconds_all": times,
                      "counted_compressed": traffic.compressed, "counted_intra": traffic.intra}
        # the byte count: the parent reads the counters between the two marker files
        _handshake(f"{args.out}.{name}", "start", rank)
        for _ in range(args.count_calls):
            fn()
        _handshake(f"{args.out}.{name}", "end", rank)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def _demo_steps(rank: int, mesh, wanted) -> dict:
    """One training step of the demo's LM (its default size: 470,528 parameters, batch 16 x 64)
    per call: Adam (a float32 gradient all-reduce), OnebitAdam flat and on the mesh, both past
    their warm-up (freeze_step 1, the first step taken here)."""
    import math

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from train_lm import GPT, TRAIN_FILES, batch, load_bytes

    from onebit.optimizers import OnebitAdam

    data = load_bytes(TRAIN_FILES)

    def make(group, freeze):
        torch.manual_seed(0)
        model = GPT(64, 128, 2, 4)
        opt = OnebitAdam(model.parameters(), lr=2e-3, betas=(0.9, 0.99), freeze_step=freeze, group=group)
        g = torch.Generator().manual_seed(rank + 1)

        def step():
            x, y = batch(data, 16, 64, g, "cpu")
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()

        step()  # the warm-up step (OnebitAdam), the first step's checks (all)
        return step

    made = {"step_adam": (None, math.inf), "step_onebit_flat": (None, 1),
            "step_onebit_hierarchical": (mesh, 1)}
    return {name: make(*made[name]) for name in STEPS if name in wanted}


def _handshake(prefix: str, what: str, rank: int) -> None:
    """Every rank stops here until the parent has read the counters: rank 0 writes
    ``prefix.what`` and waits for the parent's ``prefix.what + "ed"``."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        open(f"{prefix}.{what}", "w").close()
        while not os.path.exists(f"{prefix}.{what}ed"):
            time.sleep(0.05)
    dist.barrier()


def _wait(path: str, procs, timeout: float) -> None:
    t0 = time.time()
    while not os.path.exists(path):
        if any(p.poll() not in (None, 0) for p in procs):
            failed = [p.stderr.read()[-2000:] for p in procs if p.poll()]
            raise RuntimeError("a node's torchrun failed:\n" + "\n".join(failed))
        if time.time() - t0 > timeout:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.05)


def run_rate(rate: str, args) -> dict:
    nodes = TwoNodes(RATES[rate])
    out = tempfile.mktemp(prefix="onebit-hier-", suffix=".json")
    procs = []
    try:
        for k, (ns, dev) in enumerate(zip(nodes.ns, nodes.dev, strict=True)):
            cmd = ["ip", "netns", "exec", ns, "env", "OMP_NUM_THREADS=1", f"GLOO_SOCKET_IFNAME={dev}",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                   "--nproc-per-node", str(args.per_node), "--master-addr", nodes.addr[0],
                   "--master-port", "29533", os.path.abspath(__file__), "--child", "--out", out,
                   "--log2", str(args.log2), "--block", args.block, "--repeats", str(args.repeats),
                   "--count-calls", str(args.count_calls), "--ops", *args.ops]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        counted = {}
        for name in args.ops:
            _wait(f"{out}.{name}.start", procs, 1800)
            before = nodes.tx_bytes()
            open(f"{out}.{name}.started", "w").close()
            _wait(f"{out}.{name}.end", procs, 1800)
            after = nodes.tx_bytes()
            open(f"{out}.{name}.ended", "w").close()
            counted[name] = [(a - b) / args.count_calls for a, b in zip(after, before, strict=True)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"a node's torchrun failed:\n{p.stderr.read()[-3000:]}")
        rows = json.load(open(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        nodes.close()
        for name in OPS:
            for tail in ("start", "started", "end", "ended"):
                if os.path.exists(f"{out}.{name}.{tail}"):
                    os.unlink(f"{out}.{name}.{tail}")
        if os.path.exists(out):
            os.unlink(out)
    for name in args.ops:
        rows[name]["link_bytes_per_call"] = counted[name]  # [node A sent, node B sent]
    return rows


def formula(n: int, M: int, L: int, block) -> dict:
    """Bytes each node sends across per call (docs/ALGORITHMS.md section 9)."""
    from onebit.collectives.wire import compressed_bytes
    from onebit.kernels.layout import Layout, padded_numel

    W = M * L
    flat_seg = Layout(padded_numel(n, W, block), W, block).segment_bytes
    s = -(-n // L)
    hier_seg = Layout(padded_numel(s, M, block), M, block).segment_bytes
    ring = 2 * (W - 1) * 4 * n // W  # float32 ring all-reduce, per rank
    return {"float32": None, "step_adam": None, "step_onebit_flat": None, "step_onebit_hierarchical": None,
            "onebit_flat": L * 2 * (W - L) * flat_seg,
            "onebit_hierarchical": L * 2 * (M - 1) * hier_seg, "float32_ring_per_rank": ring,
            "hier_per_rank_counted": compressed_bytes(padded_numel(s, M, block), M, block)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], choices=list(RATES))
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--log2", type=int, default=24)
    p.add_argument("--block", default="none")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--count-calls", type=int, default=3)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS,
                   help="leave float32 out on slow links (2^24 floats take 80 s per call at 10 Mbit/s)")
    p.add_argument("--json", default=None)
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    reason = can_shape()
    if reason is not None:
        sys.exit(f"cannot emulate two nodes here ({reason})")
    n, L = 1 << args.log2, args.per_node
    block = None if args.block == "none" else int(args.block)
    f = formula(n, 2, L, block)
    results = {}
    print(f"| node link | op | s per call | speedup vs flat 1-bit | bytes across per call, node A / B "
          f"(counted) | formula | W = {2 * L} as 2 x {L}, n = 2^{args.log2}, block {args.block} |")
    print("|---|---|---|---|---|---|---|")
    for rate in args.rates:
        rows = results[rate] = run_rate(rate, args)
        flat = rows["onebit_flat"]["seconds"] if "onebit_flat" in rows else float("nan")
        for name in args.ops:
            r = rows[name]
            a, b = r["link_bytes_per_call"]
            expect = f[name]
            print(f"| {rate} | {name} | {r['seconds']:.3f} | {flat / r['seconds']:.2f}x | {a / 1e6:.2f} / "
                  f"{b / 1e6:.2f} MB | {'-' if expect is None else f'{expect / 1e6:.2f} MB'} | |", flush=True)
        across = {name: sum(rows[name]["link_bytes_per_call"]) for name in args.ops}
        pairs = (("onebit_hierarchical", "onebit_flat"), ("step_onebit_hierarchical", "step_onebit_flat"))
        for a, b in pairs:
            if a in across and b in across:
                print(f"| {rate} | {a} / {b} bytes across | | | {across[a] / across[b]:.3f} "
                      f"(1/L = {1 / L:.3f}) | | |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "formula": f, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
