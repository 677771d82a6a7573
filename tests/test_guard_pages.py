"""Every Triton kernel on buffers fenced by unmapped pages (tests/guarded_kernels.py), the fused
passes' per-parameter tensors (reached through an address table) included.

Under the interpreter an out-of-bounds load or store touches a guard page and the child dies
with SIGSEGV. Odd world sizes and tile counts that W does not divide are where a last,
partial program addresses memory past the end of a message.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_kernels_stay_inside_their_buffers():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "guarded_kernels.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else "(nothing printed)"
    assert proc.returncode == 0, (f"exit status {proc.returncode} (-11: a kernel touched a guard page) "
                                  f"at {last}\n{proc.stderr[-2000:]}")
    assert last == "all cases ran"
    assert sum(line.startswith("case ") for line in lines) == 3 * 4 * 4 * 2
    assert sum(line.startswith("fused ") for line in lines) == 3 * 4  # OnebitAdam's fused passes
