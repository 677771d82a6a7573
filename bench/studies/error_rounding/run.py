"""Issue 56's question, measured before it is built: does 1-bit error feedback tolerate error buffers
kept in bfloat16? docs/ALGORITHMS.md section 12 derives that round-to-nearest biases the
transmitted sum (its rounding errors correlate from step to step and nothing feeds them back) while
stochastic rounding only adds zero-mean noise. This study emulates both on bench/train_task.py's
tasks: after every optimizer step in the compression stage, each rank rounds its worker and server
error buffers to bfloat16 values in place (the buffers stay float32: the maths of a bfloat16 store,
not its memory), then the run goes on.

  python -m torch.distributed.run --standalone --nproc-per-node 4 bench/studies/error_rounding/run.py \\
      --rounding stochastic --task digits --optimizer onebit_adam --steps 600 --seed 0 --log-jsonl out.jsonl

``--rounding``: ``none`` (float32 errors, today's), ``nearest`` or ``stochastic`` (random bits from a
generator seeded by the seed, the rank and the step: reproducible). Every other argument is
bench/train_task.py's. The library is not changed: the rounding is a step post-hook.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # bench/: train_task
import train_task  # noqa: E402


def to_bfloat16_values(t: torch.Tensor, rounding: str, gen: torch.Generator | None) -> None:
    """``t`` (float32) rounded in place to the nearest bfloat16 (``nearest``) or stochastically
    (``stochastic``: up in magnitude with probability equal to the discarded fraction)."""
    if rounding == "nearest":
        t.copy_(t.to(torch.bfloat16).to(torch.float32))
        return
    bits = t.view(torch.int32)
    noise = torch.randint(0, 1 << 16, t.shape, generator=gen, dtype=torch.int32)
    finite = torch.isfinite(t)
    rounded = (bits + noise) & ~0xFFFF  # add below the kept bits, then truncate: sign-magnitude
    bits.copy_(torch.where(finite, rounded, bits))


def main() -> None:
    rounding = "none"
    argv = sys.argv[1:]
    if "--rounding" in argv:
        k = argv.index("--rounding")
        rounding = argv[k + 1]
        del argv[k : k + 2]
    if rounding not in ("none", "nearest", "stochastic"):
        raise SystemExit(f"--rounding: expected none, nearest or stochastic, got {rounding!r}")
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    make = train_task.make_optimizer

    def make_rounding(*args, **kwargs):
        opt = make(*args, **kwargs)
        if rounding == "none":
            return opt
        rank = int(os.environ.get("RANK", "0"))
        gen = torch.Generator().manual_seed(7919 * seed + 104729 * rank + 1)

        def hook(optimizer, *_):
            if optimizer.wants_averaged_gradients():  # the warm-up: no error buffer in use
                return
            for we, se in optimizer.reducer().errors():
                to_bfloat16_values(we, rounding, gen)
                to_bfloat16_values(se, rounding, gen)

        opt.register_step_post_hook(hook)
        return opt

    train_task.make_optimizer = make_rounding
    sys.argv = [sys.argv[0], *argv]
    train_task.main()


if __name__ == "__main__":
    main()
