"""The convergence suite (``python bench/bench_convergence.py --suite``).

Three tasks, each trained at W ranks on gloo with: Adam and LAMB (the uncompressed
baselines: the same optimizers with the freeze at infinity), and OnebitAdam, ZeroOneAdam and
OnebitLamb, each once with the freeze at 20% of the run and once with ``"auto"``.

  lm      the demo's byte-level GPT on stdlib sources (examples/train_lm.py)
  digits  scikit-learn's digits, a ReLU MLP (zero pixels, dead units)   (bench/train_task.py)
  words   next word on stdlib sources, 32,768-row hashed embedding table (bench/train_task.py)
  mlp     digits with a 64-128-128-10 ReLU MLP, no dropout: where the reference's frozen-variance
          LAMB stage fell apart                                         (bench/train_task.py)

Per run: a JSONL log (per step, and a final line with the optimizer's stats). Then a CSV, a
Markdown table (final validation loss, ratio to the baseline, the step it froze at, skipped
steps, masked and floored coordinates, the stalled share, and whether the run is within the
band, finite, never skipped a step and stalled at most --stall-band more than its baseline)
and one plot of validation loss per task.

"Stalled" (onebit.movement.MovementMeter): among the coordinates that moved before the freeze
(the baselines: before the fixed freeze step), the share that never moves after it. The
baseline's own share (coordinates whose gradient stops, e.g. dead units) is the floor.

Learning rates: one per task and optimizer family (Adam-type, LAMB-type), the same for a
baseline and its 1-bit runs. Seeds: tasks whose final validation loss varies between seeds
by more than the band (digits: 797 validation images, +-9% between seeds at 600 steps) run
every configuration with several seeds; the table compares means over seeds and prints the
baseline's own spread. "Within the band": the 1-bit run's final validation loss is at most
``1 + band`` times its baseline's (a lower loss passes; the ratio shows by how much).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, pyplot, save_png, write_csv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TASKS = {  # steps, evaluation interval, learning rate per family, seeds
    "lm": (1500, 100, {"adam": 2e-3, "lamb": 2e-3}, (0,)),
    # digits: 8 seeds. Its final validation loss spreads by +-20% from seed to seed (dropout,
    # 797 validation images, a training loss below 0.02), so the mean of 3 seeds moved a 1-bit
    # run's ratio to its baseline by about 10%: OnebitLamb measured 1.099 on seeds 0-2 and
    # 1.0005 on seeds 0-7 (bench/HISTORY.md, issue 21)
    "digits": (600, 50, {"adam": 2e-3, "lamb": 5e-3}, tuple(range(8))),
    "words": (1000, 50, {"adam": 2e-3, "lamb": 2e-3}, (0,)),
    "mlp": (600, 50, {"adam": 2e-3, "lamb": 2e-3}, (0, 1, 2)),
}
ONEBIT = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb"}


def command(task: str, optimizer: str, freeze: str, seed: int, ranks: int, log: str,
            options: list[str] = ()) -> list[str]:
    steps, every, lrs, _ = TASKS[task]
    lr = lrs[ONEBIT.get(optimizer, optimizer)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    common = ["--optimizer", optimizer, "--steps", str(steps), "--freeze-step", freeze,
              "--eval-every", str(every), "--log-jsonl", log, "--seed", str(seed), "--lr", str(lr),
              *options]
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
    """The per-step rows and the final line's stats (with its movement report under 'movement')."""
    rows = [json.loads(line) for line in open(log)]
    final = next((r for r in rows if r.get("final")), {})
    stats = dict(final.get("stats", {}))
    if final:
        stats["movement"] = final.get("movement", {})
    return [r for r in rows if not r.get("final")], stats


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench_convergence.py --suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", default=os.path.join(HERE, "out", "suite"))
    p.add_argument("--band", type=float, default=0.02, help="allowed relative distance to the baseline")
    p.add_argument("--reuse", action="store_true", help="keep logs that already have a final line")
    p.add_argument("--stall-band", type=float, default=0.01,
                   help="stalled share allowed above the baseline's")
    for flag in ("--auto-mask", "--compression", "--variance-floor", "--update-clip", "--block",
                 "--error-dtype", "--variance-dtype"):
        p.add_argument(flag, default="default", help="passed to the 1-bit runs ('default': the library's); "
                       "with another --out, copy the baselines' logs there and --reuse them")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    names = ("auto_mask", "compression", "variance_floor", "update_clip", "block", "error_dtype",
             "variance_dtype")
    modes = {k: getattr(args, k) for k in names}
    meta = provenance(None, ranks=args.ranks, **modes)
    table = []
    for task in args.tasks:
        steps, _, lrs, seeds = TASKS[task]
        logs: dict[str, list] = {}  # run -> [(rows, stats)] per seed
        for optimizer, freeze in runs(task):
            key = optimizer if optimizer in ("adam", "lamb") else f"{optimizer}@{freeze}"
            for seed in seeds:
                name = f"{task}-{key.replace('@', '-')}" + (f"-seed{seed}" if seed else "")
                log = os.path.join(args.out, f"{name}.jsonl")
                if not (args.reuse and os.path.exists(log) and read(log)[1]):
                    if os.path.exists(log):
                        os.unlink(log)
                    t0 = time.time()
                    env = dict(os.environ, OMP_NUM_THREADS="1")
                    options = [] if optimizer in ("adam", "lamb") else [
                        x for k, v in modes.items() for x in (f"--{k.replace('_', '-')}", v)]
                    cmd = command(task, optimizer, freeze, seed, args.ranks, log, options)
                    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if out.returncode != 0:
                        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
                    print(f"{name:34} {time.time() - t0:6.1f} s", file=sys.stderr)
                logs.setdefault(key, []).append(read(log))
        finals = {key: [final_loss(rows) for rows, _ in per_seed] for key, per_seed in logs.items()}
        for key, per_seed in logs.items():
            base = ONEBIT.get(key.split("@")[0])
            mean = sum(finals[key]) / len(finals[key])
            ratio = mean / (sum(finals[base]) / len(finals[base])) if base else None
            finite = all(math.isfinite(r[k]) for rows, _ in per_seed for r in rows
                         for k in ("train_loss", "val_loss") if r[k] is not None)
            skipped = sum(stats.get("skipped_steps", 0) for _, stats in per_seed)
            stalled = max(stalled_share(stats) for _, stats in per_seed)
            base_stalled = max(stalled_share(st) for _, st in logs[base]) if base else 0.0
            ok = finite and skipped == 0 and (ratio is None or ratio <= 1 + args.band)
            ok = ok and stalled <= base_stalled + args.stall_band
            stats = per_seed[0][1]
            table.append({**meta, "task": task, "steps": steps, "lr": lrs[ONEBIT.get(key.split("@")[0], key)],
                          "seeds": len(seeds), "run": key, "final_val_loss": f"{mean:.4f}",
                          "per_seed": " ".join(f"{v:.4f}" for v in finals[key]),
                          "seed_spread": f"{max(finals[key]) / min(finals[key]):.3f}",
                          "baseline": base or "", "ratio": "" if ratio is None else f"{ratio:.4f}",
                          "frozen_at": " ".join(str(st.get("frozen_at")) for _, st in per_seed),
                          "skipped_steps": skipped, "masked": stats.get("masked_coordinates"),
                          "floored": stats.get("floored_coordinates", 0), "stalled": f"{stalled:.4f}",
                          "coordinates": stats.get("coordinates"), "finite": finite,
                          "within_band": "" if base is None else ("yes" if ok else "NO"),
                          "train_seconds": f"{per_seed[0][0][-1]['time']:.1f}"})
        plot(task, {key: per_seed[0] for key, per_seed in logs.items()}, args.out)
    write_csv(os.path.join(args.out, "suite.csv"), table)
    print(f"| task | run | lr | final val loss (mean) | per seed | baseline | ratio | froze at | skipped | "
          f"masked / floored / coordinates | stalled (max over seeds) | at most +{100 * args.band:g}%, "
          f"stalled at most +{100 * args.stall_band:g} points |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['task']} | {r['run']} | {r['lr']:g} | {r['final_val_loss']} | "
              f"{r['per_seed']} | "
              f"{r['baseline']} | {r['ratio']} | {r['frozen_at'] if r['baseline'] else '-'} | "
              f"{r['skipped_steps']} | {r['masked']:,} / {r['floored']:,} / {r['coordinates']:,} | "
              f"{100 * float(r['stalled']):.2f}% | {r['within_band']} |")


def stalled_share(stats: dict) -> float:
    return float(stats.get("movement", {}).get("stalled_share", 0.0))


def final_loss(rows: list[dict]) -> float:
    return [r["val_loss"] for r in rows if r["val_loss"] is not None][-1]


def plot(task: str, logs: dict, out: str) -> None:
    plt = pyplot()
    if plt is None:
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
    save_png(fig, os.path.join(out, f"{task}.png"))
    plt.close(fig)
