"""Host reads of tensor values per optimizer step on the GPU's path (issue 57): OnebitAdam and
ZeroOneAdam with the Triton backend (under the interpreter on a CPU), on 2 gloo ranks, with 1 and with
4 buckets: every step reads the same values whatever the bucket count, and a steady compression step
reads two (the non-finite agreement's verdict and its count: what a device-side agreement is to
remove). A read of a value into Python (``float``, ``int``, ``bool``, ``item``, ``tolist``) is a host
synchronisation where the tensor lives on a GPU; counted here through patched methods."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ValueReads

from onebit.kernels.backends import use_backend
from onebit.optimizers import OnebitAdam, ZeroOneAdam


def _body(name: str, cap: float, on_device: bool = False, freeze: int | None = None):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(4)]
    if name == "zero_one":
        opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=freeze or 4, var_update_scaler=1,
                          bucket_cap_mb=cap)
    else:
        opt = OnebitAdam(params, lr=1e-3, freeze_step=freeze or 2, bucket_cap_mb=cap)
    opt._device_agreement = on_device  # (a GPU's default; here forced on the CPU)
    g = torch.Generator().manual_seed(r)
    rows = []
    with use_backend("triton"):
        for _ in range(9):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            stage = opt.stage
            with ValueReads() as reads:
                opt.step()
            rows.append((stage, sum(reads.where.values()), dict(reads.where)))
    return len(opt.reducer().buckets), rows


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_host_reads_per_step_do_not_grow_with_the_buckets(ranks, name):
    pool = ranks(2)
    (one, rows_1), _ = pool.run(_body, name, 1.0)
    (four, rows_4), _ = pool.run(_body, name, 0.004)
    assert (one, four) == (1, 4)
    for t, (a, b) in enumerate(zip(rows_1, rows_4, strict=True)):
        if t:  # (the first step's replica fingerprints: once)
            assert a[:2] == b[:2], (t, a, b)
    if name == "adam":
        steady = rows_4[3:]
        assert all(stage == "compression" and count == 2 for stage, count, _ in steady), steady


def test_the_agreement_on_the_device_reads_nothing_back_in_a_steady_step(ranks):
    # OnebitAdam's compression steps with the agreement on the device (optimizers/_device_agreement.py):
    # the only read is the previous step's skip flag, from pinned host memory (no synchronisation)
    (buckets, rows), _ = ranks(2).run(_body, "adam", 0.004, True)
    assert buckets == 4
    for stage, _, where in rows[4:]:
        assert stage == "compression" and all(f.startswith("_device_agreement") for f in where), where


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_the_warm_up_and_phase_one_agreed_on_the_device_read_nothing_back(ranks, name):
    # OnebitAdam's warm-up steps but its last (freeze_step=8: steps 1-7), ZeroOneAdam's phase 1
    # (var_freeze_step=8: its variance steps 1, 2, 4, 8, their floors on the device, and its compressed
    # steps 3, 5, 6, 7): the only reads are the earlier steps' skip flags, from pinned host memory
    (_, rows), _ = ranks(2).run(_body, name, 0.004, True, 8)
    device = range(1, 8) if name == "zero_one" else range(1, 7)  # (the first step: the fingerprints)
    for t in device:
        stage, _, where = rows[t]
        assert stage in ("warm-up", "phase 1"), (t, stage)
        assert all(f.startswith("_device_agreement") for f in where), (t, where)


def test_zero_one_adams_synchronisations_agreed_on_the_device_read_nothing_back(ranks):
    # ZeroOneAdam's phase 2 (var_freeze_step=4) at its default local_step_scaler: every step a
    # synchronisation; the first (loop index 4) agrees on the host, the others on the device (each begins at
    # rest and rests again): the only reads are the earlier steps' skip flags, from pinned host memory
    (_, rows), _ = ranks(2).run(_body, "zero_one", 0.004, True, 4)
    for t in range(5, 9):
        stage, _, where = rows[t]
        assert stage == "phase 2", (t, stage)
        assert all(f.startswith("_device_agreement") for f in where), (t, where)
