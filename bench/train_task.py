"""Small real tasks for the convergence suite, trained data-parallel through torchrun.

  digits  scikit-learn's handwritten digits (8x8 images shipped inside the package, 1,797
          samples; 1,000 for training, 797 for validation), a ReLU MLP with dropout 0.2. Three
          pixels are zero in every image and some ReLU units die: coordinates with zero or
          tiny variance.
  words   next-word prediction on the Python standard library's sources (the demo's file
          selection), words hashed into a 32,768-row embedding table of which training
          touches 6,856 rows; validation files bring 575 rows that training never used.
          Predicts the 1,023 most frequent training words plus one class for the rest.

  python -m torch.distributed.run --standalone --nproc-per-node 4 bench/train_task.py \\
      --task digits --optimizer onebit_adam --steps 600 --freeze-step 120 --log-jsonl out.jsonl

Rank 0 appends one JSON line per step (step, training time, losses, stage) and a final line
with the optimizer's stats (skipped steps, masked coordinates, the step it froze at).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import math
import os
import re
import sys
import sysconfig
import time
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from onebit.movement import MovementMeter
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from train_lm import add_optimizer_options, optimizer_options  # noqa: E402  (the demo's CLI for them)

OPTIMIZERS = ["adam", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb"]
WORD_FILES_TRAIN = [
    "argparse.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "functools.py",
    "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "pprint.py", "random.py", "shutil.py", "string.py", "textwrap.py", "typing.py",
    "unittest/case.py", "urllib/parse.py",
]
WORD_FILES_VALID = ["ast.py", "csv.py", "enum.py"]
ROWS, CONTEXT, CLASSES = 32768, 8, 1024
DROPOUT = 0.2  # digits: without it the MLP fits the 1,000 images by step 150 and the validation
# loss then drifts with the logits' scale (a 2% comparison would measure that drift)


def digits_data():
    # scikit-learn's copy of the UCI digits (bench/data/README.md): the rows load_digits returns
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1], dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1000], y[:1000]), (x[1000:], y[1000:])


def digits_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(DROPOUT), nn.Linear(256, 256), nn.ReLU(),
                         nn.Dropout(DROPOUT), nn.Linear(256, 10))


_TOKEN = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")


def _words(files: list[str]) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            out += _TOKEN.findall(fh.read())
    return out


def words_data():
    train, valid = _words(WORD_FILES_TRAIN), _words(WORD_FILES_VALID)
    top = [w for w, _ in collections.Counter(train).most_common(CLASSES - 1)]
    label = {w: i for i, w in enumerate(top)}

    def encode(ws):
        ids = torch.tensor([zlib.crc32(w.encode()) % ROWS for w in ws], dtype=torch.int64)
        targets = torch.tensor([label.get(w, CLASSES - 1) for w in ws], dtype=torch.int64)
        windows = ids.unfold(0, CONTEXT, 1)[:-1]  # the CONTEXT words before each target
        return windows, targets[CONTEXT:]

    return encode(train), encode(valid)


class WordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, 32)
        self.mlp = nn.Sequential(nn.Linear(CONTEXT * 32, 256), nn.ReLU(), nn.Linear(256, CLASSES))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).flatten(1))


def mlp_model() -> nn.Module:
    """The 64-128-128-10 ReLU MLP without dropout on which the reference's frozen-variance
    LAMB stage fell apart (issue "Train without freezing coordinates")."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


TASKS = {"digits": (digits_data, digits_model, 32), "words": (words_data, WordModel, 64),
         "mlp": (digits_data, mlp_model, 32)}


def make_optimizer(name: str, params, lr: float, freeze, steps: int, kw: dict, var_update_scaler: int = 16):
    if name == "adam":
        return OnebitAdam(params, lr=lr, freeze_step=math.inf)
    if name == "lamb":
        return OnebitLamb(params, lr=lr, freeze_step=math.inf)
    if name == "onebit_adam":
        return OnebitAdam(params, lr=lr, freeze_step=freeze, **kw)
    if name == "onebit_lamb":
        return OnebitLamb(params, lr=lr, freeze_step=freeze, **kw)
    return ZeroOneAdam(params, lr=lr, var_freeze_step=freeze, local_step_scaler=max(1, steps // 10),
                       local_step_clipper=4, var_update_scaler=var_update_scaler, **kw)


def parse_freeze(text: str, steps: int):
    if text == "auto":
        return "auto"
    return int(text) if text else max(1, steps // 5)


@torch.no_grad()
def evaluate(model, data, chunk: int = 4096) -> float:
    model.eval()
    x, y = data
    total = 0.0
    for a in range(0, len(y), chunk):
        total += F.cross_entropy(model(x[a : a + chunk]), y[a : a + chunk], reduction="sum").item()
    model.train()
    return total / len(y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="onebit_adam")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--freeze-step", default="", help="an int, or 'auto' (default: 20%% of --steps)")
    p.add_argument("--lr", type=float, default=2e-3)
    add_optimizer_options(p)
    p.add_argument("--var-update-scaler", type=int, default=16, help="ZeroOneAdam's kappa")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-jsonl", default=None)
    p.add_argument("--per-node", type=int, default=None,
                   help="a 2-D mesh of nodes x this many ranks (onebit.collectives.node_mesh): full "
                   "precision inside a node, 1-bit between nodes")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    load, build, batch = TASKS[args.task]
    (xt, yt), valid = load()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = build()
    freeze = parse_freeze(args.freeze_step, args.steps)
    kw = optimizer_options(args)
    if args.per_node:
        from onebit.collectives import node_mesh

        kw["group"] = node_mesh(args.per_node)
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr, freeze, args.steps, kw,
                         args.var_update_scaler)
    meter = MovementMeter(model.parameters())
    mark_at = freeze if isinstance(freeze, int) else None  # baselines: the fixed freeze step
    g = torch.Generator().manual_seed(1000 * args.seed + rank + 1)  # each rank its own samples
    log = open(args.log_jsonl, "a") if args.log_jsonl and rank == 0 else None
    train_time = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            i = torch.randint(0, len(yt), (batch,), generator=g)
            loss = F.cross_entropy(model(xt[i]), yt[i])
            stage = "full precision" if opt.wants_averaged_gradients() else "compressed"
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_time += time.perf_counter() - t0
            if step == mark_at or opt.frozen_at is not None:
                meter.mark(step)
            val = evaluate(model, valid) if step % args.eval_every == 0 or step == args.steps else None
            if log is not None:
                log.write(json.dumps({"step": step, "time": train_time, "train_loss": loss.item(),
                                      "val_loss": val, "stage": stage}) + "\n")
    stats = opt.stats()
    if log is not None:
        log.write(json.dumps({"final": True, "stats": stats, "movement": meter.report(),
                              "warnings": sorted({str(w.message)[:300] for w in caught})}) + "\n")
        log.close()
        print(f"{args.task} {args.optimizer}: validation loss {val:.4f}, {json.dumps(stats)}")
    from onebit import finish  # gloo aborts at exit now and then without it (docs/failures.md)

    finish()


if __name__ == "__main__":
    main()
