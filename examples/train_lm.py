"""A small GPT-style byte-level language model trained data-parallel with a 1-bit optimizer.

Data: source files of the Python standard library that every CPython has (the fixed
selection TRAIN_FILES / VALID_FILES below; split by file). Each rank samples its own
windows; the optimizer (OnebitAdam by default) does all the communication. Run through
torchrun (scripts/demo.sh does: 4 local ranks, gloo on CPU, NCCL when every rank has a GPU).

  --optimizer adam | onebit_adam | zero_one_adam | lamb | onebit_lamb
  (adam and lamb are the same algorithms with the freeze at infinity: full-precision
  gradient averaging every step, the uncompressed baselines)

Failure handling: collectives give up after --timeout seconds (a lost peer is usually
noticed at once); the first step runs the optimizer's rank agreement check; every
--verify-every steps the replicas are compared by fingerprint; --checkpoint-every K writes
per-rank checkpoints atomically and --resume continues from the newest step all ranks have.
--fault kill|hang|diverge|nan injects a fault on --fault-rank at --fault-step (for testing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from weights import fingerprint

from onebit import checkpoint, finish
from onebit.collectives import (
    CollectiveError,
    ReplicaMismatchError,
    node_mesh,
    ring_allreduce_bytes,
    traffic,
    verify_replicas,
)
from onebit.movement import MovementMeter
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

TRAIN_FILES = [
    "argparse.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "functools.py",
    "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "pprint.py", "random.py", "shutil.py", "string.py", "textwrap.py", "typing.py",
    "unittest/case.py", "urllib/parse.py",
]
VALID_FILES = ["ast.py", "csv.py", "enum.py"]


def load_bytes(files: list[str]) -> torch.Tensor:
    root = sysconfig.get_paths()["stdlib"]
    data = b"\n".join(open(os.path.join(root, f), "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class GPT(nn.Module):
    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        h = self.blocks(h, mask=self.mask[:T, :T], is_causal=True)
        return self.head(self.norm(h))


def batch(data: torch.Tensor, n: int, context: int, g: torch.Generator, device) -> tuple:
    starts = torch.randint(0, data.numel() - context - 1, (n,), generator=g)
    rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()]).to(device)
    return rows[:, :-1], rows[:, 1:]


def optimizer_options(args) -> dict:
    """The 1-bit optimizers' mode switches from the command line ('default' leaves one out)."""
    kw: dict = {}
    for name in ("auto_mask", "variance_floor", "update_clip", "block"):
        text = getattr(args, name)
        if text != "default":
            kw[name] = None if text == "none" else (int(text) if name == "block" else float(text))
    if args.compression != "default":
        kw["compression"] = args.compression
    if args.error_dtype != "default":
        kw["error_dtype"] = getattr(torch, args.error_dtype)
    if args.variance_dtype != "default":
        kw["variance_dtype"] = getattr(torch, args.variance_dtype)
    return kw


def add_optimizer_options(p: argparse.ArgumentParser) -> None:
    """The 1-bit optimizers' mode switches ('default': the library's; the reference's maths is
    --compression momentum --variance-floor none --auto-mask none)."""
    p.add_argument("--auto-mask", default="default", help="a ratio, 'none', or 'default'")
    p.add_argument("--compression", default="default", choices=["default", "preconditioned", "momentum"])
    p.add_argument("--variance-floor", default="default", help="a ratio, 'none', or 'default'")
    p.add_argument("--update-clip", default="default", help="a bound, 'none', or 'default'")
    p.add_argument("--block", default="default", help="elements per scale, 'none', or 'default'")
    p.add_argument("--error-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the error buffers' dtype")
    p.add_argument("--variance-dtype", default="default", choices=["default", "float32", "bfloat16"],
                   help="the frozen variance's dtype")


def make_optimizer(name: str, params, args):
    common = dict(lr=args.lr, weight_decay=args.weight_decay)
    freeze = args.freeze_step
    if name == "adam":
        return OnebitAdam(params, freeze_step=math.inf, betas=(0.9, 0.99), **common)
    if name == "lamb":
        return OnebitLamb(params, freeze_step=math.inf, betas=(0.9, 0.99), **common)
    common.update(optimizer_options(args))
    if args.per_node:  # nodes x per_node ranks: full precision inside a node, 1-bit between nodes
        common["group"] = node_mesh(args.per_node)
    if name == "onebit_adam":
        return OnebitAdam(params, freeze_step=freeze, betas=(0.9, 0.99), overlap=args.overlap,
                          bucket_cap_mb=args.bucket_cap_mb, **common)
    if name == "zero_one_adam":
        return ZeroOneAdam(params, var_freeze_step=freeze, betas=(0.9, 0.99), overlap=args.overlap,
                           bucket_cap_mb=args.bucket_cap_mb,
                           local_step_scaler=max(1, args.steps // 10), local_step_clipper=4, **common)
    return OnebitLamb(params, freeze_step=freeze, betas=(0.9, 0.99), **common)


def communicates_full(opt) -> bool:
    return opt.wants_averaged_gradients()


@torch.no_grad()
def evaluate(model, data, args, device) -> float:
    g = torch.Generator().manual_seed(12345)  # the same windows every time, on every rank
    losses = []
    for _ in range(args.eval_batches):
        x, y = batch(data, args.batch, args.context, g, device)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


def inject(args, step: int, rank: int, model) -> None:
    """The --fault options: called after backward, before the optimizer step."""
    if args.fault is None or step != args.fault_step or rank != args.fault_rank:
        return
    if args.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    first = next(model.parameters())
    if args.fault == "nan":
        first.grad.view(-1)[0] = float("nan")
    if args.fault == "diverge":
        first.data.view(-1)[0] += 1e-3


def main() -> None:
    try:
        train()
    except (CollectiveError, ReplicaMismatchError, FloatingPointError, ValueError) as exc:
        if isinstance(exc, ValueError) and not str(exc).startswith(("check:", "--resume")):
            raise  # a bug, not a fault: keep the traceback
        rank = dist.get_rank() if dist.is_initialized() else "?"
        sys.stdout.flush()
        sys.stderr.write(f"\nrank {rank}: {type(exc).__name__}: {exc}\n"
                         f"rank {rank}: stopping; restart all ranks with --resume to continue from the "
                         f"newest checkpoint every rank has\n")
        sys.stderr.flush()
        os._exit(3)  # no teardown: the process group may be broken


def train() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", default="onebit_adam",
                   choices=["adam", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", default=None,
                   help="an int, or 'auto': freeze when the variance settles (default: 20%% of --steps)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    add_optimizer_options(p)
    p.add_argument("--overlap", action="store_true", help="onebit_adam, zero_one_adam: start each "
                   "bucket's compressed all-reduce from backward (overlap=True)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="onebit_adam, zero_one_adam: bucket size")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=0, help="validation every N steps (0: at the end only)")
    p.add_argument("--log-jsonl", default=None, help="rank 0 appends one JSON line per step here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-node", type=int, default=None,
                   help="ranks per node: the 1-bit optimizers compress only between nodes, on a 2-D mesh "
                   "(nodes x per-node; on several machines, torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--checkpoint-dir", default=os.path.join("checkpoints", "train_lm"))
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint-dir")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective waits for a silent peer before every rank gives up")
    p.add_argument("--verify-every", type=int, default=50,
                   help="compare the replicas' weight fingerprints every N steps (0: never)")
    p.add_argument("--fault", choices=["kill", "hang", "diverge", "nan"], default=None,
                   help="inject a fault (testing): SIGKILL or SIGSTOP a rank, nudge one of its weights, "
                        "or give it a NaN gradient")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    args = p.parse_args()
    if args.freeze_step is None:
        args.freeze_step = max(1, args.steps // 5)
    elif args.freeze_step != "auto":
        args.freeze_step = int(args.freeze_step)

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = GPT(args.context, args.d_model, args.layers, args.heads).to(device)
    opt = make_optimizer(args.optimizer, model.parameters(), args)
    train, valid = load_bytes(TRAIN_FILES), load_bytes(VALID_FILES)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own data
    n_params = sum(p.numel() for p in model.parameters())
    full_bytes = ring_allreduce_bytes(n_params, W)  # one float32 gradient all-reduce
    traffic.reset()
    stage_time = {"full precision": [0.0, 0], "compressed": [0.0, 0]}
    if rank == 0:
        print(f"{args.optimizer}: {n_params} parameters, {W} ranks ({dist.get_backend()}), "
              f"{args.steps} steps, freeze at {args.freeze_step}, {train.numel()} training bytes")
    first = 1
    if args.resume:
        found = checkpoint.load_latest(args.checkpoint_dir)
        if found is None:
            raise ValueError(f"--resume: no step has a checkpoint from every rank in {args.checkpoint_dir}")
        saved_step, ckpt = found
        if ckpt["optimizer_name"] != args.optimizer:
            raise ValueError(f"--resume: the checkpoint was written by {ckpt['optimizer_name']}, "
                             f"not {args.optimizer}")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        g.set_state(ckpt["data_rng"])
        first = saved_step + 1
        if rank == 0:
            print(f"resumed from step {saved_step}")
    log = open(args.log_jsonl, "a") if args.log_jsonl and rank == 0 else None
    meter = MovementMeter(model.parameters())  # which weights still move after the freeze
    mark_at = args.freeze_step if isinstance(args.freeze_step, int) else None
    before = {k: v for k, v in opt.stats().items() if k.startswith(("bytes_", "seconds_"))}  # after a resume
    t_start = time.perf_counter()
    for step in range(first, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(train, args.batch, args.context, g, device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        inject(args, step, rank, model)
        full = communicates_full(opt)
        t_opt = time.perf_counter()
        opt.step(check=step == first)  # the first step verifies that all ranks agree
        opt_seconds = time.perf_counter() - t_opt  # Adam: the gradient all-reduce + a small update
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stage = "full precision" if full else "compressed"
        step_seconds = time.perf_counter() - t0
        if step == mark_at or opt.frozen_at is not None:
            meter.mark(step)
        stage_time[stage][0] += step_seconds
        stage_time[stage][1] += 1
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            v = torch.tensor([evaluate(model, valid, args, device)], device=device)
            dist.all_reduce(v)
            val_now = v.item() / W
        else:
            val_now = None
        if log is not None:
            train_time = sum(secs for secs, _ in stage_time.values())  # excludes validation
            log.write(json.dumps({"step": step, "time": train_time, "train_loss": loss.item(),
                                  "val_loss": val_now, "stage": stage, "step_seconds": step_seconds,
                                  "opt_seconds": opt_seconds}) + "\n")
        if args.verify_every and step % args.verify_every == 0 and opt.replicas_identical:
            verify_replicas(model)  # raises on every rank, naming the first differing weight
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "data_rng": g.get_state(), "optimizer_name": args.optimizer},
                            args.checkpoint_dir, step)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            done = step / args.steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            sys.stdout.write(f"\r[{bar}] {step}/{args.steps} loss {loss.item():.3f} ({stage})")
            sys.stdout.flush()
    elapsed = time.perf_counter() - t_start
    if log is not None:
        log.write(json.dumps({"final": True, "stats": opt.stats(), "movement": meter.report()}) + "\n")
        log.close()
    val = evaluate(model, valid, args, device)
    val_t = torch.tensor([val], device=device)
    dist.all_reduce(val_t)
    if rank == 0:
        tokens = (args.steps - first + 1) * args.batch * args.context * W
        print(f"\nvalidation loss {val_t.item() / W:.4f} (nats/byte), {tokens / elapsed:,.0f} tokens/s, "
              f"weights fingerprint {fingerprint(model)}")
        for stage, (secs, count) in stage_time.items():
            if count:
                print(f"  {stage:>14} steps: {count:4d}, {1e3 * secs / count:8.1f} ms/step")
        stats = opt.stats()
        print(f"  froze at {stats.get('frozen_at')}, {stats['skipped_steps']} steps skipped, "
              f"{stats['masked_coordinates']:,} of {stats['coordinates']:,} coordinates masked, "
              f"{stats['floored_coordinates']:,} with their sqrt(v) floored")
        moved = meter.report()
        if moved["marked_at"] is not None and not args.resume:
            print(f"  of the {moved['moved_before']:,} weights that moved before step {moved['marked_at']}, "
                  f"{moved['stalled']:,} ({100 * moved['stalled_share']:.2f}%) never moved after it")
        total = traffic.full + traffic.compressed
        baseline = (args.steps - first + 1) * full_bytes
        print(f"  bytes sent per rank (counted): {traffic.full / 1e6:.2f} MB full precision + "
              f"{traffic.compressed / 1e6:.2f} MB 1-bit = {total / 1e6:.2f} MB; a float32 all-reduce every "
              f"step would send {baseline / 1e6:.2f} MB ({baseline / max(total, 1):.1f}x)")
        if args.per_node:
            print(f"  on {W // args.per_node} nodes x {args.per_node}: the 1-bit bytes cross between nodes; "
                  f"{traffic.intra / 1e6:.2f} MB more stayed inside the node in full precision")
        print_projection({k: stats[k] - before.get(k, 0) for k in before}, stage_time, full_bytes)
    finish()


def print_projection(stats: dict, stage_time: dict, full_bytes: int) -> None:
    """What the measured steps would cost on real links (onebit.advise's model, counted bytes
    and seconds of this run: ``stats`` holds the bytes_* and seconds_* since its first step):
    each rank's bytes on a link of its own, no latency, no overlap."""
    from onebit.advise.model import project_step

    secs, count = stage_time["compressed"]
    if not count or not stats["bytes_compressed"]:
        print("  projection to real links: no compressed step in this run (raise --steps or lower "
              "--freeze-step)")
        return
    codec = stats["seconds_codec"] / count  # compression's compute per compressed step
    comm = stats["seconds_comm"] / count  # its collectives, as they ran here (loopback)
    compute = max(secs / count - codec - comm, 0.0)
    onebit_bytes = stats["bytes_compressed"] / count
    print(f"  projected per step on real links (compute {1e3 * compute:.1f} ms and compression "
          f"{1e3 * codec:.1f} ms as measured here; each rank's bytes on its own link: "
          f"{full_bytes / 1e6:.2f} MB float32, {onebit_bytes / 1e6:.3f} MB 1-bit):")
    for name, bps in (("100 Mbit/s", 100e6), ("1 Gbit/s", 1e9), ("10 Gbit/s", 10e9)):
        dense, onebit = project_step(bps, compute, full_bytes, onebit_bytes, codec)
        print(f"  {name:>12}: float32 all-reduce {1e3 * (dense - compute):7.1f} ms/step, step "
              f"{1e3 * dense:7.1f} ms; 1-bit {1e3 * (onebit - compute):6.1f} ms/step, step "
              f"{1e3 * onebit:7.1f} ms ({dense / onebit:.2f}x)")


if __name__ == "__main__":
    main()
