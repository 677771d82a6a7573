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
    unchanged = (len(opt.param_groups) - groups, all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    # training goes on as before
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    return message, unchanged, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_add_param_group_after_training_started_makes_a_cohort(ranks, W, name):
    # was: KeyError 'exp_avg_sq' in warm-up, IndexError after the freeze, at the next step; then refused
    # (issue 58: a cohort of its own, tests/test_add_param_group.py)
    got = ranks(W).run(_body_add_param_group_after_start, name)
    for message, unchanged, flat in got:
        assert message == ""
        assert unchanged == (1, True)  # one more group, no parameter moved by adding it
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
        # exact errors: the two set-ups agree to float32 rounding (bfloat16's rounding keys on the
        # scales' bits, so a last-bit difference draws other bits)
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, error_dtype=torch.float32)
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
                        traffic.full, traffic.compressed, opt.stats())
    return results


@pytest.mark.parametrize("W", [2, 3])
def test_ddp_without_register_ddp_hook_registers_it_and_says_so(ranks, W):
    # was: no warning, DDP all-reduced full-precision gradients every step on top of the
    # optimizer's 1-bit traffic (50.3 MB against 13.3 MB with the hook)
    from onebit.collectives import padded_numel
    from onebit.collectives.wire import compressed_bytes, ring_allreduce_bytes

    got = ranks(W).run(_body_ddp_without_register, None)
    n = sum(p.numel() for p in _model().parameters())  # one DDP bucket, one optimizer bucket
    for r, res in enumerate(got):
        warned, flat, full, compressed, stats = res["forgot"]
        warned_ok, flat_ok, full_ok, compressed_ok, stats_ok = res["registered"]
        # stats() counts what the optimizer and its hook sent: 3 warm-up steps averaged by the
        # hook in full precision, 5 compressed steps, 8 one-element non-finite checks
        expect = {"bytes_full": 3 * ring_allreduce_bytes(n, W),
                  "bytes_control": 8 * ring_allreduce_bytes(1, W, 8),
                  "bytes_compressed": 5 * compressed_bytes(padded_numel(n, W), W)}
        assert {k: stats_ok[k] for k in expect} == expect
        assert stats_ok["bytes_sent"] == sum(expect.values())
        assert (stats_ok["bytes_full"], stats_ok["bytes_compressed"]) == (full_ok, compressed_ok)
        # forgot: the first backward ran before the hook existed (DDP's own all-reduce)
        assert stats["bytes_full"] == 2 * ring_allreduce_bytes(n, W)
        assert stats["bytes_compressed"] == expect["bytes_compressed"]
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


def _body_never_compressed(name: str, freeze):
    import math
    import warnings

    from onebit.optimizers import AutoFreeze
    from onebit.optimizers._stats import say_never_compressed

    freeze = {"inf": math.inf, "auto": AutoFreeze(min_step=100)}.get(freeze, freeze)
    model = _model()
    if name == "zero_one":
        kw = {} if freeze is None else {"var_freeze_step": freeze}
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, **kw)
    else:
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    g = torch.Generator().manual_seed(dist.get_rank())
    left = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(20):
            left.append(opt.steps_to_compression())
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        during = len(seen)
        say_never_compressed()  # what interpreter exit calls (the end of training)
        say_never_compressed()  # said once
    messages = [str(w.message) for w in seen[during:] if issubclass(w.category, RuntimeWarning)]
    return messages, left, opt.stats()["bytes_compressed"]


@pytest.mark.parametrize("W", [2, 3])
def test_a_run_that_never_compressed_says_so_at_the_end(ranks, W):
    # was: only stats()['stage'] showed it
    for freeze, why in [(50, "freeze_step=50 is 30 updates away"),
                        ("auto", "never found the variance settled")]:
        got = ranks(W).run(_body_never_compressed, "adam", freeze)
        for r, (messages, left, compressed) in enumerate(got):
            assert compressed == 0
            if r == 0:
                assert len(messages) == 1, messages
                assert "compressed none" in messages[0] and why in messages[0], messages[0]
                assert "Set freeze_step to about 20% of the run" in messages[0]
            else:
                assert messages == []
            assert left == ([50 - k for k in range(20)] if freeze == 50 else [None] * 20)
    for freeze in (3, "inf"):  # it compressed, or the user asked for never
        for messages, _, compressed in ranks(W).run(_body_never_compressed, "adam", freeze):
            assert messages == [] and (compressed > 0) == (freeze == 3)
    # 0/1 Adam compresses its gradients once var_update_scaler (16) variance updates doubled the
    # interval, whatever var_freeze_step says (its default 100000 is no cause for a warning)
    for freeze, first in ((None, 16), (4, 4)):
        for messages, left, compressed in ranks(W).run(_body_never_compressed, "zero_one", freeze):
            assert messages == [] and compressed > 0
            assert left[: first + 1] == list(range(first, -1, -1)) and set(left[first:]) == {0}, left


EXIT_SCRIPT = """
import torch, torch.distributed as dist
from onebit import OnebitAdam
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=50)
for _ in range(5):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("W", [2, 3])
def test_a_run_that_never_compressed_says_so_at_interpreter_exit(tmp_path, W):
    # W = 2 ends with barrier + destroy_process_group, W = 3 with onebit.finish() (which runs the
    # atexit handlers itself, then skips finalisation): the message, once, and exit status 0
    import os

    from zygote import launch

    script = tmp_path / "short_run.py"
    bare = "dist.barrier()\ndist.destroy_process_group()\n"
    ending = "import onebit\nonebit.finish()\n" if W == 3 else bare
    script.write_text(EXIT_SCRIPT + ending)
    # W ranks started as torchrun starts them (tests/zygote.py: at the script's end the
    # interpreter's exit steps, atexit handlers included)
    run = launch(script, nproc=W, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if "compressed none" in line]
    assert len(said) == 1 and "freeze_step=50 is 45 updates away" in said[0], run.stderr[-3000:]


def _body_bytes_counted(name: str):
    from onebit.collectives import traffic
    from onebit.optimizers import AutoFreeze

    cls = {"adam": OnebitAdam, "adam_auto": OnebitAdam, "lamb": OnebitLamb, "zero_one": ZeroOneAdam}[name]
    freeze = {"zero_one": {"var_freeze_step": 4},
              "adam_auto": {"freeze_step": AutoFreeze(window=2, min_step=2, max_step=6)}}
    model = _model()
    opt = cls(model.parameters(), lr=1e-2, **freeze.get(name, {"freeze_step": 3}))
    traffic.reset()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(9):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    fresh = cls(model.parameters(), lr=1e-2, **freeze.get(name, {"freeze_step": 3}))
    fresh.load_state_dict(opt.state_dict())
    counted = {"full": traffic.full, "compressed": traffic.compressed, "control": traffic.control}
    return stats, fresh.stats(), counted


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", ["adam", "adam_auto", "lamb", "zero_one"])
def test_stats_counts_every_byte_the_optimizer_sends(ranks, W, name):
    from onebit.collectives import padded_numel
    from onebit.collectives.wire import compressed_bytes, ring_allreduce_bytes

    n = sum(p.numel() for p in _model().parameters())
    for stats, resumed, counted in ranks(W).run(_body_bytes_counted, name):
        assert {k: stats[f"bytes_{k}"] for k in counted} == counted  # the same as onebit's global counter
        assert stats["bytes_sent"] == sum(counted.values())
        assert {k: v for k, v in resumed.items() if k.startswith("bytes_")} == \
            {k: v for k, v in stats.items() if k.startswith("bytes_")}  # saved with the state
        assert stats["bytes_compressed"] > 0 and stats["bytes_full"] > 0
        if name == "adam":  # 3 averaged steps, 6 compressed ones, 9 non-finite checks
            assert stats["bytes_full"] == 3 * ring_allreduce_bytes(n, W)
            assert stats["bytes_compressed"] == 6 * compressed_bytes(padded_numel(n, W), W)
            assert stats["bytes_control"] == 9 * ring_allreduce_bytes(1, W, 8)
        if name == "adam_auto":  # freeze votes at updates 2 and 4 (max_step 6 froze it) count too
            assert stats["bytes_control"] == 11 * ring_allreduce_bytes(1, W, 8)
            assert stats["bytes_compressed"] == 3 * compressed_bytes(padded_numel(n, W), W)


def _body_warnings_point_at_the_users_line():
    import inspect
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitHookState, _group, onebit_hook

    _group._renamed_warned.clear()  # said once per process: another test in this worker may have
    here = []  # (line, what) of each call below that should carry a warning

    def line(what):
        if what not in [w for _, w in here]:  # (in the loop: said once)
            here.append((inspect.currentframe().f_back.f_lineno + 1, what))

    r = dist.get_rank()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = DistributedDataParallel(_model())  # no register_ddp_hook: adopted at the first step
        opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, auto_mask=0.5)
        x = torch.zeros(4, 8)
        x[:, 0] = 1.0  # one feature only: most first-layer weights get no gradient (masked)
        model(x).square().mean().backward()
        line("registered the hook for you")
        opt.step()
        opt.zero_grad()
        (model(x).square().mean() * (float("nan") if r == 1 else 1.0)).backward()
        line("step skipped")
        opt.step()
        opt.zero_grad()
        for _ in range(3):
            model(x).square().mean().backward()
            line("masks the compressed momentum")
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        saved["onebit"]["rank"] = 1 - r if r < 2 else r  # ranks 0 and 1 load each other's state
        opt.load_state_dict(saved)
        model(x).square().mean().backward()
        line("loaded an optimizer state saved by another rank")
        opt.step()
        fresh = OnebitAdam(_model().parameters(), lr=1e-2)
        line("compressed none")
        fresh.stats()
        hooked = DistributedDataParallel(_model())
        line("OnebitHookState is deprecated")
        state = OnebitHookState()
        hooked.register_comm_hook(state, onebit_hook)
        line("onebit_hook is deprecated")
        hooked(x).sum().backward()  # DDP calls the hook from backward: the user's line is backward()
        hooked(x).sum().backward()
    got = [(w.filename, w.lineno, str(w.message)) for w in seen
           if issubclass(w.category, (RuntimeWarning, FutureWarning)) and "onebit" in str(w.message)]
    return got, here, __file__


@pytest.mark.parametrize("W", [2, 3])
def test_warnings_point_at_the_users_line(ranks, W):
    # was: torch/utils/_contextlib.py:124 (the no_grad decorator around step())
    got = ranks(W).run(_body_warnings_point_at_the_users_line)
    warned, expected, filename = got[0]
    for lineno, what in expected:
        found = [w for w in warned if what in w[2]]
        assert len(found) == 1, (what, warned)
        assert found[0][:2] == (filename, lineno), (what, found[0][:2], lineno)
    assert len(warned) == len(expected), warned
    for other, _, _ in got[1:]:
        assert other == []  # said once, on group rank 0


def _rank_grads(r: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    # rank-dependent scale, heavy tails and an all-zero tensor: the ranks' local norms differ
    out = [torch.randn(s, generator=g, dtype=torch.float64) ** 3 * (1 + r) for s in shapes]
    out[-1].zero_()
    return out


def _body_clip(norm_type: float, max_norm: float):
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    shapes = [p.shape for p in model.parameters()]
    r, W = dist.get_rank(), dist.get_world_size()
    for p, g in zip(model.parameters(), _rank_grads(r, shapes), strict=True):
        p.grad = g.float()
    before = [p.grad.clone() for p in model.parameters()]
    try:
        opt.clip_grad_norm_(-1.0)
    except ValueError as e:
        refused = str(e)
    unchanged = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))
    norm = opt.clip_grad_norm_(max_norm, norm_type)
    # float64 reference from every rank's gradients (as stored: float32)
    local = [torch.cat([g.float().double().reshape(-1) for g in _rank_grads(q, shapes)]) for q in range(W)]
    if norm_type == float("inf"):
        expect = max(v.abs().max() for v in local)
    else:
        expect = (sum(v.abs().pow(norm_type).sum() for v in local) / W) ** (1 / norm_type)
    scale = min(1.0, max_norm / (float(expect) + 1e-6))
    after = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    return float(norm), float(expect), float((after - local[r] * scale).abs().max()), \
        float(local[r].abs().max()), refused, unchanged, opt.stats()["bytes_control"]


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize(("norm_type", "max_norm"), [(2.0, 1.0), (1.0, 5.0), (float("inf"), 0.5), (2.0, 1e9)])
def test_clip_grad_norm_agrees_across_ranks(ranks, W, norm_type, max_norm):
    # was: clip_grad_norm_ before step() saw local gradients: each rank clipped by its own factor
    got = ranks(W).run(_body_clip, norm_type, max_norm)
    for norm, expect, err, big, refused, unchanged, control in got:
        assert norm == got[0][0]  # bitwise the same on every rank
        assert abs(norm - expect) <= 1e-12 * expect
        assert err <= 1e-6 * big  # every rank scaled by the same factor (float32 gradients)
        assert refused.startswith("max_norm: expected a number >= 0") and unchanged
        assert control > 0  # the all-reduce is counted
