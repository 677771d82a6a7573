"""The compile check's fma column sees contraction: the server's sum over ranks and the workers'
float64 norms compiled with fusion forced on show fused multiply-adds on every target (NVIDIA
sm_90, AMD gfx942 and gfx90a). With the launchers' setting (off) the same column must read 0 for
every variant on every target: scripts/compile_check.py, run by scripts/test.sh, exits 1
otherwise. Compiles without a GPU, in a fresh process (the test session runs the kernels in
Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import compile_check as cc
import triton
from triton.compiler import ASTSource, make_backend

target = cc.target_of(sys.argv[2])
backend = make_backend(target)
rows, seen = [], set()
for tag, launch in cc.launches():
    if not (launch.name.startswith(("server", "worker")) and ("fp32" in tag or tag == "")):
        continue
    options, signature, constexprs, attrs = cc.specialise(launch, backend, True)
    assert options.enable_fp_fusion is True
    key = (launch.name, str(signature), str(constexprs), str(attrs))
    if key in seen or len(seen) == 4:
        continue
    seen.add(key)
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    code = kernel.asm["ptx"] if target.backend == "cuda" else kernel.asm["amdgcn"]
    rows.append([launch.name, cc.fma_count(code, target.backend)[0]])
print(json.dumps(rows))
"""


@pytest.mark.parametrize("arch", ["90", "gfx942", "gfx90a"])
def test_the_fma_column_shows_contraction_exactly_when_it_is_on(arch):
    import onebit.kernels.triton_kernels as tk

    assert tk.FP_FUSION is False  # the launchers' choice (the comment in triton_kernels says why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "scripts"), arch], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    on = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(on) == 4
    assert sum(n for _, n in on) > 0, on  # the kernels fuse when asked: the column sees it


def test_the_fma_column_tells_interleaved_divisions_from_contraction():
    """AMD's correctly rounded division is a sequence with FMAs (v_div_scale twice, ..., v_div_fixup);
    the scheduler interleaves several divisions' sequences (the fused passes' per-element divisions
    do): their FMAs are exact, an FMA outside every sequence is a contraction. So are the float32
    square root's two residual FMAs."""
    # the kernels' modules first, decorated under the interpreter this session runs them in: the check
    # imports them with the interpreter off, and modules first imported then would compile for a GPU
    # in every later test of this process ("0 active drivers")
    from onebit.kernels import triton_blocks, triton_kernels  # noqa: F401
    from onebit.kernels.fused import adam, hook, table, zero_one  # noqa: F401

    sys.path.insert(0, str(ROOT / "scripts"))
    saved = dict(os.environ)
    try:
        import compile_check as cc  # sets its own Triton cache and leaves the interpreter, for the check
    finally:  # this process's later tests run Triton kernels under the interpreter (tests/conftest.py)
        os.environ.clear()
        os.environ.update(saved)

    one = ["v_div_scale_f32 v1, s[0:1], v8, v8, v2", "v_rcp_f32_e32 v3, v1", "v_fma_f32 v4, -v1, v3, 1.0",
           "v_fmac_f32_e32 v3, v4, v3", "v_div_scale_f32 v5, vcc, v2, v8, v2", "v_mul_f32_e32 v6, v5, v3",
           "v_fma_f32 v7, -v1, v6, v5", "v_fmac_f32_e32 v6, v7, v3", "v_fma_f32 v1, -v1, v6, v5",
           "v_div_fmas_f32 v1, v1, v3, v6", "v_div_fixup_f32 v1, v1, v8, v2"]
    interleaved = one[:5] + one[:5] + one[5:] + one[5:]  # the first closes while the second is open
    assert cc.fma_count("\n".join(interleaved), "hip") == (0, 10)
    assert cc.fma_count("\n".join(one + ["v_fma_f32 v9, v1, v2, v3"]), "hip") == (1, 5)
    # the float32 square root (the stale denominators' sqrt(v), tl.sqrt_rn): v_sqrt_f32 then the
    # residuals of its two neighbours, exact; an FMA of the root with anything else is a contraction
    root = ["v_mul_f32_e32 v12, 0x4f800000, v27", "v_sqrt_f32_e32 v13, v12", "v_add_u32_e32 v14, -1, v13",
            "v_fma_f32 v22, -v14, v13, v12", "v_add_u32_e32 v15, 1, v13", "v_fma_f32 v13, -v15, v13, v12"]
    assert cc.fma_count("\n".join(root), "hip") == (0, 2)
    assert cc.fma_count("\n".join(root + ["v_fma_f32 v3, v13, v2, v12"]), "hip") == (1, 2)
