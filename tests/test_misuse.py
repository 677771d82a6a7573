"""The mistakes a new user makes (issue 27): each is refused at the moment it is made, with a
message that says what to do instead, or made harmless. Every case runs at W = 2 and W = 3.
(freeze_step=0: tests/test_auto_freeze.py; another rank's state: tests/test_optimizer_state.py;
renamed names: tests/test_ddp_hook.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _body_add_param_group_after_start(name: str):
    cls = {"adam": OnebitAdam, "lamb": OnebitLamb, "zero_one": ZeroOneAdam}[name]
    model = _model()
    extra = torch.nn.Parameter(torch.ones(5))
    freeze = {"var_freeze_step" if name == "zero_one" else "freeze_step": 2}  # 3 steps cross the freeze
    opt = cls(list(model.parameters())[:2], lr=1e-2, **freeze)
    opt.add_param_group({"params": list(model.parameters())[2:]})  # before training: allowed
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    groups = len(opt.param_groups)
    try:
        opt.add_param_group({"params": [extra]})
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    unchanged = len(opt.param_groups) == groups and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # training goes on as before
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    return message, unchanged, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_add_param_group_after_training_started_is_refused(ranks, W, name):
    # was: KeyError 'exp_avg_sq' in warm-up, IndexError after the freeze, at the next step
    got = ranks(W).run(_body_add_param_group_after_start, name)
    for message, unchanged, flat in got:
        assert message.startswith("add_param_group: ") and "training started" in message, message
        assert "pass every parameter group to the constructor" in message
        assert unchanged
        assert torch.equal(flat, got[0][2])  # replicas still identical after the next step


def _body_ddp_without_register(hook: str | None):
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook, traffic
    from onebit.optimizers import register_ddp_hook

    results = {}
    for way in ("forgot", "registered"):
        model = DistributedDataParallel(_model())
        if hook == "compress":
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            model.register_comm_hook(OnebitCompressHookState(optimizer=sgd), onebit_compress_hook)
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
        if way == "registered" and hook is None:
            register_ddp_hook(model, opt)
        traffic.reset()
        g = torch.Generator().manual_seed(dist.get_rank())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                for _ in range(8):
                    model(torch.randn(4, 8, generator=g)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            except ValueError as e:
                results[way] = ("error", str(e))
                continue
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        results[way] = ([str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], flat,
                        traffic.full, traffic.compressed)
    return results


@pytest.mark.parametrize("W", [2, 3])
def test_ddp_without_register_ddp_hook_registers_it_and_says_so(ranks, W):
    # was: no warning, DDP all-reduced full-precision gradients every step on top of the
    # optimizer's 1-bit traffic (50.3 MB against 13.3 MB with the hook)
    got = ranks(W).run(_body_ddp_without_register, None)
    for r, res in enumerate(got):
        warned, flat, full, compressed = res["forgot"]
        warned_ok, flat_ok, full_ok, compressed_ok = res["registered"]
        if r == 0:
            assert len(warned) == 1 and "onebit registered the hook for you" in warned[0], warned
        else:
            assert warned == []
        assert warned_ok == []
        # the first backward ran before the hook existed (DDP averaged it); from then on the
        # same traffic as a correct set-up, and the same training
        assert compressed == compressed_ok and full <= full_ok * 2
        assert torch.allclose(flat, flat_ok, atol=1e-5), (flat - flat_ok).abs().max()
        assert torch.equal(flat, got[0]["forgot"][1])  # replicas identical


@pytest.mark.parametrize("W", [2, 3])
def test_a_one_bit_optimizer_behind_the_compress_hook_is_refused(ranks, W):
    # was: onebit_compress_hook and a 1-bit optimizer together compressed twice, silently
    got = ranks(W).run(_body_ddp_without_register, "compress")
    for res in got:
        kind, message = res["forgot"]
        assert kind == "error" and message.startswith("step: OnebitAdam's parameters belong to"), message
        assert "onebit_compress_hook" in message and "register_ddp_hook(model, opt)" in message


def _body_swapped_hooks(which: str):
    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.optimizers import warmup_averaging_hook

    model = DistributedDataParallel(_model())
    if which == "optimizer-to-compress-hook":
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
        model.register_comm_hook(opt, onebit_compress_hook)
    elif which == "state-to-warmup-hook":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.register_comm_hook(OnebitCompressHookState(optimizer=opt), warmup_averaging_hook)
    else:  # a 1-bit optimizer given to the compress hook's state
        try:
            OnebitCompressHookState(optimizer=OnebitAdam(model.parameters(), lr=1e-2))
        except TypeError as e:
            return str(e)
        return ""
    try:
        model(torch.randn(4, 8)).square().mean().backward()
    except Exception as e:  # DDP reports the hook's exception from backward
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("which,expected", [
    ("optimizer-to-compress-hook", "onebit_compress_hook: its state must be an OnebitCompressHookState"),
    ("state-to-warmup-hook", "warmup_averaging_hook: its state must be a onebit 1-bit optimizer"),
    ("onebit-optimizer-in-state", "optimizer: OnebitAdam compresses its own momentum"),
])
def test_swapped_hooks_say_which_goes_with_which(ranks, W, which, expected):
    # was: an AttributeError on an internal name at the first backward
    for message in ranks(W).run(_body_swapped_hooks, which):
        assert expected in message, message
        assert "register_ddp_hook(model, opt)" in message or "onebit_compress_hook" in message


def _body_different_initial_weights(name: str):
    from onebit.collectives import ReplicaMismatchError

    cls = {"adam": OnebitAdam, "lamb": OnebitLamb, "zero_one": ZeroOneAdam}[name]
    torch.manual_seed(dist.get_rank())  # the mistake: each rank its own initial weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = cls(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 8)).square().mean().backward()
    try:
        opt.step()
    except ReplicaMismatchError as e:
        message = str(e)
    else:
        message = ""
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return message, untouched


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_ranks_with_different_initial_weights_are_stopped_at_the_first_step(ranks, W, name):
    # was: no complaint; after 60 steps the replicas still differed by up to 0.35 per weight
    # while opt.replicas_identical said True
    for message, untouched in ranks(W).run(_body_different_initial_weights, name):
        assert message.startswith("step: before ") and "the ranks hold different parameters" in message
        assert "torch.manual_seed" in message and "same checkpoint" in message
        assert untouched


def _body_default_freeze(freeze):
    import warnings

    model = _model()
    kw = {} if freeze is None else {"freeze_step": freeze}
    opt = OnebitAdam(model.parameters(), lr=1e-2, **kw)
    g = torch.Generator().manual_seed(dist.get_rank())
    left, messages = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(5):
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            stats = opt.stats()  # a script that logs stats() every step
            left.append(stats["steps_to_compression"])
        messages = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    return left, messages, opt.stats()["stage"]


@pytest.mark.parametrize("W", [2, 3])
def test_the_default_freeze_that_never_comes_is_reported(ranks, W):
    # was: freeze_step=100000 (the default) never compressed a short run; only
    # stats()['stage'] showed it. Now stats() counts the steps left and says so once (rank 0).
    for r, (left, messages, stage) in enumerate(ranks(W).run(_body_default_freeze, None)):
        assert left == [100000 - k for k in range(1, 6)] and stage == "warm-up"
        if r == 0:
            assert len(messages) == 1 and "freeze_step=100000 (the reference's default)" in messages[0]
            assert "Set freeze_step" in messages[0]
        else:
            assert messages == []
    for left, messages, stage in ranks(W).run(_body_default_freeze, 3):  # a freeze the user chose
        assert left == [2, 1, 0, 0, 0] and stage == "compression" and messages == []
