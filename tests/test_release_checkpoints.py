"""A checkpoint saved by the release before issue 56 loads and resumes (issue 56's acceptance line).

tests/data/release56 holds, per rank of 2, what the code of commit 0f85f8a^ saved after 8 steps
(past the freeze) of OnebitAdam, OnebitLamb, ZeroOneAdam and AdamW behind the DDP hook with
``freeze_step``, and the parameters that code reached in the 4 steps after (make.py there made them
and says how). Here the current code builds the same model and optimizer, loads the rank's file and
takes the same 4 steps: with ``error_dtype=torch.float32`` (the release's error buffers) and
``variance_dtype=torch.float32`` (its frozen variance) it must reach the release's parameters
(bitwise behind the hook where torch's float32 sqrt is the files' machine's, see
:func:`_sqrt_as_the_files_machine`; the 1-bit optimizers to float32 rounding, see :data:`ROUNDING`); with the
defaults (bfloat16 error buffers and frozen variance) it must load the float32 errors and variance,
run, stay finite, and keep the replicas bitwise identical where the optimizer says so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DATA = Path(__file__).resolve().parent / "data" / "release56"


def _load_make():
    spec = importlib.util.spec_from_file_location("release56_make", DATA / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _load_make()  # the model, the optimizers' arguments and the step the files were made with

# Why the 1-bit optimizers are not bitwise the release: issue 56 (4fb195d) defined the stale denominator's
# rounding once, d = fl(fl(max(fl(sqrt(v)), f) * r) + eps) with a correctly rounded sqrt and r = fl(1 /
# fl(sqrt(bc2))) (docs/ALGORITHMS.md 6.2; kernels/preconditioning.py sqrt_rn). The release computed d with
# torch's CPU float32 v.sqrt(), which on the AVX-512 machine that made these files is 1 ulp off in about
# one value in five (77 of OnebitAdam's 378 here), and divided by sqrt(bc2) (ZeroOneAdam's bc2 != 1).
# So d differs by 1 ulp on those coordinates, the update m / d by about 2^-23 of itself, and the
# parameters by at most 3.0e-8 over these 4 steps (OnebitAdam 3.7e-9 on 4 coordinates, OnebitLamb 3.7e-9,
# ZeroOneAdam 3.0e-8; its sync at step 12 lands bitwise again). Checked: the release tree with only
# stale_denominator changed to that rounding reproduces the current code's 4 steps bitwise in all four
# cases. AdamW behind the hook is bitwise where torch's sqrt is that machine's (the release's hook checkpoint
# holds its d, used as it came; AdamW's own step takes torch's sqrt: see _sqrt_as_the_files_machine).
# ATOL = 1e-7 is 3x that drift and 10^-5 of a step (lr = 1e-2), while a real change of the maths or a
# state not restored moves coordinates by a fraction of lr: error buffers zeroed at the load move them
# by 1e-2 within the 4 steps, bfloat16 error buffers by 8e-7 (OnebitLamb's first step) to 4e-2.
ROUNDING = {"onebit_adam", "onebit_lamb", "zero_one_adam"}
ATOL = 1e-7


def _sqrt_as_the_files_machine() -> bool:
    """Whether torch's CPU float32 ``sqrt`` here is the one of the machine that made the files (an AMD EPYC,
    Zen 5, AVX-512: 1 ulp off in about one value in five), not correctly rounded. It depends on the CPU's
    vendor, not only its instruction set: on an Intel Xeon with AVX-512 it is correctly rounded (measured,
    2026-11-30: 0 of 10^5 off). AdamW's own step takes ``exp_avg_sq.sqrt()``, so behind the hook the
    release's 4 steps are bitwise where the sqrt is the files' machine's, and 1 ulp of d apart elsewhere
    (3.7e-9 of the parameters on that Xeon): then they are held to ``ATOL`` as the 1-bit optimizers are."""
    v = torch.rand(4096, generator=torch.Generator().manual_seed(0)) ** 2
    return not torch.equal(v.sqrt(), torch.sqrt(v.double()).float())


BITWISE = set() if not _sqrt_as_the_files_machine() else {"adamw_hook"}


def _resume(case: str, error_dtype: torch.dtype | None):
    """Rank body: the rank's checkpoint loaded into the current code, the recorded 4 steps taken;
    returns (the release's parameters after each step, ours, our replicas_identical, the release's)."""
    r = dist.get_rank()
    # weights_only=True: the release's files hold tensors, dicts, lists, tuples and numbers only
    saved = torch.load(DATA / f"{case}-rank{r}.pt", weights_only=True)
    cont = torch.load(DATA / f"{case}-continue-rank{r}.pt", weights_only=True)
    module = make.make_model()
    model = DDP(module) if case == "adamw_hook" else module
    extra = {} if error_dtype is None else {"error_dtype": error_dtype}
    if error_dtype == torch.float32 and case in ROUNDING:  # the release's formats: float32 variance too
        extra["variance_dtype"] = torch.float32
    opt, hook = make.build(case, model, **extra)
    module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    if hook is not None:
        hook.__setstate__(saved["hook"])
    params, same = [], []
    for t in range(make.CONTINUE):
        make.train_step(model, opt, cont["x"][t], cont["y"][t])
        params.append(make.flat(module))
        same.append(make.identical(opt))
    info = hook.stats() if hook is not None else opt.stats()
    compressing = info["compressing"] if hook is not None else info["stage"] in ("compression", "phase 2")
    return cont["params"], torch.stack(params), same, cont["identical"], compressing


@pytest.mark.parametrize("case", make.CASES)
def test_release_checkpoint_resumes_with_float32_errors(ranks, case):
    out = ranks(make.WORLD).run(_resume, case, torch.float32)
    for rank, (theirs, ours, same, their_same, compressing) in enumerate(out):
        assert compressing, f"{case}: not past the freeze after the resume"
        assert same == their_same, f"{case} rank {rank}: replicas_identical {same}, release {their_same}"
        for t in range(make.CONTINUE):
            where = f"{case} rank {rank}, step {make.SAVED_AT + t + 1}"
            if case not in BITWISE:
                torch.testing.assert_close(ours[t], theirs[t], rtol=0.0, atol=ATOL,
                                           msg=lambda m, where=where: f"{where}: {m}")
            else:
                assert torch.equal(ours[t], theirs[t]), (
                    f"{where}: max |difference| {(ours[t] - theirs[t]).abs().max().item():.3g}")


@pytest.mark.parametrize("case", make.CASES)
def test_release_checkpoint_resumes_with_bfloat16_errors(ranks, case):
    out = ranks(make.WORLD).run(_resume, case, None)  # the current defaults: bfloat16 error buffers
    for rank, (_, ours, _, _, compressing) in enumerate(out):
        assert compressing, f"{case}: not past the freeze after the resume"
        assert torch.isfinite(ours).all(), f"{case} rank {rank}: non-finite parameters"
    same = out[0][2]
    assert [o[2] for o in out] == [same] * make.WORLD, f"{case}: the ranks disagree on replicas_identical"
    assert any(same), f"{case}: no step left the replicas identical"
    for t, identical in enumerate(same):
        if identical:
            assert all(torch.equal(o[1][t], out[0][1][t]) for o in out), (
                f"{case}, step {make.SAVED_AT + t + 1}: the replicas differ where the optimizer says not")
