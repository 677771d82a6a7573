"""DiLoCo with W replicas in one process: float32 against 1-bit pseudo-gradients, and candidate
forms of the 1-bit sync, to choose before touching the library (issue 37; docs/ALGORITHMS.md 10).

Every replica is a copy of the model with its own inner AdamW and its own data; every H inner
steps the pseudo-gradients Delta_r = theta - x_r are averaged (exactly, or by
``local_compressed_allreduce``: the library's 1-bit all-reduce, run for W ranks locally) and the
outer SGD (momentum 0.9, Nesterov) steps theta. Forms of the 1-bit sync, c = mu * m the outer
momentum term:

  plain     compress Delta_r;           error buffers times ``decay`` after each sync (the default)
  momentum  compress Delta_r + c, SGD gets D - c (momentum_form=True; decay 1)
  blend     compress Delta_r + g * c, SGD gets D - g * c, with g = ``--gamma`` (or from the outer
            lr: g = 1 - lr when --gamma auto), decay 1 - (1 - ``decay``) * (1 - g)

  python bench/diloco_sim.py --task digits --outer-lr 0.1 0.3 0.7 --H 10 50 --seeds 0 1 2 \\
      --forms fp32 plain momentum blend

One JSON line per run (task, H, outer lr, form, seed, final validation loss) to --jsonl; a table
of the ratios to float32 at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from onebit.collectives import local_compressed_allreduce, padded_numel  # noqa: E402


def task(name: str, seed: int):
    """(model, next_batch(r), validation(model)) for W replicas' data streams. ``lm``: the demo's
    byte-level GPT (bench_diloco.py's settings: context 64, d_model 128, 2 layers, 4 heads, batch
    16, 16 evaluation batches); otherwise a task of bench/train_task.py (digits)."""
    if name == "lm":
        import types

        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
        from train_lm import GPT, TRAIN_FILES, VALID_FILES, batch, evaluate, load_bytes

        settings = types.SimpleNamespace(batch=16, context=64, eval_batches=16)
        torch.manual_seed(seed)
        model = GPT(settings.context, 128, 2, 4)
        train, valid = load_bytes(TRAIN_FILES), load_bytes(VALID_FILES)

        def lm_batches(r: int):
            g = torch.Generator().manual_seed(1000 * (seed + 1) + r + 1)
            while True:
                x, y = batch(train, settings.batch, settings.context, g, "cpu")
                yield x, y

        def lm_validation(m) -> float:
            with torch.no_grad():
                return evaluate(m, valid, settings, "cpu")

        return model, lm_batches, lm_validation
    import train_task

    load, build, size = train_task.TASKS[name]
    (xt, yt), held_out = load()
    torch.manual_seed(seed)
    model = build()

    def batches(r: int):
        g = torch.Generator().manual_seed(1000 * (seed + 1) + r + 1)
        while True:
            i = torch.randint(0, len(yt), (size,), generator=g)
            yield xt[i], yt[i]

    def validation(m) -> float:
        m.eval()
        out = train_task.evaluate(m, held_out)
        m.train()
        return out

    return model, batches, validation


def run(args, name: str, seed: int, H: int, outer_lr: float, form: str) -> float:
    torch.manual_seed(seed)
    global_model, batches, validation = task(name, seed)
    W, mu = args.replicas, 0.9
    theta = [p.detach().clone() for p in global_model.parameters()]
    replicas = [copy.deepcopy(global_model) for _ in range(W)]
    inners = [torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
              for m in replicas]
    streams = [batches(r) for r in range(W)]
    outer = torch.optim.SGD(global_model.parameters(), lr=outer_lr, momentum=mu, nesterov=True)
    flat_n = sum(t.numel() for t in theta)
    N = padded_numel(flat_n, W, args.block)
    errors = ([torch.zeros(N) for _ in range(W)], [torch.zeros(N // W) for _ in range(W)])
    gamma = (1.0 - outer_lr if args.gamma == "auto" else float(args.gamma)) if form == "blend" else \
        (1.0 if form == "momentum" else 0.0)
    decay = {"momentum": 1.0, "plain": args.decay}.get(form, 1.0 - (1.0 - args.decay) * (1.0 - gamma))
    for step in range(1, args.steps + 1):
        for m, opt, data in zip(replicas, inners, streams, strict=True):
            x, y = next(data)
            out = m(x)
            if out.dim() == 3:  # the LM: [batch, context, vocabulary]
                out, y = out.flatten(0, 1), y.flatten()
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
        if step % H:
            continue
        deltas = [torch.cat([(t - p.detach()).reshape(-1)
                             for t, p in zip(theta, m.parameters(), strict=True)]) for m in replicas]
        if form == "fp32":
            D = torch.stack(deltas).mean(0)
        else:
            c = torch.zeros(flat_n)
            bufs = [outer.state.get(p, {}).get("momentum_buffer") for p in global_model.parameters()]
            if gamma and all(b is not None for b in bufs):
                c = gamma * mu * torch.cat([b.reshape(-1) for b in bufs])
            sent = [d + c for d in deltas]
            local_compressed_allreduce(sent, *errors, block=args.block)
            D = sent[0] - c
            if decay != 1.0:
                for buf in (*errors[0], *errors[1]):
                    buf.mul_(decay)
        offset = 0
        with torch.no_grad():
            for p, t in zip(global_model.parameters(), theta, strict=True):
                p.copy_(t)
                p.grad = D[offset : offset + t.numel()].view_as(t).clone()
                offset += t.numel()
        outer.step()
        outer.zero_grad()
        theta = [p.detach().clone() for p in global_model.parameters()]
        for m in replicas:
            with torch.no_grad():
                for p, t in zip(m.parameters(), theta, strict=True):
                    p.copy_(t)
    return validation(global_model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="digits")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--outer-lr", type=float, nargs="+", default=[0.1, 0.3, 0.7])
    p.add_argument("--H", type=int, nargs="+", default=[10, 50])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--forms", nargs="+", default=["fp32", "plain", "momentum"])
    p.add_argument("--decay", type=float, default=0.5)
    p.add_argument("--gamma", default="auto")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--jsonl", default=os.path.join(HERE, "out", "diloco_sim.jsonl"))
    args = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    results: dict[tuple, list[float]] = {}
    for seed in args.seeds:
        for H in args.H:
            for lr in args.outer_lr:
                for form in args.forms:
                    loss = run(args, args.task, seed, H, lr, form)
                    results.setdefault((H, lr, form), []).append(loss)
                    row = {"task": args.task, "H": H, "outer_lr": lr, "form": form, "seed": seed,
                           "val_loss": loss, "decay": args.decay, "gamma": args.gamma, "steps": args.steps}
                    with open(args.jsonl, "a") as fh:
                        fh.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
    print("\n| H | outer lr | form | mean val loss | ratio of means to fp32 | per-seed ratios |")
    print("|---|---|---|---|---|---|")
    for (H, lr, form), losses in sorted(results.items()):
        base = results.get((H, lr, "fp32"))
        ratio = statistics.mean(losses) / statistics.mean(base) if base else float("nan")
        per = ", ".join(f"{a / b:.3f}" for a, b in zip(losses, base or [], strict=False))
        print(f"| {H} | {lr} | {form} | {statistics.mean(losses):.4f} | {ratio:.3f} | {per} |")


if __name__ == "__main__":
    main()
