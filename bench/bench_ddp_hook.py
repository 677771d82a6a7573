"""DDP with onebit_compress_hook against plain DDP, with torch's own optimizers.

--task lm: the model, data and batches of examples/train_lm.py (the demo's LM). --task mlp:
bench/train_task.py's 64-128-128-10 ReLU MLP on scikit-learn's digits (batch 32 per rank).
The model is wrapped in DistributedDataParallel (several buckets); SGD with momentum, AdamW and
Muon (``torch.optim.Muon`` on the hidden matrices, an AdamW at --muon-adamw-lr on the rest: embeddings,
norms, biases, the head; issue 59) from torch.optim, each with full-precision DDP averaging and with
``onebit_compress_hook``
(1-bit error-feedback compression of every gradient bucket after ``start_iter``
full-precision iterations, ``--block`` elements per scale; 'none': one scale per chunk).
Writes per-step logs (JSONL), a CSV of final validation losses with the ratio to plain DDP
per seed, and a plot.

  python bench/bench_ddp_hook.py --steps 1000 --ranks 4
  python bench/bench_ddp_hook.py --task mlp --steps 600 --seeds 0 1 2

A run whose loss goes non-finite keeps going (the hook and the optimizers do not stop it);
its final loss is reported as it is (nan), with the last step where it was still finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import muon_split, provenance, pyplot, save_png, write_csv  # noqa: E402

# (optimizer, learning rate): AdamW at the demo's; SGD's rates: --sgd-lrs
PAIRS = [("adamw", 2e-3)]
HOOKS = ("ddp", "onebit")


def _lm_task(args):
    """(model, next training batch, validation loss) of the demo's LM."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_lm as lm

    model = lm.GPT(64, 128, 2, 4)
    train, valid = lm.load_bytes(lm.TRAIN_FILES), lm.load_bytes(lm.VALID_FILES)

    def batch(g):
        x, y = lm.batch(train, 16, 64, g, torch.device("cpu"))
        return x, y.flatten()

    def val_loss() -> float:
        gv = torch.Generator().manual_seed(12345)
        losses = []
        for _ in range(8):
            x, y = lm.batch(valid, 16, 64, gv, torch.device("cpu"))
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
        return sum(losses) / len(losses)

    return model, batch, val_loss, lambda out: out.flatten(0, 1), None


def _mlp_task(args):
    """(model, next training batch, validation loss) of the digits MLP."""
    import torch
    import torch.nn.functional as F
    from train_task import digits_data, mlp_model

    (xt, yt), (xv, yv) = digits_data()
    model = mlp_model()

    def batch(g):
        i = torch.randint(0, len(yt), (32,), generator=g)
        return xt[i], yt[i]

    def val_loss() -> float:
        return F.cross_entropy(model(xv), yv).item()

    def val_accuracy() -> float:
        return (model(xv).argmax(1) == yv).float().mean().item()

    return model, batch, val_loss, lambda out: out, val_accuracy


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model, next_batch, val_loss, logits, val_accuracy = (_lm_task if args.task == "lm" else _mlp_task)(args)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    if args.optimizer == "muon":  # the hidden matrices (Muon's 2-D only), an AdamW for the rest
        hidden, rest = muon_split(model)
        opts = [torch.optim.Muon(hidden, lr=args.lr, momentum=0.95, weight_decay=0.0,
                                 nesterov=args.muon_nesterov == "on"),
                torch.optim.AdamW(rest, lr=args.muon_adamw_lr, betas=(0.9, 0.99), weight_decay=0.0)]
    elif args.optimizer == "sgd":
        opts = [torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)]
    state = None
    if args.hook == "onebit":
        frozen = args.freeze_step if args.optimizer in ("adamw", "muon") and args.freeze_step else None
        given = opts if args.give == "all" else [o for o in opts if type(o).__name__.lower() == args.give]
        state = OnebitCompressHookState(start_iter=args.start_iter, block=_block(args.block),
                                        optimizer=given if args.precondition or frozen else None,
                                        freeze_step=frozen, momentum_bases=_bases(args), **_dtype(args),
                                        **_share(args))
        ddp.register_comm_hook(state, onebit_compress_hook)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    log = open(args.log_jsonl, "w") if rank == 0 else None
    t0 = time.perf_counter()

    @torch.no_grad()
    def validate() -> tuple[float, float | None]:
        v = torch.tensor([val_loss(), val_accuracy() if val_accuracy is not None else 0.0])
        dist.all_reduce(v)
        return v[0].item() / W, (v[1].item() / W if val_accuracy is not None else None)

    for step in range(1, args.steps + 1):
        x, y = next_batch(g)
        loss = F.cross_entropy(logits(ddp(x)), y)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        val, acc = validate() if step % args.eval_every == 0 or step == args.steps else (None, None)
        if log is not None:
            row = {"step": step, "time": time.perf_counter() - t0, "train_loss": loss.item(), "val_loss": val}
            log.write(json.dumps(row if acc is None else {**row, "val_accuracy": acc}) + "\n")
    if log is not None:
        stats = state.stats() if state is not None else {}
        log.write(json.dumps({"final": True, "stats": stats, "buckets": stats.get("buckets")}) + "\n")
        log.close()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from onebit import finish  # gloo aborts at exit now and then without it (docs/failures.md)

    finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--bucket-cap-mb", type=float, default=0.5)
    p.add_argument("--start-iter", type=int, default=10)
    p.add_argument("--task", choices=["lm", "mlp"], default="lm")
    p.add_argument("--block", default="64", help="the hook's block (elements per scale), or 'none'")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--optimizers", nargs="+", choices=["sgd", "adamw", "muon"], default=["sgd", "adamw"])
    p.add_argument("--precondition", "--pass-optimizer", dest="precondition", action="store_true",
                   help="give the hook the optimizer (OnebitCompressHookState(optimizer=...)): AdamW "
                   "compresses g / d in Adam's preconditioned space, SGD compresses its momentum")
    p.add_argument("--freeze-step", type=int, default=0, help="AdamW: OnebitCompressHookState("
                   "freeze_step=N), 1-bit Adam's recipe behind the hook (docs/ALGORITHMS.md 8.2); 0: off")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[lr for o, lr in PAIRS if o == "adamw"],
                   help="AdamW's learning rates (default: the demo's 2e-3)")
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.02], help="Muon's learning rates")
    p.add_argument("--muon-nesterov", default="on", choices=["on", "off"],
                   help="torch.optim.Muon's nesterov (the default: on)")
    p.add_argument("--muon-adamw-lr", type=float, default=2e-3, help="the learning rate of Muon's AdamW")
    p.add_argument("--give", default="all", choices=["all", "muon", "adamw"],
                   help="with --precondition and muon: which of the pair the hook's state reads (the other's "
                   "gradients compressed as they are)")
    p.add_argument("--sgd-lrs", type=float, nargs="+", default=[0.1, 0.03],
                   help="SGD learning rates (plain DDP on the LM trains best at 0.5 of 0.03-1.0)")
    p.add_argument("--momentum-bases", default="auto",
                   help="Muon's matrices in their momentum's bases (OnebitCompressHookState's "
                   "momentum_bases): 'auto' (the default), 'none', or new bases every this many iterations")
    p.add_argument("--momentum-share", default="auto",
                   help="OnebitCompressHookState's momentum_share: 'auto' (the default) or a number, 0-1")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="default: bench/out/ddp_hook[-mlp]")
    p.add_argument("--reuse", action="store_true", help="keep logs that already have a final line")
    p.add_argument("--error-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the hook's error buffers ('default': the library's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", choices=["sgd", "adamw", "muon"], help=argparse.SUPPRESS)
    p.add_argument("--hook", choices=["ddp", "onebit"], help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    p.add_argument("--log-jsonl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.out is None:
        args.out = os.path.join(HERE, "out", "ddp_hook" + ("" if args.task == "lm" else f"-{args.task}"))
    os.makedirs(args.out, exist_ok=True)
    pairs = [("adamw", lr) for lr in args.adamw_lrs] if "adamw" in args.optimizers else []
    pairs = [("sgd", lr) for lr in args.sgd_lrs if "sgd" in args.optimizers] + pairs
    pairs += [("muon", lr) for lr in args.muon_lrs] if "muon" in args.optimizers else []
    logs = {}
    for seed in args.seeds:
        for optimizer, lr in pairs:
            for hook in HOOKS:
                tag = f"-block{args.block}" if hook == "onebit" else ""
                tag += "-pre" if hook == "onebit" and args.precondition and optimizer != "sgd" else ""
                given = hook == "onebit" and optimizer == "muon" and args.give != "all"
                tag += f"-{args.give}" if given else ""
                frozen = hook == "onebit" and args.freeze_step and optimizer != "sgd"
                tag += f"-frz{args.freeze_step}" if frozen else ""
                tag += "-mom" if hook == "onebit" and args.precondition and optimizer == "sgd" else ""
                tag += f"-{args.error_dtype}" if hook == "onebit" and args.error_dtype != "default" else ""
                turned = hook == "onebit" and optimizer == "muon" and args.momentum_bases != "auto"
                tag += f"-bases{args.momentum_bases}" if turned else ""
                shared = hook == "onebit" and args.momentum_share != "auto"
                tag += f"-share{args.momentum_share}" if shared else ""
                tag += "-nesterovoff" if optimizer == "muon" and args.muon_nesterov == "off" else ""
                name = f"{optimizer}-{lr:g}-{hook}{tag}" + (f"-seed{seed}" if seed else "")
                path = os.path.join(args.out, f"{name}.jsonl")
                logs[(seed, optimizer, lr, hook)] = _run(args, optimizer, lr, hook, seed, path)
    meta = provenance(None, task=args.task, block=args.block, error_dtype=args.error_dtype)
    table = []
    print("| optimizer (lr) | seed | plain DDP final val loss | onebit_compress_hook final val loss | "
          "ratio | "
          "train loss, last 10% of steps (plain / hook) | val accuracy (plain / hook) | "
          "onebit_compress_hook: last finite step | bytes sent per rank, compressed iterations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for optimizer, lr in pairs:
        for seed in args.seeds:
            base, mine = (_final_val(logs[(seed, optimizer, lr, hook)]) for hook in HOOKS)
            finite = _last_finite_step(logs[(seed, optimizer, lr, "onebit")])
            stats = logs[(seed, optimizer, lr, "onebit")][-1]["stats"]
            tails = [_train_tail(logs[(seed, optimizer, lr, hook)]) for hook in HOOKS]
            accs = [_final(logs[(seed, optimizer, lr, hook)], "val_accuracy") for hook in HOOKS]
            table.append({**meta, "optimizer": optimizer, "lr": lr, "seed": seed, "steps": args.steps,
                          "ranks": args.ranks, "ddp_val_loss": f"{base:.4f}",
                          "onebit_hook_val_loss": f"{mine:.4f}", "ratio": f"{mine / base:.4f}",
                          "ddp_train_tail": f"{tails[0]:.4f}", "onebit_hook_train_tail": f"{tails[1]:.4f}",
                          "ddp_val_accuracy": accs[0], "onebit_hook_val_accuracy": accs[1],
                          "onebit_last_finite_step": finite, "bytes_compressed": stats["bytes_compressed"],
                          "bytes_full": stats["bytes_full"], "buckets": stats["buckets"]})
            acc = "-" if accs[0] is None else f"{accs[0]:.4f} / {accs[1]:.4f}"
            print(f"| {optimizer} ({lr:g}) | {seed} | {base:.4f} | {mine:.4f} | {mine / base:.4f} | "
                  f"{tails[0]:.4f} / {tails[1]:.4f} | {acc} | {finite} | "
                  f"{stats['bytes_compressed']:,} (+ {stats['bytes_full']:,} full precision) |")
    write_csv(os.path.join(args.out, "ddp_hook.csv"), table)
    logs = {k[1:]: v for k, v in logs.items() if k[0] == args.seeds[0]}  # the plot: the first seed
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4), squeeze=False)
        for ax, (optimizer, lr) in zip(axes[0], pairs, strict=True):
            for hook in HOOKS:
                rows = [r for r in logs[(optimizer, lr, hook)] if r.get("val_loss") is not None]
                ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], marker="o",
                        label="plain DDP" if hook == "ddp" else
                        "onebit_compress_hook" + (", optimizer=opt" if args.precondition else ""))
            ax.set_title(f"{optimizer} (lr {lr:g}), {args.ranks} gloo ranks")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            if args.task == "lm":
                ax.set_ylim(1.0, 4.0)  # a diverging run leaves the plot upwards
            else:
                ax.set_ylim(0.0, 1.0)
            ax.legend()
        fig.tight_layout()
        save_png(fig, os.path.join(args.out, "ddp_hook.png"))


def _block(text: str) -> int | None:
    return None if text == "none" else int(text)


def _dtype(args) -> dict:
    """The hook state's ``error_dtype`` from --error-dtype ('default': none given)."""
    import torch

    return {} if args.error_dtype == "default" else {"error_dtype": getattr(torch, args.error_dtype)}


def _bases(args):
    """--momentum-bases as OnebitCompressHookState's momentum_bases."""
    return None if args.momentum_bases == "none" else (
        "auto" if args.momentum_bases == "auto" else int(args.momentum_bases))


def _share(args) -> dict:
    """--momentum-share as OnebitCompressHookState's momentum_share (absent: the library's default)."""
    return {} if args.momentum_share == "auto" else {"momentum_share": float(args.momentum_share)}


def _run(args, optimizer: str, lr: float, hook: str, seed: int, path: str) -> list[dict]:
    """One torchrun of the worker unless --reuse finds a finished log; returns its rows."""
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    if args.reuse and rows and rows[-1].get("final"):
        return rows
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.ranks), os.path.abspath(__file__), "--worker", "--optimizer", optimizer,
           "--hook", hook, "--lr", str(lr), "--log-jsonl", path, "--task", args.task, "--block", args.block,
           "--steps", str(args.steps), "--eval-every", str(args.eval_every),
           "--bucket-cap-mb", str(args.bucket_cap_mb), "--start-iter", str(args.start_iter),
           "--seed", str(seed), "--freeze-step", str(args.freeze_step),
           "--error-dtype", args.error_dtype, "--muon-adamw-lr", str(args.muon_adamw_lr),
           "--give", args.give, "--momentum-bases", args.momentum_bases,
           "--muon-nesterov", args.muon_nesterov, "--momentum-share", args.momentum_share] + (
               ["--precondition"] if args.precondition else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{optimizer} {lr:g} {hook} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in open(path)]


def _final_val(rows: list[dict]) -> float:
    return [r for r in rows if r.get("val_loss") is not None][-1]["val_loss"]  # NaN stays NaN


def _final(rows: list[dict], key: str) -> float | None:
    """The last logged value of ``key`` (None in logs written before it was logged)."""
    found = [r[key] for r in rows if r.get(key) is not None]
    return found[-1] if found else None


def _train_tail(rows: list[dict]) -> float:
    """Mean training loss over the last 10% of the steps (how far the optimisation got)."""
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def _last_finite_step(rows: list[dict]) -> int:
    steps = [r["step"] for r in rows if "step" in r and math.isfinite(r["train_loss"])]
    return steps[-1] if steps else 0


if __name__ == "__main__":
    main()
