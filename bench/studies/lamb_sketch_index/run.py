"""OnebitLamb's trust-ratio sketch: the hashed index (session 25, the default) against the drawn int32
index it replaced, paired on the suite's digits task (8 seeds, the freeze at 120 and "auto", 4 gloo
ranks, the library's defaults otherwise). The hashed runs are the suite's own logs (bench/out/suite-s25);
this runs the drawn-index ones, the same commands with OnebitLamb's ``sketch_hash`` set to 0 at
construction (what a checkpoint from before the hash resumes with), and prints both ratios to LAMB per
seed and as the suite's ratio of means.

  python bench/studies/lamb_sketch_index/run.py --hashed bench/out/suite-s25 --out bench/out/lamb-drawn
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hashed", required=True, help="the suite's folder (hashed runs and the LAMB baselines)")
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, default=8)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for freeze in ("120", "auto"):
        drawn, hashed, base = [], [], []
        for seed in range(args.seeds):
            tag = f"digits-onebit_lamb-{freeze}" + (f"-seed{seed}" if seed else "")
            log = os.path.join(args.out, tag + ".jsonl")
            if not os.path.exists(log) or not read(log)[1]:
                cmd = command("digits", "onebit_lamb", freeze, seed, 4, log)
                i = cmd.index(os.path.join(BENCH, "train_task.py"))
                cmd[i] = DRAWN  # the same arguments, through the wrapper
                subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                               stdout=subprocess.DEVNULL)
            drawn.append(final_loss(read(log)[0]))
            hashed.append(final_loss(read(os.path.join(args.hashed, tag + ".jsonl"))[0]))
            lamb = "digits-lamb" + (f"-seed{seed}" if seed else "") + ".jsonl"
            base.append(final_loss(read(os.path.join(args.hashed, lamb))[0]))
        print(f"freeze {freeze}: per seed, drawn / hashed over LAMB")
        for s, (a, b, c) in enumerate(zip(drawn, hashed, base, strict=True)):
            print(f"  seed {s}: {a / c:.4f}  {b / c:.4f}")
        m = statistics.mean(base)
        print(f"  ratio of means: drawn {statistics.mean(drawn) / m:.4f}, "
              f"hashed {statistics.mean(hashed) / m:.4f}")


if __name__ == "__main__":
    main()
