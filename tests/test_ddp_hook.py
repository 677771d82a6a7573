"""onebit_compress_hook: 1-bit gradient compression for DDP with any optimizer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit.collectives import (
    OnebitCompressHookState,
    compressed_allreduce,
    onebit_compress_hook,
    padded_numel,
)


def _zeros(N: int, W: int):
    """Error buffers as the hook makes them by default (bfloat16)."""
    return torch.zeros(N, dtype=torch.bfloat16), torch.zeros(N // W, dtype=torch.bfloat16)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train(model, opt, state, steps, start=0, record=None):
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets

    def hook(st, bucket):
        compressed = st.iter >= st.start_iter  # what onebit_compress_hook decides for this bucket
        entry = [bucket.index(), bucket.buffer().clone(), None]
        fut = onebit_compress_hook(st, bucket)
        if record is None or not compressed:
            return fut
        record.append(entry)

        def keep(f):
            entry[2] = f.value().clone()
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, hook)
    for step in range(start, start + steps):
        x, y = _batch(step, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return ddp


def _body(steps: int, optimizer: str):
    W = dist.get_world_size()
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = OnebitCompressHookState(start_iter=2)
    assert state.block == 64  # the default: block scales (docs/ALGORITHMS.md section 7)
    record: list = []
    _train(model, opt, state, steps, record=record)
    # replay the recorded buckets through compressed_allreduce by hand, errors per bucket index
    errors: dict = {}
    replay_equal, buckets = True, set()
    for index, grad, out in record:
        buckets.add(index)
        N = padded_numel(grad.numel(), W, 64)
        we, se = errors.setdefault(index, _zeros(N, W))
        mine = compressed_allreduce(grad.clone(), we, se, block=64)
        replay_equal &= torch.equal(mine, out)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, replay_equal, len(buckets), state.stats()


@pytest.mark.parametrize("W", [2, 3, 4])
def test_hook_matches_compressed_allreduce_by_hand_and_ranks_agree(ranks, W):
    got = ranks(W).run(_body, 6, "sgd" if W != 3 else "adamw")
    flat0 = got[0][0]
    for flat, replay_equal, buckets, stats in got:
        assert torch.equal(flat, flat0)  # identical replicas
        assert replay_equal  # every compressed bucket == compressed_allreduce on it by hand
        assert buckets >= 2
        assert stats["iter"] == 6 and stats["compressing"] and stats["buckets"] == buckets
        assert stats["bytes_compressed"] > 0 and stats["bytes_full"] > 0
    assert torch.isfinite(flat0).all()


def _body_resume(steps: int, cut: int, path: str, adam: bool = False):
    r = dist.get_rank()

    def make(model):  # with adam, the hook compresses in AdamW's preconditioned space
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adam
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        return opt, OnebitCompressHookState(start_iter=2, optimizer=opt if adam else None)

    model = _model()
    opt, state = make(model)
    _train(model, opt, state, steps)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model = _model()
    opt, state = make(model)
    _train(model, opt, state, cut)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.__getstate__()},
               f"{path}.{r}")
    model = _model()
    opt, _ = make(model)
    saved = torch.load(f"{path}.{r}", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    # overwritten by the saved state
    state = OnebitCompressHookState(start_iter=7, optimizer=opt if adam else None)
    state.__setstate__(saved["hook"])
    _train(model, opt, state, steps - cut, start=cut)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return torch.equal(straight, resumed), state.iter, state.stats()["resets"]


@pytest.mark.parametrize("W,adam", [(2, False), (3, False), (2, True)], ids=["sgd-2", "sgd-3", "adamw-2"])
def test_hook_state_resumes_exactly(ranks, tmp_path, W, adam):
    # the resumed DDP's first iteration has one bucket where the saved state has several: the hook
    # compresses it as the saved buckets (a reset or a merged compression would not be bitwise);
    # with optimizer=, d comes from the restored optimizer state
    assert ranks(W).run(_body_resume, 7, 4, str(tmp_path / "ckpt"), adam) == [(True, 7, 0)] * W


def _body_other_model():
    import warnings

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = OnebitCompressHookState(start_iter=1)
    _train(model, opt, state, 3)
    saved = state.__getstate__()
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))
    opt = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
    state = OnebitCompressHookState()
    state.__setstate__(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(other, opt, state, 3, start=3)
    flat = torch.cat([p.detach().reshape(-1) for p in other.parameters()])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return flat, state.stats()["resets"], messages


def test_hook_state_on_another_model_restarts_error_with_one_warning(ranks):
    got = ranks(2).run(_body_other_model)
    for r, (flat, resets, messages) in enumerate(got):
        assert torch.equal(flat, got[0][0]) and torch.isfinite(flat).all()
        assert resets >= 1
        if r == 0:  # every rank resets alike; the warning is printed once, on rank 0
            assert len(messages) == 1 and "matches no bucket the state remembers" in messages[0]
        else:
            assert not messages


def test_hook_state_arguments():
    with pytest.raises(ValueError, match=r"^start_iter"):
        OnebitCompressHookState(start_iter=0)


def _expected_denominator(opt, params, floor_ratio=0.1):
    """d of the preconditioned hook, written out from docs/ALGORITHMS.md sections 6.2 and 8 (same
    float operations as the library, so the replay below is bitwise)."""
    parts = []
    for p in params:
        entry, group = opt.state[p], opt.param_groups[0]
        v = entry["exp_avg_sq"]
        s = v.sqrt()
        floor = (0.1 * (s.sum(dtype=torch.float64) / torch.count_nonzero(s).clamp(min=1)).float())
        assert floor > 0  # every parameter of _dead_model has some gradient
        bc2 = 1.0 - group["betas"][1] ** float(entry["step"])
        r = 1.0 / torch.tensor(math.sqrt(bc2), dtype=torch.float32)  # float32: 1 / sqrt(bc2) rounded twice
        root = torch.sqrt(v.double()).float()  # the correctly rounded sqrt (torch's float32 CPU one is not)
        parts.append((torch.maximum(root, floor) * r + group["eps"]).reshape(-1))
    return torch.cat(parts)


def _dead_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    return model


def _body_preconditioned(steps: int):
    W = dist.get_world_size()
    model = _dead_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = OnebitCompressHookState(start_iter=2, optimizer=opt)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    record, errors, replay_equal, dead = [], {}, True, []

    def hook(st, bucket):
        compressed = st.iter >= st.start_iter
        grad = bucket.buffer().clone()
        d = _expected_denominator(opt, bucket.parameters()) if compressed else None
        fut = onebit_compress_hook(st, bucket)
        if not compressed:
            return fut

        def keep(f):
            record.append((bucket.index(), grad, d, f.value().clone()))
            offset = 0
            for p in bucket.parameters():
                if p is model[0].weight and len(dead) == 0:  # its first compressed step
                    dead.append(d[offset:offset + p.numel()].view_as(p)[:, :5])
                offset += p.numel()
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, hook)
    for step in range(steps):
        x, y = _batch(step, dist.get_rank())
        x[:, :5] = 0.0  # five always-zero inputs: their weights' v stays exactly 0 (floored)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    for index, grad, d, out in record:
        N = padded_numel(grad.numel(), W, 64)
        we, se = errors.setdefault(index, _zeros(N, W))
        mine = compressed_allreduce(grad / d, we, se, block=64) * d
        replay_equal &= torch.equal(mine, out)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # the weights of the always-zero inputs had v = 0 at the first compressed step: all at the floor
    dead_floored = bool((dead[0] == dead[0][0, 0]).all() and dead[0][0, 0] > 1e3 * opt.param_groups[0]["eps"])
    return flat, replay_equal, len(record), dead_floored, bool(torch.isfinite(flat).all())


@pytest.mark.parametrize("W", [2, 3])
def test_preconditioned_hook_compresses_g_over_adams_denominator(ranks, W):
    # onebit_compress_hook with OnebitCompressHookState(optimizer=AdamW): every compressed bucket is
    # d * compressed_allreduce(g / d) with d from the optimizer's state before the step, floored
    # per parameter (always-zero inputs keep v = 0 on their weights: floored, not divided by eps)
    got = ranks(W).run(_body_preconditioned, 6)
    for flat, replay_equal, compressed, dead_floored, finite in got:
        assert torch.equal(flat, got[0][0])
        assert replay_equal and compressed >= 4
        assert dead_floored and finite


def test_preconditioned_hook_arguments():
    model = _model()
    with pytest.raises(TypeError, match=r"^optimizer"):
        OnebitCompressHookState(optimizer=model)
    with pytest.raises(ValueError, match=r"^variance_floor"):
        OnebitCompressHookState(optimizer=torch.optim.AdamW(model.parameters()), variance_floor=-1.0)


def _body_momentum(steps: int):
    W = dist.get_world_size()
    model = _model()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = torch.optim.SGD([{"params": first, "momentum": 0.9, "weight_decay": 1e-3},
                           {"params": rest, "momentum": 0.8, "dampening": 0.1, "nesterov": False,
                            "maximize": True}], lr=0.01)
    state = OnebitCompressHookState(start_iter=2, optimizer=opt)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    record, errors, replay_equal, momentum_close = [], {}, True, True

    def hook(st, bucket):
        compressed = st.iter >= st.start_iter
        grad = bucket.buffer().clone()
        c = None
        if compressed:  # docs/ALGORITHMS.md section 8, written out: s * b / (1 - tau) * buffer
            parts = []
            for p in bucket.parameters():
                g = groups[id(p)]
                factor = g["momentum"] / (1.0 - g["dampening"]) * (-1.0 if g["maximize"] else 1.0)
                parts.append((opt.state[p]["momentum_buffer"] * factor).reshape(-1))
            c = torch.cat(parts)
        fut = onebit_compress_hook(st, bucket)
        if not compressed:
            return fut

        def keep(f):
            record.append((bucket.index(), grad, c, f.value().clone(), list(bucket.parameters()),
                           [p.detach().clone() for p in bucket.parameters()]))
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, hook)
    for step in range(steps):
        x, y = _batch(step, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        record.sort(key=lambda r: r[0])  # the same order on every rank
        for index, grad, c, out, params, before in record:
            if index < 0:
                continue
            # the replay: every compressed bucket is compressed_allreduce(g + c) - c
            N = padded_numel(grad.numel(), W, 64)
            we, se = errors.setdefault(index, _zeros(N, W))
            average = compressed_allreduce(grad + c, we, se, block=64)
            replay_equal &= torch.equal(average - c, out)
            # what the optimizer's momentum now holds: the averaged momentum, (1 - tau) * s * (A + s * wd * p)
            offset = 0
            for p, p_before in zip(params, before, strict=True):
                g = groups[id(p)]
                s = -1.0 if g["maximize"] else 1.0
                a = average[offset:offset + p.numel()].view_as(p)
                want = (1.0 - g["dampening"]) * s * (a + s * g["weight_decay"] * p_before)
                momentum_close &= torch.allclose(opt.state[p]["momentum_buffer"], want, rtol=1e-5, atol=1e-7)
                offset += p.numel()
        record[:] = [(-1, *r[1:]) for r in record]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buffers = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return flat, buffers, replay_equal, momentum_close, len(errors), bool(torch.isfinite(flat).all())


@pytest.mark.parametrize("W", [2, 3])
def test_momentum_hook_compresses_sgds_momentum(ranks, W):
    # onebit_compress_hook with OnebitCompressHookState(optimizer=SGD(momentum=...)): every
    # compressed bucket is compressed_allreduce(g + c) - c with c = s * b / (1 - tau) *
    # momentum_buffer, so SGD's momentum after the step is the average of the ranks' momenta
    # (docs/ALGORITHMS.md section 8.1), with dampening, weight decay and maximize; replicas and
    # buffers stay identical
    got = ranks(W).run(_body_momentum, 6)
    for flat, buffers, replay_equal, momentum_close, buckets, finite in got:
        assert torch.equal(flat, got[0][0]) and torch.equal(buffers, got[0][1])
        assert replay_equal and momentum_close and buckets >= 2 and finite


def _body_deprecated(steps: int):
    import warnings

    from onebit.collectives import OnebitHookState, _group, onebit_hook
    from onebit.optimizers import OnebitAdam, onebit_comm_hook, register_ddp_hook

    _group._renamed_warned.clear()  # said once per process: another test in this worker may have
    flats, caught = [], []
    for old in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state = (OnebitHookState if old else OnebitCompressHookState)(start_iter=2, optimizer=opt)
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
            ddp.register_comm_hook(state, onebit_hook if old else onebit_compress_hook)
            for step in range(steps):
                x, y = _batch(step, dist.get_rank())
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
        flats.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        caught.append([str(w.message) for w in seen if issubclass(w.category, FutureWarning)])
    # the 1-bit optimizers' DDP hook under its old name: the same run as register_ddp_hook's
    runs = []
    for old in (False, True):
        model = _model()
        opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if old:
                ddp.register_comm_hook(opt, onebit_comm_hook)
                opt.external_averaging = True
            else:
                register_ddp_hook(ddp, opt)
            for step in range(steps):
                x, y = _batch(step, dist.get_rank())
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        caught.append([str(w.message) for w in seen if issubclass(w.category, FutureWarning)])
    return torch.equal(flats[0], flats[1]), torch.equal(runs[0], runs[1]), caught


def test_deprecated_names_still_work_and_say_their_new_names_once(ranks):
    # onebit_hook / OnebitHookState / onebit_comm_hook (renamed in 0.2.0, CHANGELOG.md): the
    # same results bitwise, one FutureWarning per old name on rank 0, none on the others
    got = ranks(2).run(_body_deprecated, 5)
    for rank, (same_hook, same_optimizer, caught) in enumerate(got):
        assert same_hook and same_optimizer
        new_hook, old_hook, new_opt, old_opt = caught
        assert new_hook == [] and new_opt == []
        if rank == 0:
            assert len(old_hook) == 2 and len(old_opt) == 1
            assert any("use onebit.collectives.onebit_compress_hook" in m for m in old_hook)
            assert any("use onebit.collectives.OnebitCompressHookState" in m for m in old_hook)
            assert "use onebit.optimizers.warmup_averaging_hook" in old_opt[0]
        else:
            assert old_hook == [] and old_opt == []
