"""bench/lamb_stage.py with candidate C (candidates.layout_slots): the flat buffer permuted once at
the freeze by the frozen v before the block-scaled compressed_allreduce. No library or bench file
is changed: lamb_stage's run() is copied here with v kept, and lamb_stage.local_compressed_allreduce
is wrapped. Same arguments as lamb_stage.py plus --layout {none,active,tsort,gsort} (needs --block).

  python stage_layout.py --variants lamb comp-sketch --seeds 0 1 2 --block 64 --layout tsort
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import candidates  # noqa: E402
import lamb_stage as ls  # noqa: E402
from train_task import digits_data, digits_model, evaluate, mlp_model  # noqa: E402

from onebit.kernels.layout import padded_numel  # noqa: E402
from onebit.optimizers._functional import TRUST_SKETCH, count_sketch_index  # noqa: E402

_orig = ls.local_compressed_allreduce
LAYOUT = {"slots": None}


def _permuted(flats, worker_errors, server_errors, *, block=None, backend=None):
    slots = LAYOUT["slots"]
    if slots is None:
        return _orig(flats, worker_errors, server_errors, block=block, backend=backend)
    N = worker_errors[0].numel()
    xs = []
    for f in flats:
        x = torch.zeros(N)
        x[slots] = f.reshape(-1)
        xs.append(x)
    _orig(xs, worker_errors, server_errors, block=block, backend=backend)
    for f, x in zip(flats, xs, strict=True):
        f.reshape(-1).copy_(x[slots])
    return list(flats)


ls.local_compressed_allreduce = _permuted


def run(variant: str, seed: int, args) -> float:  # lamb_stage.run, v kept for the layout
    LAYOUT["slots"] = None
    (xt, yt), valid = digits_data()
    torch.manual_seed(seed)
    model = mlp_model() if args.task == "mlp" else digits_model()
    params = list(model.parameters())
    W, (b1, b2), eps, wd = args.ranks, args.betas, 1e-8, args.weight_decay
    gens = [torch.Generator().manual_seed(1000 * seed + r + 1) for r in range(W)]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    cf = [0.0 for _ in params]
    N = padded_numel(sum(p.numel() for p in params), W, args.block)
    state = {"errors": ([torch.zeros(N) for _ in range(W)], [torch.zeros(N // W) for _ in range(W)]),
             "coeff_freeze": cf,
             "index": [count_sketch_index(p.numel(), TRUST_SKETCH, 0x1B17 + k, p.device)
                       for k, p in enumerate(params)]}
    u_local = mstar = None
    for step in range(1, args.steps + 1):
        grads = []
        for r in range(W):
            i = torch.randint(0, len(yt), (args.batch,), generator=gens[r])
            grads.append(torch.autograd.grad(F.cross_entropy(model(xt[i]), yt[i]), params))
        if u_local is not None:
            ls._compressed_update(params, u_local, mstar, state, grads, variant, args, step)
            continue
        with torch.no_grad():
            for k, p in enumerate(params):
                g = sum(gr[k] for gr in grads) / W
                m[k].mul_(b1).add_(g, alpha=1 - b1)
                v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                upd = m[k] / (v[k].sqrt() + eps) + wd * p
                c = ls._trust(p, float(upd.norm()))
                if c != 1.0:
                    cf[k] = 0.9 * cf[k] + 0.1 * c
                p.add_(upd, alpha=-args.lr * c)
            if step == args.freeze and variant != "lamb":
                d = []
                for k in range(len(params)):
                    s = v[k].sqrt()
                    floor = args.variance_floor * s.sum() / max(int((s > 0).sum()), 1)
                    d.append(torch.maximum(s, floor) + eps)
                state["d"] = d
                u_local = [[m[k] / d[k] for k in range(len(params))] for _ in range(W)]
                mstar = [m[k] / d[k] for k in range(len(params))]
                if args.layout != "none":
                    offs = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
                    LAYOUT["slots"] = candidates.layout_slots(args.layout, [x.clone() for x in v], offs, N,
                                                              args.block)
    return evaluate(model, valid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["lamb", "comp-sketch"])
    p.add_argument("--task", choices=["mlp", "digits"], default="mlp")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--freeze", type=int, default=120)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--variance-floor", type=float, default=0.5)
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--layout", choices=["none", "active", "tsort", "gsort"], default="none")
    p.add_argument("--trace", action="store_true")
    args = p.parse_args()
    if args.layout != "none" and args.block is None:
        p.error("--layout needs --block")
    torch.set_num_threads(1)
    base = None
    print(f"freeze {args.freeze}, floor {args.variance_floor}, block {args.block}, layout {args.layout}, "
          f"W = {args.ranks}")
    print("| variant | final val loss per seed | mean | ratio to lamb |\n|---|---|---|---|")
    for variant in args.variants:
        losses = [run(variant, seed, args) for seed in args.seeds]
        mean = sum(losses) / len(losses)
        base = mean if variant == "lamb" else base
        ratio = f"{mean / base:.3f}" if base else ""
        print(f"| {variant} | {' '.join(f'{x:.4f}' for x in losses)} | {mean:.4f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
