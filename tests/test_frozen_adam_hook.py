"""AdamW behind the DDP hook with ``freeze_step`` (docs/ALGORITHMS.md section 8.2): plain DDP until
the freeze, then the variance frozen and each rank's momentum compressed; torch's AdamW steps
with the compressed average momentum and the frozen denominator."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

F = 3  # freeze_step


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))


def _batch(t, r):
    g = torch.Generator().manual_seed(1000 * t + r)
    x = torch.randn(8, 12, generator=g) + 0.5 * r
    return x, (x[:, :3] * (1 + r)).argmax(1)


def _old_format(saved: dict, opt, state) -> dict:
    """The hook state as the release before issue 56 saved it: the frozen denominators themselves
    (and the optimizer's exp_avg_sq rewritten every step; here it is v_F, which an old run's is not:
    the denominators loaded must be what the run uses)."""
    saved = dict(saved)
    fa = state._frozen_adam
    ids = {id(p): p for p in opt.param_groups[0]["params"]}
    by_name = {name: ids[i] for i, name in state._names.items() if i in ids}
    names = list(fa.scalars)
    saved["frozen_adam"] = {"freeze_step": fa.freeze_step, "names": [list(n) for n in names],
                            "denominators": [fa.denominator(opt, by_name[n], n).clone() for n in names]}
    for p in by_name.values():  # what the old release left in exp_avg_sq: not v_F
        opt.state[p]["exp_avg_sq"].mul_(0.5)
    return saved


def _body(steps, hooked, resume_at=None, clip=None, old_format=False):
    r = dist.get_rank()
    model = DDP(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = None
    if hooked:
        state = OnebitCompressHookState(optimizer=opt, freeze_step=F, block=16)
        model.register_comm_hook(state, onebit_compress_hook)
    out = []
    for t in range(steps):
        if resume_at is not None and t == resume_at:  # a fresh DDP, optimizer and state from the saved ones
            hook_state = _old_format(state.__getstate__(), opt, state) if old_format else state.__getstate__()
            saved = (model.module.state_dict(), opt.state_dict(), hook_state)
            model = DDP(_model())
            model.module.load_state_dict(saved[0])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            opt.load_state_dict(saved[1])
            state = OnebitCompressHookState(optimizer=opt, freeze_step=F, block=16)
            state.__setstate__(saved[2])
            model.register_comm_hook(state, onebit_compress_hook)
        x, y = _batch(t, r)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            state.clip_grad_norm_(clip)
        before = {p: opt.state[p]["exp_avg"].clone() for p in model.parameters() if p in opt.state}
        handed = {p: p.grad.clone() for p in model.parameters()}
        opt.step()
        row = {"params": [p.detach().clone() for p in model.parameters()]}
        if hooked and t >= F:
            fa = state._frozen_adam
            names = state._names
            # no denominator is kept: d comes from exp_avg_sq, which stays v_F (the variance at the freeze)
            row["kept"] = [k for k in vars(fa) if k in ("denominators", "flat")] + list(fa.legacy)
            row["v"] = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
            row["d"] = [fa.denominator(opt, p, names[id(p)]) for p in model.parameters()]
            for p, d in zip(model.parameters(), row["d"], strict=True):
                st = opt.state[p]
                bc2 = 1 - 0.999**F  # the bias correction of the freeze's step, not this one's
                unfloored = st["exp_avg_sq"].double().sqrt() / math.sqrt(bc2) + 1e-8
                # max(sqrt(v_F), floor) / sqrt(bc2_F) + eps: at least the unfloored, equal where v_F is big
                # (an old checkpoint's loaded d: its exp_avg_sq is not v_F)
                big = unfloored > 2 * unfloored.mean()
                if not fa.legacy:
                    assert torch.all(d.double() >= unfloored * (1 - 1e-6)), "d below sqrt(v_F / bc2_F)"
                    assert torch.allclose(d.double()[big], unfloored[big], rtol=1e-6), "not v_F's denominator"
                b1 = 0.9
                want = before[p] * b1 + handed[p] * (1 - b1)
                assert torch.allclose(st["exp_avg"], want, rtol=1e-5, atol=1e-7), "momentum not rebuilt"
                assert torch.equal(p.grad, handed[p]), "gradient not restored after the step"
        opt.zero_grad()
        out.append(row)
    stats = state.stats() if state is not None else None
    return out, stats


def test_freeze_step_trains_identical_replicas_with_a_frozen_denominator(ranks):
    got = ranks(2).run(_body, 10, True)
    plain = ranks(2).run(_body, F, False)
    for r in range(2):
        for t in range(10):
            for a, b in zip(got[r][0][t]["params"], got[0][0][t]["params"], strict=True):
                assert torch.equal(a, b), f"rank {r} step {t}: replicas differ"
        for t in range(F):  # plain DDP until the freeze, bitwise
            for a, b in zip(got[r][0][t]["params"], plain[r][0][t]["params"], strict=True):
                assert torch.equal(a, b), f"step {t}: not plain DDP before the freeze"
    s = got[0][1]
    assert s["compressing"] and s["bytes_compressed"] > 0 and s["bytes_full"] > 0
    # frozen: exp_avg_sq (v_F) and the denominator computed from it bitwise the same at every compressed
    # step; nothing else holds a denominator
    for r in range(2):
        rows = got[r][0][F:]
        assert all(row["kept"] == [] for row in rows)
        for row in rows[1:]:
            assert all(torch.equal(a, b) for a, b in zip(row["v"], rows[0]["v"], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(row["d"], rows[0]["d"], strict=True))


def test_freeze_step_resumes_bitwise_with_its_frozen_denominators(ranks):
    whole = ranks(2).run(_body, 9, True)
    resumed = ranks(2).run(_body, 9, True, 6)
    for r in range(2):
        for a, b in zip(resumed[r][0][-1]["params"], whole[r][0][-1]["params"], strict=True):
            assert torch.equal(a, b), f"rank {r}: the resumed run differs"


def test_a_checkpoint_that_kept_the_denominators_loads_and_resumes(ranks):
    # the release before issue 56 saved d itself and rewrote exp_avg_sq every step: such a state loads,
    # its denominators are used as they came, and the run goes on to within rounding of the whole one
    whole = ranks(2).run(_body, 9, True)
    resumed = ranks(2).run(_body, 9, True, 6, None, True)
    for r in range(2):
        for a, b in zip(resumed[r][0][-1]["params"], whole[r][0][-1]["params"], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"rank {r}: the resumed run differs"
        assert resumed[r][0][-1]["kept"], "the loaded denominators are not what the run uses"


def test_a_run_that_clips_resumes_bitwise(ranks):
    # the clip's sketches (drawn from the optimizer steps seen, made once the clip was asked for) go on
    # after a resume as in the whole run: the hook state saves both
    whole = ranks(2).run(_body, 9, True, None, 0.05)
    resumed = ranks(2).run(_body, 9, True, 6, 0.05)
    for r in range(2):
        for a, b in zip(resumed[r][0][-1]["params"], whole[r][0][-1]["params"], strict=True):
            assert torch.equal(a, b), f"rank {r}: the resumed run differs"


def test_agreed_clip_after_the_freeze(ranks):
    got = ranks(2).run(_body, 8, True, None, 0.05)
    for r in range(2):
        for a, b in zip(got[r][0][-1]["params"], got[0][0][-1]["params"], strict=True):
            assert torch.equal(a, b)


def test_freeze_step_refuses_what_it_cannot_do():
    model = _model()
    with pytest.raises(ValueError, match="freeze_step: needs an Adam-type"):
        OnebitCompressHookState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                freeze_step=5)
    with pytest.raises(ValueError, match="amsgrad"):
        OnebitCompressHookState(optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True), freeze_step=5)
    with pytest.raises(ValueError, match="freeze_step"):
        OnebitCompressHookState(optimizer=torch.optim.AdamW(model.parameters()), freeze_step=0)
    saved = OnebitCompressHookState(optimizer=torch.optim.AdamW(model.parameters()), freeze_step=5)
    with pytest.raises(ValueError, match="freeze_step=5"):
        OnebitCompressHookState().__setstate__(saved.__getstate__())


def _body_closure(steps, prepare):
    r = dist.get_rank()
    model = DDP(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = OnebitCompressHookState(optimizer=opt, freeze_step=F, block=16)
    model.register_comm_hook(state, onebit_compress_hook)
    for t in range(steps):
        x, y = _batch(t, r)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if prepare:
                state.prepare_step()  # as Lightning's OnebitCallback does, after backward
            return loss

        try:
            opt.step(closure)
        except RuntimeError as e:
            return t, str(e)
    return [p.detach().clone() for p in model.parameters()]


def test_a_step_with_a_closure_needs_prepare_step_and_then_matches(ranks):
    plain = ranks(2).run(_body, 8, True)
    got = ranks(2).run(_body_closure, 8, True)
    for r in range(2):
        for a, b in zip(got[r], plain[r][0][-1]["params"], strict=True):
            assert torch.equal(a, b), f"rank {r}: the closure run differs"
    failed = ranks(2).run(_body_closure, 8, False)
    assert failed[0][0] == F and "state.prepare_step()" in failed[0][1], failed[0]


def _wide_body(steps, route):
    """A layer of 2^16 weights behind the hook with freeze_step, its passes around the collective by
    ``route``: ``codec`` inside the codec's C passes (collectives/_hook_fused.py), ``plain`` the plain
    ops; on a 2 x 1 mesh (where the codec's passes cannot take them) ``mesh`` one C pass each way over
    the bucket (onebit.kernels.fused.hook.hook_pre_range, the local norm inside), ``mesh-plain`` the
    plain ops. The C calls counted (``range``: the passes over a whole bucket)."""
    from torch.distributed.device_mesh import init_device_mesh

    from onebit.kernels import cpu_fused
    from onebit.kernels.backends import use_backend
    from onebit.kernels.fused import hook

    saved = cpu_fused.frozen_adam_, hook.hook_pre_range, hook.hook_encode
    cpu_fused.frozen_adam_ = lambda *a, **k: False  # the optimizer's own step: its plain ops in every run
    calls = {"range": 0, "in_codec": 0}

    def counted(name, fn):
        def run(*a):
            calls[name] += name != "range" or a[1] == 0  # (not the codec's own padded chunk tails)
            return fn(*a)
        return run

    hook.hook_pre_range, hook.hook_encode = counted("range", saved[1]), counted("in_codec", saved[2])
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("node", "local")) if "mesh" in route else None
    try:  # the rank processes serve later tests: the modules are put back as they were
        with use_backend("plain", steps=["hook"]) if "plain" in route else contextlib.nullcontext():
            return _wide_run(steps, mesh), calls
    finally:
        cpu_fused.frozen_adam_, hook.hook_pre_range, hook.hook_encode = saved


def _wide_run(steps, mesh=None):
    r = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    state = OnebitCompressHookState(mesh, optimizer=opt, freeze_step=F, block=64)
    model.register_comm_hook(state, onebit_compress_hook)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + r)
        x = torch.randn(16, 256, generator=g)
        x[:, :7] = 0.0  # always-zero features: zero gradient columns in the big layer
        torch.nn.functional.cross_entropy(model(x), (x[:, 7:11]).argmax(1)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_the_hooks_fused_passes_are_bitwise_the_plain_ops(ranks):
    """On CPU the hook's passes around the collective (``(g + c) / d`` before, ``out * d - c``
    after) run inside the codec's C passes, or, on a mesh, as one C pass each way over the bucket:
    the same float32 operations, so each run is bitwise the one with the plain ops; the C ran
    (4 compressed iterations, one bucket) and the replicas agree."""
    from onebit.kernels import cpu_simd

    if not cpu_simd.available():
        pytest.skip("no C passes on this CPU")
    routes = ("codec", "plain", "mesh", "mesh-plain")
    runs = {route: ranks(2).run(_wide_body, F + 4, route) for route in routes}
    want = {"codec": {"range": 0, "in_codec": 4 * 2}, "plain": {"range": 0, "in_codec": 0},  # 2 chunks
            "mesh": {"range": 4, "in_codec": 0}, "mesh-plain": {"range": 0, "in_codec": 0}}
    for route, same_as in (("codec", "plain"), ("mesh", "mesh-plain")):
        for r in range(2):
            assert runs[route][r][1] == want[route], (route, runs[route][r][1])
            assert runs[same_as][r][1] == want[same_as], (same_as, runs[same_as][r][1])
            for a, b in zip(runs[route][r][0], runs[same_as][r][0], strict=True):
                assert torch.equal(a, b), route
            for a, b in zip(runs[route][r][0], runs[route][0][0], strict=True):
                assert torch.equal(a, b)  # replicas agree


def _own_step_body(steps, own, kind):
    """The wide layer behind the hook with freeze_step under torch's AdamW (or Adam with L2):
    the update made by the hook's pre-hook itself (``own``) or by torch's step on the prepared
    state; the compiled one-pass step counted."""
    from onebit.kernels import cpu_fused
    from onebit.kernels.backends import use_routes

    saved = cpu_fused.frozen_adam_
    calls = []

    def counted(*a, **k):
        done = saved(*a, **k)
        calls.append(done)
        return done

    cpu_fused.frozen_adam_ = counted
    try:
        with use_routes(own_step=own):
            params, steps_counted = _own_step_run(steps, kind)
        return params, calls, steps_counted
    finally:
        cpu_fused.frozen_adam_ = saved


def _own_step_run(steps, kind):
    r = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4)))
    # Adam without L2 decay: with it the prepared route's variance takes (1 - b2) (wd p)^2
    # (docs/ALGORITHMS.md 8.2), the own step keeps it frozen: the routes differ by more than rounding
    cls, wd = (torch.optim.AdamW, 0.01) if kind == "adamw" else (torch.optim.Adam, 0.0)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=wd)
    # exact errors: the two routes agree to float32 rounding (bfloat16's rounding would draw other bits)
    state = OnebitCompressHookState(optimizer=opt, freeze_step=F, block=64, error_dtype=torch.float32)
    model.register_comm_hook(state, onebit_compress_hook)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + r)
        x = torch.randn(16, 256, generator=g)
        torch.nn.functional.cross_entropy(model(x), (x[:, 7:11]).argmax(1)).backward()
        handed = [p.grad for p in model.parameters()]
        opt.step()
        assert all(p.grad is h for p, h in zip(model.parameters(), handed, strict=True))  # restored
        opt.zero_grad()
    steps_counted = [int(opt.state[p]["step"]) for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], steps_counted


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_the_hooks_own_adam_step_is_torchs_step_on_the_frozen_denominator(ranks, kind):
    """For torch's Adam and AdamW the pre-hook makes the update itself (one pass over p, g, m, d
    and v; torch's step skips the parameter) instead of preparing the state for torch's step:
    the same maths to rounding (the prepared route's denominator is d after a square and a root),
    torch's step count kept, the gradient handed back, the replicas identical, and the large
    layer's update in the compiled pass."""
    own = ranks(2).run(_own_step_body, F + 4, True, kind)
    prepared = ranks(2).run(_own_step_body, F + 4, False, kind)
    for r in range(2):
        params, calls, counted = own[r]
        assert calls.count(True) == 4 and prepared[r][1] == [], calls  # 4 compressed steps, 1 big weight
        assert counted == prepared[r][2] == [F + 4] * 4
        for a, b in zip(params, prepared[r][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(params, own[0][0], strict=True):
            assert torch.equal(a, b)
    moved = [not torch.equal(a, b) for a, b in zip(own[0][0], prepared[0][0], strict=True)]
    assert any(moved)  # two routes, not one: rounding tells them apart
