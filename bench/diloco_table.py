"""Table of 1-bit DiLoCo against float32 DiLoCo from bench_diloco.py's rows: per task, outer lr
and H, the ratio of the mean final validation losses over seeds, the per-seed ratios and their
spread (max - min). A 1-bit row is paired with the float32 row of the same task, inner optimizer
(AdamW, or Muon + AdamW at its Muon lr), outer lr, seed, H and streaming setting, from any of the
files given.

  python bench/diloco_table.py bench/results/diloco/*.jsonl --form auto

--form selects the 1-bit rows (auto: momentum_share="auto", the default; plain; momentum);
rows without a form were measured before the choice existed and count as --legacy-form.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def load(paths: list[str]) -> list[dict]:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    return [r for r in rows if r.get("link", "none") == "none" and r.get("kind") == "diloco"]


def table(rows: list[dict], form: str, legacy_form: str) -> list[str]:
    def key(r: dict) -> tuple:
        stream = r.get("fragments", 1) > 1
        inner = r.get("inner", "adamw") + (f" {r['muon_lr']}" if r.get("inner") == "muon" else "")
        return (r.get("task", "lm"), inner, r.get("outer_lr", 0.7), r["H"], stream, r.get("seed", 0),
                r.get("steps"))

    fp32 = {key(r): r["val_loss"] for r in rows if not r["compress"]}
    pairs = collections.defaultdict(dict)  # (task, inner, lr, H, stream) -> seed -> (1-bit, fp32)
    for r in rows:
        if r["compress"] and r.get("form", legacy_form) == form and key(r) in fp32:
            k = key(r)
            pairs[k[:5]][k[5]] = (r["val_loss"], fp32[k])
    out = ["| task | inner | outer lr | H | streaming | seeds | float32 (mean) | 1-bit (mean) | "
           "ratio of means | per seed | spread |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (task, inner, lr, H, stream), by_seed in sorted(pairs.items()):
        seeds = sorted(by_seed)
        one = [by_seed[s][0] for s in seeds]
        ref = [by_seed[s][1] for s in seeds]
        per = [a / b for a, b in zip(one, ref, strict=True)]
        ratio = statistics.mean(one) / statistics.mean(ref)
        out.append(f"| {task} | {inner} | {lr} | {H} | {'yes' if stream else 'no'} | "
                   f"{','.join(map(str, seeds))} | "
                   f"{statistics.mean(ref):.4f} | {statistics.mean(one):.4f} | **{ratio:.3f}** | "
                   f"{', '.join(f'{x:.3f}' for x in per)} | {max(per) - min(per):.3f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--form", default="auto")
    p.add_argument("--legacy-form", default="plain", help="the form of rows that name none")
    args = p.parse_args()
    print("\n".join(table(load(args.jsonl), args.form, args.legacy_form)))


if __name__ == "__main__":
    main()
