"""The optimizers' state in bytes per parameter, counted from outside (onebit.memory: every tensor
reachable from the optimizer object, each storage once, the parameters and gradients left out).

W gloo ranks (torchrun, one thread each) train a 1.2M-parameter MLP of 8 tensors past the freeze
with each optimizer, buckets of ``--bucket-mb`` MB where it takes ``bucket_cap_mb`` (the rest at
their defaults), then rank 0 counts: ``torch.optim.AdamW``; OnebitAdam, OnebitLamb and ZeroOneAdam
(its variance frozen, in phase 2); AdamW behind the DDP hook with ``freeze_step`` (AdamW's state and
the hook's). Issue 56's table (its targets: at most 8 bytes per parameter, the hook at most 12).

  python bench/bench_memory.py                 # 2 ranks
  python bench/bench_memory.py --ranks 4 --csv bench/out/memory-w4.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    child_arguments,
    markdown_table,
    provenance,
    rank0_result,
    ranks_json,
    run_child,
    write_csv,
)

NAMES = ("adamw", "onebit_adam", "onebit_lamb", "zero_one_adam", "adamw_ddp_hook")
SIZES = (384, 1024, 640, 256, 10)  # Linear layers 384-1024-640-256-10: 8 tensors, 1.22M parameters


def _model():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _count(name: str, args) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.memory import bytes_per_parameter

    model, others = _model(), []
    freeze, cap = args.freeze, args.bucket_mb
    kw = {} if args.error_dtype == "default" else {"error_dtype": getattr(torch, args.error_dtype)}
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif name == "adamw_ddp_hook":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = OnebitCompressHookState(optimizer=opt, freeze_step=freeze, **kw)
        model.register_comm_hook(state, onebit_compress_hook)
        others.append(state)
    elif name == "onebit_adam":
        opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=freeze, bucket_cap_mb=cap, **kw)
    elif name == "onebit_lamb":
        opt = OnebitLamb(model.parameters(), lr=1e-3, freeze_step=freeze, **kw)  # one bucket
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=freeze, bucket_cap_mb=cap, **kw)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(16, SIZES[0], generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return bytes_per_parameter(opt, *others)


def child(args) -> None:
    dist.init_process_group("gloo")
    out = {name: _count(name, args) for name in NAMES}
    rank0_result(args.out, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--freeze", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bucket-mb", type=float, default=0.5)
    p.add_argument("--error-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the error buffers' dtype ('default': the library's)")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "memory.csv"))
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    res = ranks_json(__file__, args.ranks, ["--freeze", str(args.freeze), "--steps", str(args.steps),
                                            "--bucket-mb", str(args.bucket_mb),
                                            "--error-dtype", args.error_dtype])
    n = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:], strict=True))
    print(f"# {args.ranks} gloo ranks, {n / 1e6:.2f}M parameters in 8 tensors, {args.steps} steps (freeze at "
          f"{args.freeze}), buckets of {args.bucket_mb} MB, error buffers {args.error_dtype}; bytes of state "
          f"per parameter, rank 0")
    print(markdown_table(["", "bytes per parameter"], [[k, f"{v:.2f}"] for k, v in res.items()]))
    meta = provenance(None, ranks=args.ranks, parameters=n, steps=args.steps, freeze=args.freeze,
                      bucket_mb=args.bucket_mb, error_dtype=args.error_dtype)
    rows = [{**meta, "optimizer": k, "bytes_per_parameter": round(v, 3)} for k, v in res.items()]
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
