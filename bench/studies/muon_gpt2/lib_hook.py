"""docs/hf-trainer.md's script with options for onebit's own hook (issue 59; bench/RESULTS.md "The DDP
hook with Muon"): the page's script as it stands, its one onebit line ``attach(trainer)`` given the
keyword arguments of ``--hook`` (JSON; any of OnebitCompressHookState's, e.g. ``{"freeze_step": 1000}``
or ``{"error_dtype": "float32"}``). The other arguments go to the page's script.

  torchrun --nproc-per-node 4 bench/studies/muon_gpt2/lib_hook.py --hook '{"freeze_step": 1000}' \\
      --optimizer muon --muon-lr 0.02 --steps 2000 --seed 0 --save-steps 100000
"""
import json
import re
import sys
from pathlib import Path

import torch

from onebit.integrations import _session

ROOT = Path(__file__).resolve().parents[3]
text = (ROOT / "docs" / "hf-trainer.md").read_text()
script = re.findall(r"```python\n(.*?)```", text, flags=re.S)[-1]
assert script.count("attach(trainer)") == 1, "the page's attach line moved"
argv = sys.argv[1:]
hook = {}
if "--hook" in argv:
    i = argv.index("--hook")
    hook = json.loads(argv[i + 1])
    del argv[i:i + 2]
if "error_dtype" in hook:
    hook["error_dtype"] = getattr(torch, hook["error_dtype"])
_session.HOOK_OPTIONS = (*_session.HOOK_OPTIONS, *(k for k in hook if k not in _session.HOOK_OPTIONS))
sys.argv = [sys.argv[0], *argv]
exec(compile(script.replace("attach(trainer)", "attach(trainer, **HOOK)"), "hf-trainer.md", "exec"),
     {"__name__": "__main__", "HOOK": hook})
