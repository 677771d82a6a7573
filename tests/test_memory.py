"""onebit.memory: the bytes of state reachable from an object, counted as a user's profiler would."""

from __future__ import annotations

import functools

import torch

from onebit.memory import bytes_per_parameter, state_bytes


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def test_adamw_holds_its_two_moments_and_its_step_counters():
    net = _net()
    opt = torch.optim.AdamW(net.parameters())
    assert bytes_per_parameter(opt) == 0.0  # no state before the first step
    net(torch.randn(4, 33)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in net.parameters())
    steps = sum(opt.state[p]["step"].untyped_storage().nbytes() for p in net.parameters())
    assert bytes_per_parameter(opt) == (8 * n + steps) / n


def test_each_storage_once_views_and_closures_included_parameters_and_modules_left_out():
    net = _net()
    p = next(net.parameters())
    p.grad = torch.ones_like(p)
    buffer = torch.zeros(100)
    held = torch.zeros(7, dtype=torch.float64)

    class Holder:
        __slots__ = ("views", "hook", "model", "param", "part")

        def __init__(self):
            self.views = [buffer[:10], buffer[50:], buffer]  # one storage: 400 bytes
            self.hook = functools.partial(lambda t: t, held)  # 56 bytes through a partial
            self.model = net  # a model is not state: not walked
            self.param = p  # the parameters and their gradients are left out
            self.part = {"grad": p.grad, "nested": ({"deep": [torch.zeros(3, dtype=torch.int8)]},)}

    def closure():
        return buffer.sum() + held.sum()

    assert state_bytes(Holder(), closure, exclude=[p]) == 400 + 56 + 3
    assert state_bytes(Holder()) == 400 + 56 + 3 + 2 * p.numel() * 4  # nothing excluded: p and its grad


def _steps(opt, net, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        net(torch.randn(8, 33, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_warmups_averaging_buffer_is_freed_at_the_freeze_and_made_again_for_a_warmup_checkpoint():
    from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

    makers = {"adam": lambda ps: OnebitAdam(ps, lr=1e-3, freeze_step=3),
              "lamb": lambda ps: OnebitLamb(ps, lr=1e-3, freeze_step=3),
              "zoa": lambda ps: ZeroOneAdam(ps, lr=1e-3, var_freeze_step=3)}
    for name, make in makers.items():
        net = _net()
        opt = make(net.parameters())
        _steps(opt, net, 1)
        warm, largest = opt.state_dict(), max(b.numel for b in opt.reducer().buckets)
        assert opt.reducer()._scratch.numel() == largest, name
        _steps(opt, net, 5)
        assert opt.reducer()._scratch is None, name  # no full-precision step follows the freeze
        opt.load_state_dict(warm)  # back in the warm-up: its next step averages again
        _steps(opt, net, 1)
        assert opt.reducer()._scratch is not None and opt.reducer()._scratch.numel() == largest, name


def test_past_the_freeze_the_stale_denominator_is_computed_not_kept():
    # one frozen quantity per coordinate (issue 56): exp_avg_sq, from which every pass computes
    # max(sqrt(v), floor) / sqrt(bc2) + eps; counted from outside, OnebitAdam on one rank holds the
    # momentum, the variance, the two error buffers (W = 1: the server's is as large as the worker's)
    # and the last messages, nothing model-sized more
    from onebit import OnebitAdam, ZeroOneAdam

    net = _net()
    n = sum(p.numel() for p in net.parameters())
    opt = OnebitAdam(net.parameters(), lr=1e-3, freeze_step=3)
    _steps(opt, net, 6)
    assert opt.compressing
    (bucket,) = opt.reducer().buckets
    N, e = bucket.worker_error.numel(), bucket.worker_error.element_size()  # bfloat16 by default: 2
    assert e == 2 and bucket.server_error.element_size() == 2
    # exp_avg (the bucket), exp_avg_sq (bfloat16 past the freeze by default: variance_dtype), the two errors
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in net.parameters())
    four = 4 * n + 2 * n + e * N + e * N
    assert four <= bytes_per_parameter(opt) * n < four + 0.5 * n  # + step counters, masks' None, messages
    d = opt.stale_denominator(0, *opt.compressed_params()[0])
    assert not any(t.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
                   for t in opt.state[next(net.parameters())].values() if torch.is_tensor(t))
    net2 = _net()
    zoa = ZeroOneAdam(net2.parameters(), lr=1e-3, var_freeze_step=3)
    _steps(zoa, net2, 6)
    before = bytes_per_parameter(zoa)
    zoa.stale_denominator(0, *zoa.compressed_params()[0])  # made for its caller, not kept
    assert bytes_per_parameter(zoa) == before


def test_stats_reports_the_state_bytes_per_parameter_counted_from_outside():
    from onebit import OnebitAdam

    net = _net()
    opt = OnebitAdam(net.parameters(), lr=1e-3, freeze_step=2)
    _steps(opt, net, 3)
    assert opt.stats()["state_bytes_per_parameter"] == bytes_per_parameter(opt) > 8.0
