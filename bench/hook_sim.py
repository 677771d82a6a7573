"""The DDP hook's averaging of W ranks in one process: fast what-ifs for the hook's maths.

Every step computes each rank's gradient on its own batch (the batches of
bench/bench_ddp_hook.py: same seeds, so the exact average reproduces plain DDP's run),
averages them with one of the variants below through ``local_compressed_allreduce`` (the
collective's compute, bit for bit) and steps torch's SGD (momentum 0.9) or AdamW. One flat
bucket for the whole model (DDP uses several; block boundaries differ, nothing else).

  exact     the float32 mean (plain DDP)
  gradient  compress each rank's gradient (onebit_compress_hook without optimizer=)
  momentum  SGD: compress each rank's momentum b*m + g, hand SGD A - b*m
            (onebit_compress_hook with optimizer=SGD, docs/ALGORITHMS.md section 8.1)
  adam-momentum  AdamW: compress b1*m + (1-b1)*g, hand AdamW (A - b1*m) / (1-b1)
            (the construction section 8.1 rejects for Adam)

At the end it prints each Linear layer's weight norm, how far the first layer's weights moved
(for inputs that are zero in every training example and for the others) and, on the MLP, the
validation loss with the logits divided by the best temperature of a small grid.

Every 25 compressed steps it prints rank 0's worker error over the norm of what it
compressed, the server errors over the same, and the averaged gradient's distance to the
exact mean; at every evaluation the validation loss (and accuracy on the MLP).

  python bench/hook_sim.py --variant momentum --lr 0.1
  python bench/hook_sim.py --task mlp --steps 600 --variant gradient --seed 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_ddp_hook import _lm_task, _mlp_task  # noqa: E402

VARIANTS = ("exact", "gradient", "momentum", "adam-momentum")


def main() -> None:
    from onebit.collectives.local import local_compressed_allreduce
    from onebit.kernels.layout import padded_numel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS, default="momentum")
    p.add_argument("--task", choices=["lm", "mlp"], default="lm")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default=None, help="default: adamw for "
                   "adam-momentum, else sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--block", default="64", help="elements per scale, or 'none'")
    p.add_argument("--start-iter", type=int, default=10)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args()
    optimizer = args.optimizer or ("adamw" if args.variant == "adam-momentum" else "sgd")
    torch.manual_seed(args.seed)
    model, next_batch, val_loss, logits, val_accuracy = (_lm_task if args.task == "lm" else _mlp_task)(args)
    params = list(model.parameters())
    n, W = sum(q.numel() for q in params), args.ranks
    block = None if args.block == "none" else int(args.block)
    N = padded_numel(n, W, block)
    opt = (torch.optim.SGD(params, lr=args.lr, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0))
    gens = [torch.Generator().manual_seed(args.seed * 1000 + r + 1) for r in range(W)]
    worker = [torch.zeros(N) for _ in range(W)]
    server = [torch.zeros(N // W) for _ in range(W)]

    def state_flat(key: str) -> torch.Tensor:
        return torch.cat([opt.state[q][key].reshape(-1) for q in params])

    def average(inputs: list[torch.Tensor]) -> torch.Tensor:
        padded = [F.pad(x, (0, N - n)) for x in inputs]
        local_compressed_allreduce(padded, worker, server, block=block)
        return padded[0][:n]

    start = [q.detach().clone() for q in params]
    t0 = time.time()
    for step in range(1, args.steps + 1):
        grads, losses = [], []
        for r in range(W):
            x, y = next_batch(gens[r])
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(logits(model(x)), y)
            loss.backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in params]))
            losses.append(loss.item())
        exact = torch.stack(grads).mean(0)
        inputs = grads
        if step <= args.start_iter or args.variant == "exact":
            mean = exact
        elif args.variant == "gradient":
            mean = average(grads)
        elif args.variant == "momentum":
            c = 0.9 * state_flat("momentum_buffer")
            inputs = [g + c for g in grads]
            mean = average(inputs) - c
        else:
            m = state_flat("exp_avg")
            inputs = [0.9 * m + 0.1 * g for g in grads]
            mean = (average(inputs) - 0.9 * m) / 0.1
        if args.variant != "exact" and step > args.start_iter and (step % 25 == 0 or step == args.steps):
            z = inputs[0].norm()
            print(f"step {step} worker error / input {(worker[0][:n].norm() / z).item():.3f} "
                  f"server errors / input {(torch.cat(server).norm() / z).item():.3f} "
                  f"|mean - exact| / |exact| {((mean - exact).norm() / exact.norm()).item():.3f}", flush=True)
        offset = 0
        for q in params:
            q.grad = mean[offset:offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                acc = "" if val_accuracy is None else f" val accuracy {val_accuracy():.4f}"
                print(f"step {step} train loss {sum(losses) / W:.4f} val loss {val_loss():.4f}{acc} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    _report(model, start, args)


@torch.no_grad()
def _report(model, start: list[torch.Tensor], args) -> None:
    """Weight norms, the first layer's movement, the temperature-calibrated validation loss."""
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print("weight norms " + " ".join(f"{m.weight.norm().item():.3f}" for m in linear))
    if args.task != "mlp":
        return
    from train_task import digits_data

    (xt, _), (xv, yv) = digits_data()
    dead = xt.abs().sum(0) == 0
    first = linear[0].weight
    moved = first - start[[id(q) for q in model.parameters()].index(id(first))]
    print(f"first layer moved: {int(dead.sum())} always-zero inputs {moved[:, dead].norm().item():.4f}, "
          f"other inputs {moved[:, ~dead].norm().item():.4f}")
    logits = model(xv)
    best = min((F.cross_entropy(logits / t, yv).item(), t) for t in (0.5, 0.75, 1.0, 1.5, 2.0, 3.0))
    print(f"validation loss at the best temperature {best[0]:.4f} (T = {best[1]})")


if __name__ == "__main__":
    main()
