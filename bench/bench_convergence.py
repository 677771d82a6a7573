"""Convergence: Adam vs OnebitAdam vs ZeroOneAdam, and LAMB vs OnebitLamb.

Default: the demo's task only (examples/train_lm.py through torchrun), the same seeds and data
order, the freeze at --freeze-fraction of the run. Writes the per-step logs (JSONL), a CSV of
the final validation losses with each 1-bit optimizer's ratio to its baseline, and plots of
training and validation loss against step and against training wall time.

  python bench/bench_convergence.py --steps 1200 --ranks 4

--suite: three tasks (the byte-level LM; bench/train_task.py's digits and words), each with
Adam and LAMB and the three 1-bit optimizers with the freeze at 20% of the run and with
freeze_step="auto": see bench/suite.py.

  python bench/bench_convergence.py --suite
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, pyplot, save_png, write_csv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = ["adam", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb"]
BASELINE = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb"}


def run(name: str, args, log_path: str) -> str:
    if os.path.exists(log_path):
        os.unlink(log_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           os.path.join(ROOT, "examples", "train_lm.py"), "--optimizer", name, "--steps", str(args.steps),
           "--freeze-step", str(int(args.steps * args.freeze_fraction)), "--eval-every", str(args.eval_every),
           "--log-jsonl", log_path, "--lr", str(args.lr), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def smooth(values: list[float], k: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--freeze-fraction", type=float, default=0.2)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    p.add_argument("--out", default=os.path.join(HERE, "out", "convergence"))
    p.add_argument("--suite", action="store_true", help="the three-task suite (bench/suite.py; "
                   "`--suite --help` lists its own options)")
    if "--suite" in sys.argv[1:]:
        import suite

        suite.main([a for a in sys.argv[1:] if a != "--suite"])
        return
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    logs, summary = {}, {}
    for name in args.runs:
        path = os.path.join(args.out, f"{name}.jsonl")
        stdout = run(name, args, path)
        logs[name] = [r for r in map(json.loads, open(path)) if not r.get("final")]
        summary[name] = stdout.strip().splitlines()[-4:]
        final = [r["val_loss"] for r in logs[name] if r["val_loss"] is not None][-1]
        print(f"{name:14} final validation loss {final:.4f}", file=sys.stderr)
    meta = provenance(None, ranks=args.ranks, steps=args.steps,
                      freeze_step=int(args.steps * args.freeze_fraction), lr=args.lr, seed=args.seed)
    rows = []
    for name, log in logs.items():
        final = [r["val_loss"] for r in log if r["val_loss"] is not None][-1]
        base = BASELINE.get(name)
        ratio = None
        if base in logs:
            ref = [r["val_loss"] for r in logs[base] if r["val_loss"] is not None][-1]
            ratio = final / ref
        stage_ms = {}
        for stage in ("full precision", "compressed"):
            times = [b["time"] - a["time"] for a, b in zip(log, log[1:], strict=False) if b["stage"] == stage]
            stage_ms[stage] = 1e3 * sum(times) / len(times) if times else None
        rows.append({**meta, "optimizer": name, "final_val_loss": f"{final:.4f}",
                     "baseline": base or "", "ratio_to_baseline": "" if ratio is None else f"{ratio:.4f}",
                     "train_seconds": f"{log[-1]['time']:.1f}",
                     "ms_per_full_precision_step": "" if stage_ms["full precision"] is None
                     else f"{stage_ms['full precision']:.1f}",
                     "ms_per_compressed_step": "" if stage_ms["compressed"] is None
                     else f"{stage_ms['compressed']:.1f}"})
    write_csv(os.path.join(args.out, "convergence.csv"), rows)
    print("| optimizer | final validation loss | baseline | ratio | train s | ms/step full | ms/step 1-bit |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['final_val_loss']} | {r['baseline']} | {r['ratio_to_baseline']} | "
              f"{r['train_seconds']} | {r['ms_per_full_precision_step']} | {r['ms_per_compressed_step']} |")
    plot(logs, args)


def plot(logs, args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for name, log in logs.items():
        steps = [r["step"] for r in log]
        times = [r["time"] for r in log]
        train = smooth([r["train_loss"] for r in log])
        val = [(r["step"], r["time"], r["val_loss"]) for r in log if r["val_loss"] is not None]
        style = "--" if name in ("adam", "lamb") else "-"
        axes[0][0].plot(steps, train, style, label=name)
        axes[0][1].plot(times, train, style, label=name)
        axes[1][0].plot([v[0] for v in val], [v[2] for v in val], style, marker="o", ms=3, label=name)
        axes[1][1].plot([v[1] for v in val], [v[2] for v in val], style, marker="o", ms=3, label=name)
    labels = [("step", "training loss (25-step mean)"), ("training seconds", "training loss"),
              ("step", "validation loss"), ("training seconds", "validation loss")]
    for ax, (x, y) in zip(axes.flat, labels, strict=True):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"byte-level GPT on stdlib sources, {args.ranks} ranks, freeze at "
                 f"{int(args.steps * args.freeze_fraction)} of {args.steps} steps")
    fig.tight_layout()
    path = os.path.join(args.out, "convergence.png")
    save_png(fig, path)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
