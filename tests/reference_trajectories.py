"""Saved trajectories of the reference maths (docs/ALGORITHMS.md sections 3-4, DeepSpeed parity).

``tests/data/reference_trajectories.pt`` holds, for OnebitAdam, OnebitLamb and ZeroOneAdam at
W = 2 and 3, every rank's parameters after every step of a short run through warm-up and
compression. It was written by this module's ``main`` at commit 273e339, before
``compression="preconditioned"`` existed, with ``auto_mask=None``: the maths of that day's
reference mode. tests/test_reference_mode.py replays the same runs with today's reference
switches and asserts bitwise equality. Regenerating the file from a later commit would test
nothing; only do it where the reference maths itself is meant to change (and say so).

  python tests/reference_trajectories.py   # from the repository root, writes the file
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "reference_trajectories.pt"
STEPS = 16
# name -> (constructor kwargs, bucket_cap_mb); freeze 5 (Adam, LAMB), var_freeze_step 8 (0/1 Adam)
CASES = {
    "adam": (dict(freeze_step=5, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01), 0.0),
    "adam-bias-correction": (dict(freeze_step=5, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0,
                                  bias_correction=True), 25.0),
    "lamb": (dict(freeze_step=5, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01), 25.0),
    "zero_one": (dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01), 25.0),
}


def body(name: str, reference_kwargs: dict) -> torch.Tensor:
    """Rank body: the run ``name`` with ``reference_kwargs`` (the switches that select the
    reference maths); returns this rank's parameters after every step, ``[STEPS, numel]``
    (each step's parameters flattened and concatenated)."""
    from helpers import make_grads, make_optimizer, make_params

    r = dist.get_rank()
    params = make_params()
    kwargs, cap = CASES[name]
    opt = make_optimizer(name.split("-")[0], params, {**kwargs, **reference_kwargs}, cap)
    history = []
    for t in range(STEPS):
        grads = make_grads(t, r)
        if t % 4 == 3:  # a parameter without a gradient on odd ranks now and then
            grads[0] = None if r % 2 else grads[0]
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return torch.stack(history)


def main() -> None:
    sys.path.insert(0, str(HERE))
    from dist_pool import RankPool

    out: dict[str, torch.Tensor] = {}  # run -> [W, STEPS, numel]
    for W in (2, 3):
        pool = RankPool(W)
        try:
            for name in CASES:
                out[f"{name}/W{W}"] = torch.stack(pool.run(body, name, {"auto_mask": None}))
        finally:
            pool.close()
    DATA.parent.mkdir(exist_ok=True)
    torch.save({"steps": STEPS, "runs": out, "note": __doc__}, DATA)
    print(f"wrote {DATA}: {len(out)} runs of {STEPS} steps")


if __name__ == "__main__":
    main()
