"""The error-rounding study's table: per task, each rounding's final validation loss per seed and its
ratio to the float32 errors' run on the same seed (same data, same initial weights: a paired
comparison), from the JSONL logs ``{task}-{rounding}-{seed}.jsonl`` in a folder.

  python bench/studies/error_rounding/table.py /tmp/er
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def final_val(path: str) -> float | None:
    last = None
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("val_loss") is not None:
                last = row["val_loss"]
    return last


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "."
    runs: dict[tuple[str, str], dict[int, float]] = {}
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        task, rounding, seed = os.path.basename(path)[: -len(".jsonl")].rsplit("-", 2)
        value = final_val(path)
        if value is not None:
            runs.setdefault((task, rounding), {})[int(seed)] = value
    print("| task | errors | final validation loss per seed | mean | ratio to float32, per seed "
          "| mean ratio |")
    print("|---|---|---|---|---|---|")
    for task in sorted({t for t, _ in runs}):
        base = runs.get((task, "none"), {})
        for rounding in ("none", "nearest", "stochastic"):
            got = runs.get((task, rounding))
            if not got:
                continue
            seeds = sorted(got)
            ratios = [got[s] / base[s] for s in seeds if s in base]
            name = {"none": "float32", "nearest": "bfloat16, nearest",
                    "stochastic": "bfloat16, stochastic"}[rounding]
            print(f"| {task} | {name} | {', '.join(f'{got[s]:.4f}' for s in seeds)} | "
                  f"{statistics.mean(got.values()):.4f} | {', '.join(f'{r:.4f}' for r in ratios)} | "
                  f"{statistics.mean(ratios):.4f} |" if ratios else "| |")


if __name__ == "__main__":
    main()
