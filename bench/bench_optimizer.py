"""Optimizer overhead: OnebitAdam's compression-stage step against fused AdamW, wire excluded.

A transformer-shaped parameter set (default: 8 blocks of d_model 1024, about 101M
parameters) with fixed random gradients. OnebitAdam runs with ``freeze_step=1`` (every timed step
compressed) and its reducer's collective replaced by the whole local compute of rank 0 in a group
of ``--world`` W ranks (default 4), the two collectives as copies
(:class:`onebit.collectives.allreduce.LocalCopies`): the worker pass and decompress over all n
elements, the server over this rank's n / W from W messages, no communication. So the time is one
rank's own compute in a W-rank run. ``--world 1`` runs the server over all n, a compute no run
does (a one-rank group takes the identity shortcut). The baseline is
``torch.optim.AdamW(fused=True)`` on identical parameters. Prints medians of --repeats steps
and the ratio; appends a CSV row per optimizer.

  python bench/bench_optimizer.py                       # CUDA if present, else CPU
  python bench/bench_optimizer.py --device cpu --blocks 8 --repeats 5
  python bench/bench_optimizer.py --capture             # a GPU: OnebitAdam(capturable=True)'s step replayed
                                                        # from a CUDA graph (issue 57)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

from onebit.collectives.allreduce import LocalCopies, _compressed_allreduce
from onebit.kernels.backends import use_backend
from onebit.kernels.layout import padded_numel
from onebit.optimizers import OnebitAdam, ZeroOneAdam

FUSED_STEPS = ("adam", "zoa", "local", "warmup")  # the optimizers' fused steps (kernels/backends.py STEPS)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, wall_ms, write_csv  # noqa: E402


def local_rank(W: int):
    """compressed_allreduce as rank 0 of W computes it, the collectives as copies (no identity
    shortcut at W = 1). OnebitAdam's fused passes (onebit.optimizers._fused: Triton on a GPU, C on
    an x86 CPU) run the same: their own worker and decompress passes, the server, the copies."""
    def allreduce(tensor, worker_error, server_error, group=None):
        _compressed_allreduce(tensor, worker_error, server_error, None, W, None, LocalCopies(W))
        return tensor

    allreduce.local_compute = W
    return allreduce


forced_single_rank = local_rank(1)  # bench_profile.py: the whole compute of a one-rank group


def emulate_world(opt, W: int) -> None:
    """Size the reducer's error buffers as a W-rank group's rank holds them, its collective local."""
    reducer = opt.reducer()
    for b in reducer.buckets:
        N = padded_numel(b.n, W, None)
        b.worker_error = torch.zeros(N, dtype=reducer.error_dtype, device=b.flat.device)
        b.server_error = torch.zeros(N // W, dtype=reducer.error_dtype, device=b.flat.device)
    reducer.allreduce = local_rank(W)  # the reducer's only collective


def make_params(blocks: int, d: int, device) -> list[torch.nn.Parameter]:
    shapes = []
    for _ in range(blocks):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)] + [(d,)] * 4 + [(4 * d,)]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device) * 1e-3
    return params


def build(name: str, args, device):
    params = make_params(args.blocks, args.d_model, device)
    kw = {} if args.error_dtype == "default" else {"error_dtype": getattr(torch, args.error_dtype)}
    if args.variance_dtype != "default":
        kw["variance_dtype"] = getattr(torch, args.variance_dtype)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    if name == "zero_one_adam":  # phase 1: variance steps at t = 1, 2, 4, 8, ..., compressed steps between
        opt = ZeroOneAdam(params, lr=1e-4, weight_decay=0.01, var_freeze_step=10**6, var_update_scaler=1,
                          bucket_cap_mb=args.bucket_cap_mb, **kw)
    elif args.capture:  # a tensor lr, as a schedule would give it (read on the device)
        opt = OnebitAdam(params, lr=torch.tensor(1e-4, device=device), weight_decay=0.01, freeze_step=1,
                         bucket_cap_mb=args.bucket_cap_mb, capturable=True, **kw)
    else:
        opt = OnebitAdam(params, lr=1e-4, weight_decay=0.01, freeze_step=1, bucket_cap_mb=args.bucket_cap_mb,
                         **kw)
    emulate_world(opt, args.world)
    return opt


def time_steps(opt, device, repeats: int, capture: bool = False) -> list[float]:
    """Wall milliseconds of ``repeats`` steps after two (``capture``: three eager steps, the fourth captured
    in a CUDA graph, then replays)."""
    for _ in range(3 if capture else 2):
        opt.step()
    if not capture:
        return [wall_ms(opt.step, device) for _ in range(repeats)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    return [wall_ms(graph.replay, device) for _ in range(repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--world", type=int, default=4, help="the emulated group size W (rank 0's compute)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="OnebitAdam's bucket size")
    p.add_argument("--error-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the 1-bit optimizers' error buffers ('default': the library's)")
    p.add_argument("--variance-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="OnebitAdam's frozen variance's dtype")
    p.add_argument("--unfused", action="store_true",
                   help="OnebitAdam without its fused passes (use_backend('plain', steps=the fused steps): "
                        "Triton's on a GPU, the C ones on a CPU)")
    p.add_argument("--interleave", action="store_true",
                   help="time fused AdamW, OnebitAdam unfused and fused (on CPU also fused with the "
                        "non-finite agreement's own pass over the gradients) in turn, step by step, in one "
                        "process (the host's speed drifts between runs by more than the difference)")
    p.add_argument("--zero-one", action="store_true",
                   help="ZeroOneAdam's phase-1 compressed steps instead of OnebitAdam's (CPU fused passes: "
                        "optimizers/_fused.py; the medians skip its variance steps at t = 2^k)")
    p.add_argument("--capture", action="store_true",
                   help="OnebitAdam(capturable=True): its compression step captured in a CUDA graph, the "
                        "replays timed (a GPU; against eager fused AdamW)")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "optimizer.csv"))
    args = p.parse_args()
    if args.capture and (args.device != "cuda" or args.zero_one or args.interleave or args.unfused):
        p.error("--capture: a CUDA device, OnebitAdam, without --zero-one, --interleave, --unfused")
    kind = "zero_one_adam" if args.zero_one else "onebit_adam"
    device = torch.device(args.device)
    if args.unfused:
        use_backend("plain", steps=FUSED_STEPS).__enter__()  # for the whole process
    results, n = {}, 0
    if args.interleave:
        runs = {"adamw_fused": (build("adamw_fused", args, device), True),
                kind + "_unfused": (build(kind, args, device), False),
                kind: (build(kind, args, device), True)}
        if device.type == "cpu":  # the fused C step, its agreement reading the gradients (as before 11-27)
            reread = build(kind, args, device)
            reread._prepare_step = lambda: None
            runs[kind + "_gradient_pass"] = (reread, True)
        n = sum(q.numel() for q in runs["adamw_fused"][0].param_groups[0]["params"])
        times = {name: [] for name in runs}
        for i in range(args.repeats + 2):
            for name, (opt, fused) in runs.items():
                with contextlib.nullcontext() if fused else use_backend("plain", steps=FUSED_STEPS):
                    ms = wall_ms(opt.step, device)
                if i >= 2:
                    times[name].append(ms)
        results = {name: statistics.median(t) for name, t in times.items()}
        for name, ms in results.items():
            print(f"{name:20} {n / 1e6:.1f}M parameters: {ms:9.2f} ms/step (median of {args.repeats}, "
                  f"interleaved, W = {args.world})", file=sys.stderr)
        print(f"{kind} unfused / fused = {results[kind + '_unfused'] / results[kind]:.2f}", file=sys.stderr)
    for name in () if args.interleave else ("adamw_fused", kind):
        opt = build(name, args, device)
        n = sum(q.numel() for q in opt.param_groups[0]["params"])
        times = time_steps(opt, device, args.repeats, capture=args.capture and name == kind)
        results[name] = statistics.median(times)
        print(f"{name:12} {n / 1e6:.1f}M parameters: {results[name]:9.2f} ms/step (median of {len(times)})",
              file=sys.stderr)
        del opt
    ratio = results[kind] / results["adamw_fused"]
    print(f"{kind} compressed step / fused AdamW step = {ratio:.2f}", file=sys.stderr)
    meta = provenance(device)
    tag = "_unfused" if args.unfused else ""
    tag += "_interleaved" if args.interleave else ""
    tag += "_captured" if args.capture else ""
    rows = [{**meta, "parameters": n, "world": args.world, "bucket_mb": args.bucket_cap_mb,
             "error_dtype": args.error_dtype, "variance_dtype": args.variance_dtype,
             "optimizer": name + (tag if name != "adamw_fused" else ""),
             "ms_median": f"{ms:.3f}",
             "ratio_to_adamw": f"{ms / results['adamw_fused']:.3f}"} for name, ms in results.items()]
    print(write_csv(args.csv, rows, append=True))


if __name__ == "__main__":
    main()
