"""OnebitLamb's compressed stage, variant by variant, in one process (docs/ALGORITHMS.md 6.3).

W ranks simulated on bench/train_task.py's 64-128-128-10 MLP on digits (``--task digits``: the
suite's 64-256-256-10 MLP with dropout) (each rank its own
batch of 32, the same generators as the suite), LAMB in full precision until the freeze, then
the preconditioned momentum ``u = m / d`` (``d`` the floored frozen denominator) with:

  exact-*   the exact average of the ranks' ``u`` (no compression)
  comp-*    onebit's compressed_allreduce of the flat ``u`` (local_compressed_allreduce)

and the trust ratio ``c = ||p|| / N`` from:

  *-live    N = ||u_avg + wd*p||, the averaged (decompressed) buffer
  *-frozen  c frozen at the freeze (the EMA LAMB keeps during warm-up)
  *-mstar   N = ||m* + wd*p||, m* the momentum of the exact averaged gradients (an oracle)
  *-sketch  N from a count sketch of m* and p (what OnebitLamb does)
  lamb      LAMB to the end (the baseline)

  python bench/lamb_stage.py --variants lamb exact-live comp-live comp-mstar comp-sketch --seeds 0 1 2
  python bench/lamb_stage.py --variants comp-live --trace   # the buffer's norm against m*'s

Prints each variant's final validation loss per seed and its mean's ratio to LAMB's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train_task import digits_data, digits_model, evaluate, mlp_model  # noqa: E402

from onebit.collectives.local import local_compressed_allreduce  # noqa: E402
from onebit.kernels.layout import padded_numel  # noqa: E402
from onebit.optimizers._functional import TRUST_SKETCH, count_sketch, count_sketch_index  # noqa: E402


def _trust(p: torch.Tensor, norm: float) -> float:
    w = float(p.norm())
    return 1.0 if w == 0 or norm == 0 else min(max(w / norm, 0.01), 10.0)


@torch.no_grad()
def _compressed_update(params, u_local, mstar, state, grads, variant, args, step):
    W, b1, wd = args.ranks, args.betas[0], args.weight_decay
    d, errors, cf, index = state["d"], state["errors"], state["coeff_freeze"], state["index"]
    for r in range(W):
        for k in range(len(params)):
            u_local[r][k].mul_(b1).add_(grads[r][k] / d[k], alpha=1 - b1)
    for k in range(len(params)):
        mstar[k].mul_(b1).add_(sum(g[k] for g in grads) / W / d[k], alpha=1 - b1)
    exact = [sum(u_local[r][k] for r in range(W)) / W for k in range(len(params))]
    if variant.startswith("exact"):
        averaged = exact
    else:
        flats = [torch.cat([t.reshape(-1) for t in u_local[r]]) for r in range(W)]
        flat = local_compressed_allreduce(flats, *errors, block=args.block)[0]
        averaged, offset = [], 0
        for p in params:
            averaged.append(flat[offset : offset + p.numel()].view_as(p).clone())
            offset += p.numel()
    for r in range(W):  # every rank's buffer now holds the average, as in the library
        for k in range(len(params)):
            u_local[r][k].copy_(averaged[k])
    kind = variant.split("-", 1)[1]
    for k, p in enumerate(params):
        upd = averaged[k] + wd * p
        if kind == "live":
            c = _trust(p, float(upd.norm()))
        elif kind == "frozen":
            c = cf[k]
        elif kind == "mstar":
            c = _trust(p, float((mstar[k] + wd * p).norm()))
        else:  # sketch
            c = _trust(p, float(count_sketch(mstar[k] + wd * p, index[k], TRUST_SKETCH).norm()))
        p.add_(upd, alpha=-args.lr * c)
    if args.trace and step % 50 == 0:
        print(f"  step {step}: ||u_avg|| / ||m*|| per tensor "
              + " ".join(f"{float(a.norm() / m.norm()):.2f}" for a, m in zip(averaged, mstar, strict=True)))


def run(variant: str, seed: int, args) -> float:
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
            _compressed_update(params, u_local, mstar, state, grads, variant, args, step)
            continue
        with torch.no_grad():  # LAMB, no bias correction (OnebitLamb's warm-up)
            for k, p in enumerate(params):
                g = sum(gr[k] for gr in grads) / W
                m[k].mul_(b1).add_(g, alpha=1 - b1)
                v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                upd = m[k] / (v[k].sqrt() + eps) + wd * p
                c = _trust(p, float(upd.norm()))
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
    return evaluate(model, valid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["lamb", "exact-live", "comp-live", "comp-frozen",
                                                     "comp-mstar", "comp-sketch"])
    p.add_argument("--task", choices=["mlp", "digits"], default="mlp",
                   help="digits: the suite's 64-256-256-10 MLP with dropout (run it with --lr 5e-3)")
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
    p.add_argument("--trace", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = None
    print(f"freeze {args.freeze}, floor {args.variance_floor}, block {args.block}, W = {args.ranks}")
    print("| variant | final val loss per seed | mean | ratio to lamb |\n|---|---|---|---|")
    for variant in args.variants:
        losses = [run(variant, seed, args) for seed in args.seeds]
        mean = sum(losses) / len(losses)
        base = mean if variant == "lamb" else base
        ratio = f"{mean / base:.3f}" if base else ""
        print(f"| {variant} | {' '.join(f'{x:.4f}' for x in losses)} | {mean:.4f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
