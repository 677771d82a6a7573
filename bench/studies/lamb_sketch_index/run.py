"""OnebitLamb's trust-ratio sketch: the hashed index (session 25, the default) against the drawn int32
index it replaced, paired on the suite's digits task (8 seeds, the freeze at 120 and "auto", 4 gloo
ranks, the library's defaults otherwise). The hashed runs are the suite's own logs (bench/out/suite-s25);
this runs the drawn-index ones, the same commands with OnebitLamb's ``sketch_hash`` set to 0 at
construction (what a checkpoint from before the hash resumes with), and prints both ratios to LAMB per
seed and as the suite's ratio of means.

  python bench/studies/lamb_sketch_index/run.py --hashed bench/out/suite-s25 --out bench/out/lamb-drawn
  python bench/studies/lamb_sketch_index/run.py --hashed bench/out/suite-s25 --out bench/out/lamb-drawn \
      --seeds 8 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, BENCH)

from suite import command, final_loss, read  # noqa: E402

DRAWN = os.path.join(HERE, "drawn.py")


def _run(cmd: list[str], log: str, drawn: bool) -> float:
    """The final validation loss of ``cmd``'s run, run where its log has no final line yet."""
    if not os.path.exists(log) or not read(log)[1]:
        if drawn:  # the same arguments, through the wrapper
            cmd = list(cmd)
            cmd[cmd.index(os.path.join(BENCH, "train_task.py"))] = DRAWN
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    return final_loss(read(log)[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hashed", required=True, help="the suite's folder (hashed runs and the LAMB baselines); "
                   "runs it lacks (seeds past the suite's) are made there")
    p.add_argument("--out", required=True, help="the drawn-index runs")
    p.add_argument("--seeds", type=int, nargs=2, default=(0, 8), metavar=("FIRST", "STOP"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seeds = range(*args.seeds)
    for freeze in ("120", "auto"):
        drawn, hashed, base = [], [], []
        for seed in seeds:
            suffix = (f"-seed{seed}" if seed else "") + ".jsonl"
            tag = f"digits-onebit_lamb-{freeze}"
            log = os.path.join(args.out, tag + suffix)
            drawn.append(_run(command("digits", "onebit_lamb", freeze, seed, 4, log), log, True))
            log = os.path.join(args.hashed, tag + suffix)
            hashed.append(_run(command("digits", "onebit_lamb", freeze, seed, 4, log), log, False))
            log = os.path.join(args.hashed, "digits-lamb" + suffix)
            base.append(_run(command("digits", "lamb", "120", seed, 4, log), log, False))
        print(f"freeze {freeze}: per seed, drawn / hashed over LAMB")
        for s, (a, b, c) in zip(seeds, zip(drawn, hashed, base, strict=True), strict=True):
            print(f"  seed {s}: {a / c:.4f}  {b / c:.4f}")
        m = statistics.mean(base)
        print(f"  ratio of means: drawn {statistics.mean(drawn) / m:.4f}, "
              f"hashed {statistics.mean(hashed) / m:.4f}")


if __name__ == "__main__":
    main()
