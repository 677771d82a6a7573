"""Plot bench_diloco.py's rows: final validation loss of 1-bit DiLoCo over float32 DiLoCo at the
same H, streaming on and off, per task and seed, for the pseudo-gradient forms measured.

  python bench/plot_diloco.py bench/results/diloco/*.jsonl --out bench/results/diloco/diloco.png

A row without "form" was measured before error decay existed: the momentum form, no decay.
"""

from __future__ import annotations

import argparse
import collections
import json


def ratios(paths: list[str]) -> dict:
    """(task, outer lr, config, form) -> list of 1-bit / float32 ratios (one per seed)."""
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    rows = [r for r in rows if r.get("link", "none") == "none" and r.get("kind") == "diloco"]

    def key(r: dict) -> tuple:
        run = r["run"].replace("fp32", "x").replace("1bit", "x")
        return r.get("task", "lm"), r.get("outer_lr", 0.7), r.get("seed", 0), run

    fp32 = {key(r): r["val_loss"] for r in rows if not r["compress"]}
    out = collections.defaultdict(list)
    for r in rows:
        if not r["compress"]:
            continue
        key_ = key(r)
        if key_ not in fp32:
            continue
        form = (f"{r['form']}, decay {r['error_decay']}" if "form" in r else "momentum, decay 1.0")
        config = r["run"].replace("diloco_1bit_", "H=").replace("_stream", " stream")
        out[(key_[0], key_[1], config, form)].append(r["val_loss"] / fp32[key_])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = ratios(args.jsonl)
    panels = sorted({(t, lr) for t, lr, _, _ in data})
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 8), squeeze=False)
    forms = sorted({f for *_, f in data})
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (task, lr) in zip(axes.flat, panels, strict=False):
        configs = sorted({c for t, l_, c, _ in data if (t, l_) == (task, lr)})
        width = 0.8 / len(forms)
        for i, form in enumerate(forms):
            for j, config in enumerate(configs):
                vals = data.get((task, lr, config, form), [])
                x = j + (i - (len(forms) - 1) / 2) * width
                if vals:
                    ax.bar(x, sum(vals) / len(vals), width, color=f"C{i}", label=form if j == 0 else None)
                    ax.plot([x] * len(vals), vals, "k.", ms=4)
        ax.axhline(1.03, color="red", lw=0.8, ls="--")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(configs)), configs)
        low = min([0.8] + [v for (t, l_, _, _), vals in data.items() if (t, l_) == (task, lr) for v in vals])
        ax.set_ylim(low - 0.05, 1.2)  # every seed's point visible
        ax.set_title(f"{task}, outer lr {lr}")
        ax.set_ylabel("final val loss, 1-bit / float32 DiLoCo")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
