"""The DDP hook's per-step compute against plain DDP's all-reduce, on an unshaped loopback.

W gloo ranks (torchrun, one thread each) train a stack of Linear layers (default 4 of 2048 x
2048: 16.8M parameters, 64 MB of float32 gradients) with ``torch.optim.AdamW(fused=True)``, once
as plain DDP and once behind ``onebit_compress_hook`` with ``optimizer=`` and ``freeze_step``
(every timed step compressed). Each timed step runs a backward under ``no_sync()`` (the
backward's own compute), a backward with the gradients' communication, and the optimizer step;
medians over --steps of the slowest rank, each piece behind a barrier. Both models are built
first and their steps alternate (``--sequential``: all of plain DDP's, then the hook's). On loopback the wire
costs little, so what the communication adds is compute: plain DDP's all-reduce (gloo's copies
and sums) against the hook's passes, codec and tiny messages, plus what its optimizer pre/post
hooks add to AdamW's step. Prints both and the ratio (issue 38: at most 1.5x).

  python bench/bench_hook_compute.py                    # 2 ranks, 20 steps
  python bench/bench_hook_compute.py --ranks 4 --layers 8
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    slowest_rank_times,
    write_csv,
)


def _slowest(fn) -> float:
    """One call's milliseconds, the slowest rank's (no warm-up: each call is one step's piece)."""
    return slowest_rank_times(fn, 1, warmup=False)[0] * 1e3


def _variant(hooked: bool, args):
    """A model, its optimizer and ``step(rows)``: one timed step's three pieces appended to rows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = DDP(torch.nn.Sequential(*layers))
    if args.optimizer == "sgd":  # SGD's momentum compressed (no freeze_step)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    state = None
    if hooked:
        state = OnebitCompressHookState(optimizer=opt, freeze_step=2 if args.optimizer == "adamw" else None,
                                        error_dtype=getattr(torch, args.error_dtype))
        model.register_comm_hook(state, onebit_compress_hook)
    params = list(model.parameters())

    def clip():  # max_norm far above the norm: the norm's cost alone (the hook: the sketch's all-reduce)
        if state is None:
            torch.nn.utils.clip_grad_norm_(params, 1e9)
        else:
            state.clip_grad_norm_(1e9)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.width, generator=g)

    def backward():
        model(x).square().mean().backward()

    def local_backward():
        with model.no_sync():
            backward()
        opt.zero_grad()

    def step(rows: dict | None) -> None:
        local = _slowest(local_backward)
        synced = _slowest(backward)
        clipped = _slowest(clip) if args.clip else 0.0
        stepped = _slowest(opt.step)
        opt.zero_grad()
        if rows is not None:
            pieces = zip(("local", "synced", "clip", "step"), (local, synced, clipped, stepped), strict=True)
            for k, v in pieces:
                rows.setdefault(k, []).append(v)

    return step


def _measure(args) -> dict:
    """Medians over --steps timed steps past the freeze (4 untimed first): with --sequential all of
    plain DDP's steps, then the hook's (each model built when its turn comes); by default both models
    built first and their steps alternated, so that the machine's drift and the process's history
    (allocations, page faults) land on both alike."""
    rows: dict = {"plain": {}, "hook": {}}
    if args.sequential:
        for name in rows:
            step = _variant(name == "hook", args)
            for t in range(4 + args.steps):
                step(rows[name] if t >= 4 else None)
            del step
    else:
        steps = {name: _variant(name == "hook", args) for name in rows}
        for t in range(4 + args.steps):
            for name in (("plain", "hook") if t % 2 else ("hook", "plain")):
                steps[name](rows[name] if t >= 4 else None)
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}


def child(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = _measure(args)
    rank0_result(args.out, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sequential", action="store_true",
                   help="all of plain DDP's steps, then the hook's (before 2026-11-27: the only way)")
    p.add_argument("--clip", action="store_true",
                   help="each step clips (plain DDP: torch's clip; the hook: its clip, whose count sketches "
                        "the hook takes in backward); their difference counts as communication's compute")
    p.add_argument("--error-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the hook's error buffers (default: the library's, bfloat16)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="AdamW(fused=True) with freeze_step (default), or SGD(momentum=0.9) without")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "hook_compute.csv"))
    child_arguments(p)
    args = p.parse_args()
    run_child(args, child)
    extra = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch), "--steps",
             str(args.steps)] + (["--sequential"] if args.sequential else [])
    extra += (["--clip"] if args.clip else []) + ["--error-dtype", args.error_dtype]
    extra += ["--optimizer", args.optimizer]
    res = ranks_json(__file__, args.ranks, extra)
    plain, hook = res["plain"], res["hook"]
    ddp = plain["synced"] - plain["local"]  # the all-reduce's share of the step
    ours = hook["synced"] - hook["local"] + hook["step"] - plain["step"] + hook["clip"] - plain["clip"]
    n = args.layers * (args.width * args.width + args.width)
    table = [[name, *(f"{res[key][k]:.1f}" for k in ("local", "synced", "clip", "step")), f"{c:.1f}"]
             for name, key, c in (("plain DDP", "plain", ddp), (f"hook ({args.optimizer})", "hook", ours))]
    print(f"# {args.ranks} gloo ranks on loopback, {n / 1e6:.1f}M parameters, medians of {args.steps} steps "
          "(ms, the slowest rank)")
    header = ["", "backward, no_sync", "backward, synced", "clip", "optimizer step",
              "communication's compute"]
    print(markdown_table(header, table))
    print(f"hook / DDP all-reduce: {ours / ddp:.2f}x")
    meta = provenance(None, ranks=args.ranks, parameters=n, steps=args.steps,
                      order="sequential" if args.sequential else "alternating", clip=args.clip,
                      error_dtype=args.error_dtype, optimizer=args.optimizer)
    print(write_csv(args.csv, [{**meta, "variant": name, **{k: f"{v:.3f}" for k, v in res[name].items()},
                                "communication_ms": f"{c:.3f}"}
                               for name, c in (("plain", ddp), ("hook", ours))], append=True))


if __name__ == "__main__":
    main()
