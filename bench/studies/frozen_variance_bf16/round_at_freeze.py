"""Issue 56's open item "the frozen denominator in bfloat16 if measured harmless": examples/train_lm.py with
OnebitAdam's frozen variance rounded to bfloat16 in place at the freeze (``ROUND=1``; before the compression
stage's first step), which is what storing it in bfloat16 would give every later step; ``ROUND=0``: as it is.

  ROUND=1 torchrun --standalone --nproc-per-node 4 bench/studies/frozen_variance_bf16/round_at_freeze.py \\
      --optimizer onebit_adam --steps 1200 --freeze-step 240 --eval-every 100 --log-jsonl out.jsonl \\
      --lr 2e-3 --seed 0

Prints "rounded" once per rank when it applies (bench/RESULTS.md, session 32).
"""

import os
import runpy
import sys

import torch

from onebit.optimizers import OnebitAdam

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples")

if os.environ.get("ROUND") == "1":
    _enter = OnebitAdam._enter_compression

    def _rounded(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and self.VARIANCE_STATE in state:
                    v = state[self.VARIANCE_STATE]
                    v.copy_(v.to(torch.bfloat16).to(v.dtype))
        print("rounded the frozen variance to bfloat16", file=sys.stderr, flush=True)
        return _enter(self)

    OnebitAdam._enter_compression = _rounded

path = os.path.join(EXAMPLES, "train_lm.py")
sys.path.insert(0, EXAMPLES)
sys.argv = [path, *sys.argv[1:]]
runpy.run_path(path, run_name="__main__")
