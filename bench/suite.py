"""The convergence suite (``python bench/bench_convergence.py --suite``).

Three tasks, each trained at W ranks on gloo with: Adam and LAMB (the uncompressed
baselines: the same optimizers with the freeze at infinity), and OnebitAdam, ZeroOneAdam and
OnebitLamb, each once with the freeze at 20% of the run and once with ``"auto"``.

  lm      the demo's byte-level GPT on stdlib sources (examples/train_lm.py)
  digits  scikit-learn's digits, a ReLU MLP (zero pixels, dead units)   (bench/train_task.py)
  words   next word on stdlib sources, 32,768-row hashed embedding table (bench/train_task.py)

Per run: a JSONL log (per step, and a final line with the optimizer's stats). Then a CSV, a
Markdown table (final validation loss, ratio to the baseline, the step it froze at, skipped
steps, masked coordinates, and whether the run is within the 2% band, finite and never
skipped a step) and one plot of validation loss per task.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TASKS = {  # steps, evaluation interval
    "lm": (1500, 100),
    "digits": (600, 50),
    "words": (1000, 50),
}
ONEBIT = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb"}


def command(task: str, optimizer: str, freeze: str, steps: int, every: int, ranks: int,
            log: str) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    common = ["--optimizer", optimizer, "--steps", str(steps), "--freeze-step", freeze,
              "--eval-every", str(every), "--log-jsonl", log]
    if task == "lm":
        return launch + [os.path.join(ROOT, "examples", "train_lm.py"), *common, "--verify-every", "0"]
    return launch + [os.path.join(HERE, "train_task.py"), "--task", task, *common]


def runs(task: str) -> list[tuple[str, str]]:
    """(optimizer, freeze) pairs: the baselines once, each 1-bit optimizer fixed and auto."""
    steps = TASKS[task][0]
    fixed = str(steps // 5)
    out = [("adam", fixed), ("lamb", fixed)]
    for name in ONEBIT:
        out += [(name, fixed), (name, "auto")]
    return out


def read(log: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in open(log)]
    final = next((r for r in rows if r.get("final")), {})
    return [r for r in rows if not r.get("final")], final.get("stats", {})


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench_convergence.py --suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", default=os.path.join(HERE, "out", "suite"))
    p.add_argument("--band", type=float, default=0.02, help="allowed relative distance to the baseline")
    p.add_argument("--reuse", action="store_true", help="keep logs that already have a final line")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import torch

    meta = {"device": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "ranks": args.ranks}
    table = []
    for task in args.tasks:
        steps, every = TASKS[task]
        logs = {}
        for optimizer, freeze in runs(task):
            key = optimizer if optimizer in ("adam", "lamb") else f"{optimizer}@{freeze}"
            log = os.path.join(args.out, f"{task}-{key.replace('@', '-')}.jsonl")
            if not (args.reuse and os.path.exists(log) and read(log)[1]):
                if os.path.exists(log):
                    os.unlink(log)
                t0 = time.time()
                cmd = command(task, optimizer, freeze, steps, every, args.ranks, log)
                env = dict(os.environ, OMP_NUM_THREADS="1")
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    raise RuntimeError(f"{task} {key} failed:\n{out.stderr[-3000:]}")
                print(f"{task:7} {key:22} {time.time() - t0:6.1f} s", file=sys.stderr)
            logs[key] = read(log)
        for key, (rows, stats) in logs.items():
            vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
            final = vals[-1]
            base = ONEBIT.get(key.split("@")[0])
            ratio = final / logs[base][0][-1]["val_loss"] if base else None
            finite = all(math.isfinite(v) for v in vals) and all(math.isfinite(r["train_loss"]) for r in rows)
            ok = finite and stats.get("skipped_steps") == 0 and (ratio is None or abs(ratio - 1) <= args.band)
            table.append({**meta, "task": task, "steps": steps, "run": key, "final_val_loss": f"{final:.4f}",
                          "baseline": base or "", "ratio": "" if ratio is None else f"{ratio:.4f}",
                          "frozen_at": stats.get("frozen_at"), "skipped_steps": stats.get("skipped_steps"),
                          "masked": stats.get("masked_coordinates"), "coordinates": stats.get("coordinates"),
                          "finite": finite, "within_band": "" if base is None else ("yes" if ok else "NO"),
                          "train_seconds": f"{rows[-1]['time']:.1f}"})
        plot(task, logs, args.out)
    with open(os.path.join(args.out, "suite.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    print(f"| task | run | final val loss | baseline | ratio | froze at | skipped | masked / coordinates | "
          f"within {100 * args.band:g}% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['task']} | {r['run']} | {r['final_val_loss']} | {r['baseline']} | {r['ratio']} | "
              f"{r['frozen_at'] if r['frozen_at'] is not None else '-'} | {r['skipped_steps']} | "
              f"{r['masked']:,} / {r['coordinates']:,} | {r['within_band']} |")


def plot(task: str, logs: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plots", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key, (rows, _) in logs.items():
        val = [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
        style = "--" if key in ("adam", "lamb") else ("-" if key.endswith("auto") else ":")
        ax.plot([v[0] for v in val], [v[1] for v in val], style, marker="o", ms=2, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{task}: validation loss (fixed freeze dotted, auto solid, baselines dashed)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{task}.png"), dpi=110)
    plt.close(fig)
