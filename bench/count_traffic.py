"""Count op-level memory traffic (bytes read + written per parameter element) of one optimizer
step by intercepting every aten op (TorchDispatchMode), CPU, W = 1 (the collective forced
through local_compressed_allreduce, as bench/bench_optimizer.py does).

Rule (the same as bench/TRAFFIC.md's): each op reads each distinct input tensor once and writes each
output once; views/empty allocations are free; copy_/zero_/fill_ do not read their destination;
an `out=` tensor is written, not read.
  OMP_NUM_THREADS=1 python bench/count_traffic.py            (a ~6.3M-parameter copy of the bench's shapes)
"""

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from onebit.collectives import local_compressed_allreduce  # noqa: E402
from onebit.optimizers import OnebitAdam, ZeroOneAdam  # noqa: E402

torch.set_num_threads(1)
NO_READ_SELF = {"copy_", "zero_", "fill_", "normal_", "uniform_"}


def key(t):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        rets = func._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in rets):
            return out  # a view
        if name.startswith("empty") or name in ("_local_scalar_dense", "set_", "resize_"):
            return out
        ins = [
            a
            for a in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
            if isinstance(a, torch.Tensor)
        ]
        if name in NO_READ_SELF and ins:
            ins = ins[1:]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        seen, r = set(), 0
        for t in ins:
            k = key(t)
            if k not in seen:
                seen.add(k)
                r += t.numel() * t.element_size()
        w = sum(o.numel() * o.element_size() for o in {key(o): o for o in outs}.values())
        self.bytes[name] += r + w
        self.calls[name] += 1
        return out


def forced(tensor, worker_error, server_error, group=None):
    return local_compressed_allreduce([tensor], [worker_error], [server_error])[0]


def params(d=256, blocks=8):
    shapes = []
    for _ in range(blocks):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)] + [(d,)] * 4 + [(4 * d,)]
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def measure(opt, ps, steps, label_of):
    n = sum(p.numel() for p in ps)
    rows = {}
    for t in range(1, steps + 1):
        label = label_of(t)
        if label is None:
            opt.step()
            continue
        c = Count()
        with c:
            opt.step()
        rows[label] = (sum(c.bytes.values()) / n, sum(c.calls.values()), c)
    return n, rows


def show(title, n, rows, detail=False):
    print(f"== {title} ({n / 1e6:.2f}M elements)")
    for label, (b, calls, c) in rows.items():
        print(f"  {label:40s} {b:7.2f} B/elem  {calls:5d} aten calls")
        if detail:
            for name, v in c.bytes.most_common():
                print(f"      {name:28s} {v / n:7.3f} B/elem  {c.calls[name]:4d} calls")


if __name__ == "__main__":
    detail = "-v" in sys.argv
    ps = params()
    opt = OnebitAdam(ps, lr=1e-4, weight_decay=0.01, freeze_step=3)
    opt.reducer().allreduce = forced
    n, rows = measure(
        opt, ps, 6, {2: "OnebitAdam warm-up (W=1: no all_reduce)", 5: "OnebitAdam compression"}.get
    )
    show("OnebitAdam, wd=0.01, block=None", n, rows, detail)

    ps = params()
    opt = OnebitAdam(ps, lr=1e-4, weight_decay=0.01, freeze_step=1, block=64)
    opt.reducer().allreduce = lambda t, we, se, group=None, block=None: local_compressed_allreduce(
        [t], [we], [se], block=block
    )[0]
    n, rows = measure(opt, ps, 4, {4: "OnebitAdam compression, block=64"}.get)
    show("OnebitAdam, wd=0.01, block=64", n, rows, detail)

    ps = params()
    opt = ZeroOneAdam(
        ps,
        lr=1e-4,
        weight_decay=0.0,
        var_freeze_step=4,
        var_update_scaler=1,
        local_step_scaler=1,
        local_step_clipper=16,
    )
    opt.reducer().allreduce = forced
    labels = {
        3: "ZeroOneAdam P1 compressed step",
        4: "ZeroOneAdam P1 variance step (W=1)",
        7: "ZeroOneAdam P2 local step",
        8: "ZeroOneAdam P2 sync step",
    }
    n, rows = measure(opt, ps, 8, labels.get)
    show("ZeroOneAdam, wd=0", n, rows, detail)

    ps = params()
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    n, rows = measure(opt, ps, 2, {2: "AdamW fused"}.get)
    ps2 = params()
    opt2 = torch.optim.AdamW(ps2, lr=1e-4, weight_decay=0.01)
    _, rows2 = measure(opt2, ps2, 2, {2: "AdamW default (CPU: for-loop)"}.get)
    rows.update(rows2)
    show("torch AdamW", n, rows, detail)
