"""The optimizers' state in bytes per parameter, counted from outside (onebit.memory: every tensor
reachable from the optimizer object, each storage once, the parameters and gradients left out).

W gloo ranks (torchrun, one thread each) train a 1.2M-parameter MLP of 8 tensors past the freeze
with each optimizer, buckets of ``--bucket-mb`` MB where it takes ``bucket_cap_mb`` (the rest at
their defaults), then rank 0 counts: ``torch.optim.AdamW``; OnebitAdam, OnebitLamb and ZeroOneAdam
(its variance frozen, in phase 2); AdamW behind the DDP hook with ``freeze_step`` (AdamW's state and
the hook's). Issue 56's table (its targets: at most 8 bytes per parameter, the hook at most 12).

``--device cuda``: the ranks share one GPU (gloo takes CUDA tensors), and after the count each rank
times nothing but measures one more training step's peak (``torch.cuda.max_memory_allocated`` from a
reset just before it) and what was allocated before it (the model, its gradients, the state): the
step's transients are the difference. ``--blocks`` widens the model (hidden sizes times it).

  python bench/bench_memory.py                 # 2 ranks
  python bench/bench_memory.py --ranks 4 --csv bench/out/memory-w4.csv
  python bench/bench_memory.py --device cuda --blocks 4   # the GPU rows (scripts/gpu_check.sh memory)
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


def _sizes(blocks: int) -> tuple[int, ...]:
    return (SIZES[0], *(s * blocks for s in SIZES[1:-1]), SIZES[-1])


def _model(blocks: int = 1):
    torch.manual_seed(0)
    layers = []
    sizes = _sizes(blocks)
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _count(name: str, args) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.memory import bytes_per_parameter

    device = torch.device(args.device)
    model, others = _model(args.blocks).to(device), []
    freeze, cap = args.freeze, args.bucket_mb
    kw = {} if args.error_dtype == "default" else {"error_dtype": getattr(torch, args.error_dtype)}
    own = dict(kw)  # the 1-bit optimizers' (the hook has no frozen variance of its own: AdamW's)
    if args.variance_dtype != "default":
        own["variance_dtype"] = getattr(torch, args.variance_dtype)
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif name == "adamw_ddp_hook":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = OnebitCompressHookState(optimizer=opt, freeze_step=freeze, **kw)
        model.register_comm_hook(state, onebit_compress_hook)
        others.append(state)
    elif name == "onebit_adam":
        opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=freeze, bucket_cap_mb=cap, **own)
    elif name == "onebit_lamb":
        opt = OnebitLamb(model.parameters(), lr=1e-3, freeze_step=freeze, **own)  # one bucket
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=freeze, bucket_cap_mb=cap, **own)
    g = torch.Generator().manual_seed(dist.get_rank())

    def step():
        x = torch.randn(16, SIZES[0], generator=g).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.steps):
        step()
    out = {"state": bytes_per_parameter(opt, *others)}
    if device.type == "cuda":  # one more step: its peak over what it starts from
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        out.update(before_mb=before / 2**20, peak_mb=torch.cuda.max_memory_allocated() / 2**20)
    return out


def child(args) -> None:
    dist.init_process_group("gloo")
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (gloo moves CUDA tensors through the host)
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
    p.add_argument("--variance-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the 1-bit optimizers' frozen variance ('default': the library's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--blocks", type=int, default=1, help="the hidden layers' widths times this")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "memory.csv"))
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    res = ranks_json(__file__, args.ranks, ["--freeze", str(args.freeze), "--steps", str(args.steps),
                                            "--bucket-mb", str(args.bucket_mb),
                                            "--error-dtype", args.error_dtype, "--device", args.device,
                                            "--variance-dtype", args.variance_dtype,
                                            "--blocks", str(args.blocks)])
    sizes = _sizes(args.blocks)
    n = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    print(f"# {args.ranks} gloo ranks on {args.device}, {n / 1e6:.2f}M parameters in 8 tensors, "
          f"{args.steps} steps (freeze at {args.freeze}), buckets of {args.bucket_mb} MB, error buffers "
          f"{args.error_dtype}, frozen variance {args.variance_dtype}; bytes of state per parameter, rank 0")
    cuda = args.device == "cuda"
    head = ["", "bytes per parameter"]
    head += ["allocated before a step, MB", "the step's peak, MB"] if cuda else []
    print(markdown_table(head, [[k, f"{v['state']:.2f}"]
                                + ([f"{v['before_mb']:.1f}", f"{v['peak_mb']:.1f}"] if cuda else [])
                                for k, v in res.items()]))
    meta = provenance(torch.device(args.device) if cuda else None, ranks=args.ranks, parameters=n,
                      steps=args.steps, freeze=args.freeze, bucket_mb=args.bucket_mb,
                      error_dtype=args.error_dtype)
    rows = [{**meta, "optimizer": k, "bytes_per_parameter": round(v["state"], 3),
             **({"before_mb": round(v["before_mb"], 2), "peak_mb": round(v["peak_mb"], 2)} if cuda else {})}
            for k, v in res.items()]
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
