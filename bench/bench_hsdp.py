"""Sharded models: the 1-bit optimizers and the AdamW hooks on a 2 x 2 HSDP mesh (issue 36).

4 gloo ranks on CPU, ``fully_shard(model, mesh=mesh)`` over a 2-D mesh ("replicate", "shard"), on
scikit-learn's digits (1,000 training images, 797 for validation): a ReLU MLP 64-128-128-10 with
dropout 0.2, batch 16 per rank, 600 steps, lr 2e-3, weight decay 0.01, no clipping. Runs:

  adamw       torch.optim.AdamW, FSDP's own HSDP reduction (full precision across replicas)
  onebit_adam OnebitAdam(bias_correction=True, freeze_step=150) on the DTensor parameters
  adamw_hook  AdamW + register_fsdp_hooks(model, optimizer=opt, freeze_step=150)

For each run: the final validation loss (the same on every rank), whether the full tensors are
bitwise identical on all ranks, the share of coordinates that did not move in the last 100
steps, and the bytes each rank sent across replicas per step, counted
from outside onebit (tests/helpers.py WireCounter: every torch.distributed call over the
replicate group's ranks, FSDP's and onebit's).

    python bench/bench_hsdp.py --seeds 0 1 2        # rows appended to bench/results/hsdp/rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _common import provenance  # noqa: E402

RUNS = ("adamw", "onebit_adam", "adamw_hook")
OUT = os.path.join(HERE, "results", "hsdp", "rows.jsonl")


def _model(mesh, seed):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(128, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank(rank: int, world: int, init: str, run: str, seed: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist
    from helpers import WireCounter
    from torch.distributed.device_mesh import init_device_mesh
    from train_task import digits_data

    from onebit.collectives import register_fsdp_hooks
    from onebit.optimizers import OnebitAdam

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    (xt, yt), (xv, yv) = digits_data()
    model = _model(mesh, seed)
    hooks = None
    if run == "onebit_adam":
        opt = OnebitAdam(model.parameters(), lr=args.lr, weight_decay=0.01, bias_correction=True,
                         freeze_step=args.freeze)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if run == "adamw_hook":
            hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=args.freeze)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    torch.manual_seed(seed * 7919 + rank)  # dropout masks: each rank its own
    per_step = []
    start = time.perf_counter()
    window = None
    with WireCounter(mesh.get_group("replicate")) as wire:
        for step in range(args.steps):
            if step == args.steps - 100:
                window = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
            i = torch.randint(0, len(yt), (args.batch,), generator=g)
            opt.zero_grad()
            before = wire.bytes
            torch.nn.functional.cross_entropy(model(xt[i]), yt[i]).backward()
            opt.step()
            per_step.append(wire.bytes - before)
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val = torch.nn.functional.cross_entropy(model(xv), yv).item()
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    stalled = float((flat == window).float().mean())  # coordinates that did not move in the last 100 steps
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    identical = all(torch.equal(parts[0], q) for q in parts)
    F = args.freeze
    stats = opt.stats() if run == "onebit_adam" else hooks.stats() if hooks is not None else {}
    row = {"run": run, "seed": seed, "val_loss": val, "val_acc": acc, "identical": identical,
           "bytes_per_step_warmup": statistics.mean(per_step[1:F]),
           "bytes_per_step_after": statistics.mean(per_step[F:]), "bytes_total": sum(per_step),
           "bytes_compressed_own_count": stats.get("bytes_compressed", 0), "seconds": seconds,
           "stalled_last_100": stalled}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(row, fh)
    del model, opt, hooks
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--freeze", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    info = provenance(command="python bench/bench_hsdp.py " + " ".join(sys.argv[1:]))
    rows = []
    for seed in args.seeds:
        for run in args.runs:
            with tempfile.TemporaryDirectory() as tmp:
                result = os.path.join(tmp, "row.json")
                mp.spawn(_rank, args=(4, os.path.join(tmp, "init"), run, seed, args, result), nprocs=4)
                with open(result) as fh:
                    row = json.load(fh)
            row.update(steps=args.steps, freeze=args.freeze, lr=args.lr, batch=args.batch, **info)
            rows.append(row)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"seed {seed} {run:12s} val {row['val_loss']:.4f} acc {row['val_acc']:.3f} identical "
                  f"{row['identical']} bytes/step warm-up {row['bytes_per_step_warmup']:.0f} after "
                  f"{row['bytes_per_step_after']:.0f} stalled {row['stalled_last_100']:.4f} "
                  f"({row['seconds']:.0f} s)", flush=True)
    print("\n| seed | run | val loss | / AdamW | bytes/step after freeze | / AdamW's | identical |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        base = next((r for r in rows if r["seed"] == seed and r["run"] == "adamw"), None)
        for r in (r for r in rows if r["seed"] == seed):
            ratio = r["val_loss"] / base["val_loss"] if base else float("nan")
            wire = r["bytes_per_step_after"] / base["bytes_per_step_after"] if base else float("nan")
            print(f"| {seed} | {r['run']} | {r['val_loss']:.4f} | {ratio:.3f} | "
                  f"{r['bytes_per_step_after']:.0f} | 1/{1 / wire:.1f} | {r['identical']} |")


if __name__ == "__main__":
    main()
