"""DiLoCo on the demo's LM at W = 4: DDP-Adam, DiLoCo with float32 pseudo-gradients, DiLoCo with
1-bit pseudo-gradients (H in {10, 50}, streaming on and off). Final validation loss (all
ranks' held-out windows), bytes per rank per inner step (counted), wall time per inner step on
emulated links (the ranks in a network namespace of their own with a shaped loopback, as in
bench_allreduce.py).

  python bench/bench_diloco.py --steps 1000 --links none          # losses (the link changes none)
  python bench/bench_diloco.py --task digits --steps 600 --links none
  python bench/bench_diloco.py --steps 100 --links 100mbit 1gbit  # wall time per inner step
  python bench/bench_diloco.py --inner muon --only ddp_adam diloco_fp32_10 diloco_1bit_10  # Muon + AdamW

Runs: ddp_adam (torch DDP, AdamW: a float32 gradient all-reduce every step); diloco_fp32_H,
diloco_1bit_H (sync_every H, one fragment); diloco_fp32_H_stream, diloco_1bit_H_stream (2
fragments at H = 10, 5 at H = 50, delay 2, mixing 0.5 or --mixing). Inner AdamW as the demo's
Adam (lr 2e-3, betas 0.9/0.99), outer SGD lr 0.7, momentum 0.9, Nesterov (DiLoCo's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_allreduce import LINKS, Namespace, can_shape  # noqa: E402


def runs(hs: list[int]) -> dict[str, dict]:
    out = {"ddp_adam": {"kind": "ddp"}}
    for H in hs:
        out[f"diloco_fp32_{H}"] = {"kind": "diloco", "H": H, "compress": False}
        out[f"diloco_1bit_{H}"] = {"kind": "diloco", "H": H, "compress": True}
        F = 5 if H % 5 == 0 and H >= 25 else 2  # fragments synced every H / F steps
        for tag, compress in (("fp32", False), ("1bit", True)):
            out[f"diloco_{tag}_{H}_stream"] = {"kind": "diloco", "H": H, "compress": compress, "fragments": F,
                                               "delay": 2}
    return out


# --------------------------------------------------------------------------- child (one rank)
def _inner(model, args):
    """The inner optimizer: AdamW (the demo's Adam), or Muon on the hidden matrices with an AdamW on the
    rest (embeddings, norms, biases, the head) as one ``Combined`` optimizer."""
    import torch

    if args.inner == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    from _common import muon_split

    from onebit.optimizers import Combined

    hidden, rest = muon_split(model)
    return Combined([torch.optim.Muon(hidden, lr=args.muon_lr, momentum=0.95, weight_decay=0.0),
                     torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)])


def child(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_lm import GPT, TRAIN_FILES, VALID_FILES, batch, evaluate, load_bytes

    from onebit.collectives import ring_allreduce_bytes
    from onebit.optimizers import DiLoCo

    run = json.loads(args.config)
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(1000 * (args.seed + 1) + rank + 1)  # each rank its own samples
    if args.task == "lm":
        model = GPT(args.context, args.d_model, args.layers, args.heads)
        train, valid = load_bytes(TRAIN_FILES), load_bytes(VALID_FILES)

        def step_batch():
            return batch(train, args.batch, args.context, g, "cpu")

        def validation() -> float:
            return evaluate(model, valid, args, "cpu")
    else:  # a task of bench/train_task.py (digits: an MLP classifier on the UCI digits, bench/data/)
        import train_task

        load, build, size = train_task.TASKS[args.task]
        (xt, yt), held_out = load()
        torch.manual_seed(args.seed)
        model = build()

        def step_batch():
            i = torch.randint(0, len(yt), (size,), generator=g)
            return xt[i], yt[i]

        def validation() -> float:
            return train_task.evaluate(model, held_out)
    n = sum(p.numel() for p in model.parameters())
    inner = _inner(model, args)
    if run["kind"] == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = inner
    else:
        net = model
        outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
        opt = DiLoCo(model, inner, outer, sync_every=run["H"], compress=run["compress"],
                     fragments=run.get("fragments", 1), delay=run.get("delay", 0),
                     mixing=args.mixing if run.get("fragments", 1) > 1 else 0.0,
                     momentum_share={"auto": "auto", "plain": 0.0, "momentum": 1.0}[args.form],
                     error_decay=args.error_decay, error_dtype=getattr(torch, args.error_dtype))
    from onebit.movement import MovementMeter

    meter = MovementMeter(model.parameters())  # coordinates that stop after the first sync
    first_sync = run.get("H", 1)
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = step_batch()
        out = net(x)
        if args.task == "lm":
            out, y = out.flatten(0, 1), y.flatten()
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
        if step == first_sync:
            meter.mark(step)
    dist.barrier()
    seconds = time.perf_counter() - t0
    val = torch.tensor([validation()])
    dist.all_reduce(val)
    if run["kind"] == "ddp":
        per_step = ring_allreduce_bytes(n, W)
    else:
        per_step = opt.stats()["bytes_per_inner_step"]
    moved = meter.report()
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"val_loss": val.item() / W, "bytes_per_inner_step": per_step, "params": n,
                       "ms_per_inner_step": 1e3 * seconds / args.steps,
                       "syncs": None if run["kind"] == "ddp" else opt.syncs,
                       **{k: moved[k] for k in ("stalled", "moved_before")}}, fh)
    from onebit import finish

    finish()  # barrier, destroy, exit without finalisation (docs/failures.md)


# --------------------------------------------------------------------------- parent
def launch(name: str, run: dict, link: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           os.path.abspath(__file__), "--child", "--config", json.dumps(run), "--out", out,
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("task", "inner", "muon_lr", "seed", "steps", "lr", "outer_lr", "mixing", "batch", "context",
              "d_model", "layers", "heads", "eval_batches", "form", "error_decay", "error_dtype")]]
    ns = Namespace(LINKS[link]) if LINKS[link] is not None or can_shape() is None else None
    try:
        done = subprocess.run((ns.prefix() if ns else []) + ["env", "OMP_NUM_THREADS=1", *cmd],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{name} on {link} failed:\n{done.stderr[-3000:]}")
        with open(out) as fh:
            return json.load(fh)
    finally:
        if ns:
            ns.close()
        os.unlink(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="lm", help="lm (the demo's) or a bench/train_task.py task (digits)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    p.add_argument("--H", type=int, nargs="+", default=[10, 50])
    p.add_argument("--only", nargs="+", default=None, help="run names (default: all)")
    p.add_argument("--links", nargs="+", default=["none"], choices=list(LINKS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate (the inner AdamW's, or "
                   "the AdamW half of --inner muon)")
    p.add_argument("--inner", choices=["adamw", "muon"], default="adamw",
                   help="the inner optimizer (and DDP's): AdamW, or Muon on the hidden matrices + AdamW on "
                        "the rest (onebit.optimizers.Combined)")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate (--inner muon)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--mixing", type=float, default=0.5)
    p.add_argument("--form", choices=["auto", "plain", "momentum"], default="auto",
                   help="1-bit runs: DiLoCo's momentum_share: auto (the default: g = 1 - outer lr), "
                        "plain (0: the bare pseudo-gradient) or momentum (1: it plus the outer momentum)")
    p.add_argument("--error-decay", type=float, default=0.5,
                   help="1-bit runs: DiLoCo's error_decay (the buffers times 1 - (1 - it)(1 - g) per sync)")
    p.add_argument("--error-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="1-bit runs: DiLoCo's error buffers (bfloat16 is its default)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--jsonl", default=os.path.join(HERE, "out", "diloco.jsonl"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    shaped = [link for link in args.links if LINKS[link] is not None]
    if shaped and can_shape() is not None:
        sys.exit(f"cannot shape links here: {can_shape()}")
    os.makedirs(os.path.dirname(args.jsonl), exist_ok=True)
    table = runs(args.H)
    names = args.only or list(table)
    print(f"{'run':>22} {'link':>8} | val loss | bytes/inner step | ms/inner step | syncs")
    for link in args.links:
        for name in names:
            got = launch(name, table[name], link, args)
            row = {"run": name, "task": args.task, "inner": args.inner,
                   **({"muon_lr": args.muon_lr} if args.inner == "muon" else {}), "seed": args.seed,
                   "outer_lr": args.outer_lr, "link": link,
                   "form": args.form, "error_decay": args.error_decay, "error_dtype": args.error_dtype,
                   "steps": args.steps, "ranks": args.ranks, **table[name], **got}
            with open(args.jsonl, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{name:>22} {link:>8} | {got['val_loss']:8.4f} | {got['bytes_per_inner_step']:16,.0f} | "
                  f"{got['ms_per_inner_step']:13.1f} | {got['syncs']}", flush=True)


if __name__ == "__main__":
    main()
