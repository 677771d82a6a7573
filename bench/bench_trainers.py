"""onebit inside the Hugging Face Trainer and Lightning at full length: the docs pages' own scripts
(docs/hf-trainer.md, docs/lightning.md: a 2-layer GPT-2 on stdlib bytes, 2 gloo ranks, batch 16
per rank, lr 1e-3, the default clip at 1.0, 400 steps), each optimizer against plain AdamW
(no onebit) in the same framework, and the HF Trainer resumed from its own step-200 checkpoint
(OnebitAdam and AdamW behind the hook).

  python bench/bench_trainers.py                       # all rows, seed 0
  python bench/bench_trainers.py --frameworks hf --seeds 0 1 2 --variants adamw-plain adamw

Prints one row per run and the ratios of final held-out loss to plain AdamW's; appends the rows
to bench/results/trainers/rows.jsonl (device, versions, date, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"hf": "hf-trainer.md", "lightning": "lightning.md"}
LINE = re.compile(r"^(\w+) (\S+) replicas identical (\w+) bytes_compressed (\d+) weights (\w+)$", re.M)


def script(framework: str) -> str:
    text = (ROOT / "docs" / PAGES[framework]).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[-1]


def run(framework: str, workdir: Path, *args: str, ranks: int = 2) -> dict:
    path = workdir / "train.py"
    path.write_text(script(framework))
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
              if framework == "hf" else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    done = subprocess.run([*launch, str(path), *args], capture_output=True, text=True, env=env, cwd=workdir,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{framework} {args} failed:\n{done.stderr[-4000:]}")
    found = LINE.findall(done.stdout)
    if len(found) != 1:
        raise SystemExit(f"{framework} {args}: no result line:\n{done.stdout[-2000:]}")
    _, loss, same, sent, weights = found[0]
    return dict(loss=float(loss), identical=same == "True", bytes_compressed=int(sent), weights=weights,
                seconds=round(time.perf_counter() - start, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", choices=list(PAGES), default=list(PAGES))
    p.add_argument("--variants", nargs="+", default=["adamw-plain", "onebit-adam", "adamw"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--no-resume", action="store_true", help="skip the HF resume-at-half row")
    p.add_argument("--ranks", type=int, default=2, help="the HF Trainer's gloo ranks")
    p.add_argument("--muon-lr", type=float, default=None,
                   help="the muon variants' Muon lr (default: the script's)")
    a = p.parse_args()
    import torch
    import transformers

    meta = dict(date=datetime.date.today().isoformat(), device=platform.processor() or platform.machine(),
                torch=torch.__version__, transformers=transformers.__version__, command=" ".join(sys.argv))
    out = ROOT / "bench/results/trainers"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for framework in a.frameworks:
        for seed in a.seeds:
            base = None
            for variant in a.variants:
                with tempfile.TemporaryDirectory() as tmp:
                    args = ["--optimizer", variant, "--steps", str(a.steps), "--seed", str(seed)]
                    if variant.startswith("muon") and a.muon_lr is not None:
                        args += ["--muon-lr", str(a.muon_lr)]
                    if framework == "hf":
                        args += ["--save-steps", str(a.steps // 2)]
                    row = dict(framework=framework, variant=variant, seed=seed, steps=a.steps,
                               ranks=a.ranks if framework == "hf" else 1,
                               **({"muon_lr": a.muon_lr} if variant.startswith("muon") else {}),
                               **run(framework, Path(tmp), *args, ranks=a.ranks))
                    if framework == "hf" and variant in ("onebit-adam", "adamw") and not a.no_resume:
                        # resumed from the Trainer's own checkpoint at half way
                        resumed = Path(tmp) / "resumed"
                        half = f"checkpoint-{a.steps // 2}"
                        shutil.copytree(Path(tmp) / "out" / half, resumed / half)
                        again = run(framework, Path(tmp), *args, "--resume", "--output-dir", "resumed",
                                    ranks=a.ranks)
                        same = again["weights"] == row["weights"]
                        row.update(resumed_loss=again["loss"], resumed_bitwise=same)
                if variant.endswith("-plain"):  # the next variants' baseline
                    base = row["loss"]
                row["ratio"] = None if base is None else round(row["loss"] / base, 4)
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(out / "rows.jsonl", "a") as fh:
                    fh.write(json.dumps({**row, **meta}) + "\n")
    print("\n| framework | optimizer | seed | held-out loss | / plain AdamW | identical | bytes compressed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['framework']} | {r['variant']} | {r['seed']} | {r['loss']:.4f} | {r['ratio']} | "
              f"{r['identical']} | {r['bytes_compressed']:,} |")


if __name__ == "__main__":
    main()
