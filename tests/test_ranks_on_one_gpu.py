"""Several ranks on one GPU (issue 57): NCCL refuses two ranks on one device, gloo takes CUDA tensors
(through host memory), so 2 and 3 processes on one GPU run the real Triton kernels and fused passes with
real ranks. Each body runs on the CPU too (the C codec and passes): there it checks the body itself, on a
GPU it checks the CUDA route. ``compressed_allreduce`` (both block settings, odd n) gives every rank the
same bits and, on a GPU, what the CPU route gives to float32 rounding; OnebitAdam (its fused step),
ZeroOneAdam and the DDP hook keep the replicas identical over a few steps and stay within rounding of
the CPU route."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _allreduce(device: str, block, n: int):
    from onebit.collectives import compressed_allreduce, error_buffers

    r = dist.get_rank()
    g = torch.Generator().manual_seed(10 + r)
    out = []
    we, se = error_buffers(n, block=block, device=device)
    for _ in range(3):  # the errors carried from call to call
        x = torch.randn(n, generator=g).to(device)
        compressed_allreduce(x, we, se, block=block)
        out.append(x.cpu())
    return out, we.cpu(), se.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("block", [None, 64])
def test_compressed_allreduce_with_ranks_sharing_a_device(ranks, device, W, block):
    n = 10_001  # odd: padded chunks
    got = ranks(W).run(_allreduce, device, block, n)
    for out, _, _ in got[1:]:
        for a, b in zip(out, got[0][0], strict=True):
            assert torch.equal(a, b)  # every rank the same bits
    if device == "cuda":
        cpu = ranks(W).run(_allreduce, "cpu", block, n)
        for r in range(W):
            for a, b in zip(got[r][0], cpu[r][0], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _optimizer(device: str, name: str):
    from onebit.optimizers import OnebitAdam, ZeroOneAdam

    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in ((120, 70), (33,), (4000,))]
    if name == "zero_one":
        opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=3, var_update_scaler=1, bucket_cap_mb=0.02)
    else:
        opt = OnebitAdam(params, lr=1e-3, freeze_step=2, bucket_cap_mb=0.02)
    g = torch.Generator().manual_seed(100 + r)
    for _ in range(8):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
    plans = [getattr(opt, a, None) for a in ("_fused_cache", "_zoa_cache", "_zos_cache")]  # the fused steps
    backends = sorted({plan.backend for plan in plans if plan is not None})
    return [p.detach().cpu() for p in params], opt.stats()["bytes_compressed"], backends


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_optimizers_with_ranks_sharing_a_device(ranks, device, name):
    got = ranks(2).run(_optimizer, device, name)
    for params, sent, backends in got:
        assert sent > 0 and backends
        for a, b in zip(params, got[0][0], strict=True):
            assert torch.equal(a, b)  # replicas identical (0/1 Adam: 8 steps end at a synchronisation)
    if device == "cuda":
        assert got[0][2] == ["triton"], got[0][2]
        cpu = ranks(2).run(_optimizer, "cpu", name)
        for a, b in zip(got[0][0], cpu[0][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _hook(device: str, name: str = "adamw", plain: bool = False):
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.kernels.backends import use_backend

    r = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).to(device)
    model = DDP(module)
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        state = OnebitCompressHookState(optimizer=opt, freeze_step=2, block=16)
    else:  # SGD's momentum compressed (no freeze_step): the same passes, d = 1
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        state = OnebitCompressHookState(optimizer=opt, block=16)
    model.register_comm_hook(state, onebit_compress_hook)
    with use_backend("plain", steps=["hook"]) if plain else contextlib.nullcontext():
        for t in range(6):
            g = torch.Generator().manual_seed(1000 * t + r)
            x = torch.randn(8, 12, generator=g).to(device)
            y = torch.randint(0, 3, (8,), generator=g).to(device)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().cpu() for p in module.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_ddp_hook_with_ranks_sharing_a_device(ranks, device, name):
    got = ranks(2).run(_hook, device, name)
    for a, b in zip(got[1], got[0], strict=True):
        assert torch.equal(a, b)
    # the hook's passes (C on a CPU, Triton on a GPU) bitwise its plain ops on the same device
    for a, b in zip(got[0], ranks(2).run(_hook, device, name, True)[0], strict=True):
        assert torch.equal(a, b)
    if device == "cuda":
        for a, b in zip(got[0], ranks(2).run(_hook, "cpu", name)[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _lamb(device: str, device_side: bool):
    import warnings

    from onebit.optimizers import OnebitLamb

    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in ((120, 70), (33,), (4000,))]
    opt = OnebitLamb(params, lr=1e-3, weight_decay=0.01, freeze_step=4)
    opt._device_agreement = device_side
    g = torch.Generator().manual_seed(100 + r)
    agreed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(8):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            if t == 5 and r == 1:
                params[1].grad[3] = float("nan")
            opt.step()
            agreed.append(bool(opt._pending_agreements))
        stats = opt.stats()
    return [p.detach().cpu() for p in params], agreed, stats["updates"], stats["skipped_steps"]


@pytest.mark.parametrize("device", DEVICES)
def test_lambs_agreement_on_the_device_with_ranks_sharing_a_device(ranks, device):
    # issue 57: OnebitLamb's warm-up steps (but the first and the last) and steady compression steps agreed
    # on the device (the poison summed there in the warm-up, through the Triton codec's scales after it; the
    # selects on the device) skip a NaN step bitwise as the host agreement does
    pool = ranks(2)
    on, off = pool.run(_lamb, device, True), pool.run(_lamb, device, False)
    for (a, agreed, updates, skipped), (b, host, updates_b, skipped_b) in zip(on, off, strict=True):
        assert agreed == [False, True, True, False, False, True, True, True] and not any(host), agreed
        assert (updates, skipped) == (updates_b, skipped_b) == (7, 1)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
