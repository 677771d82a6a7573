"""register_fsdp_hooks: FSDP2 inside shard groups, 1-bit compression between replica groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.collectives import OnebitAllReduceHook, register_fsdp_hooks


def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 37), torch.nn.ReLU(), torch.nn.Linear(37, 37),
                                torch.nn.ReLU(), torch.nn.Linear(37, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _step(model, opt, step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _local(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def _body_identity(steps: int, start_iter: int, error_dtype=torch.float32):
    """Every hook call against the exact replica average of the same input: the difference is
    exactly what error feedback carries over, mean_i(e_i - e_i') + (e_s - e_s') (bfloat16 errors:
    to the rounding of the stored errors)."""
    mesh = _mesh()
    rep = mesh.get_group("replicate")
    model = _sharded_model(mesh)
    hooks = register_fsdp_hooks(model, rep, start_iter=start_iter, error_dtype=error_dtype)
    worst = {"compressed": 0.0, "full": 0.0, "identity": 0.0}

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t.contiguous(), group=rep)
        return parts

    def wrap(name, hook):
        def recorded(out):
            n = out.numel()
            exact = out.clone()
            dist.all_reduce(exact, group=rep)
            exact /= 2
            compressing = hook.iter >= hook.start_iter
            before = None
            if hook.worker_error is not None:
                before = (hook.worker_error.clone(), hook.server_error.clone())
            hook(out)
            if not compressing:
                worst["full"] = max(worst["full"], (out - exact).abs().max().item())
                return
            we0, se0 = before if before is not None else (torch.zeros_like(hook.worker_error),
                                                          torch.zeros_like(hook.server_error))
            carried = torch.stack(gather(we0.float() - hook.worker_error.float())).mean(0)
            carried += torch.cat(gather(se0.float() - hook.server_error.float()))
            worst["compressed"] = max(worst["compressed"], (out - exact).abs().max().item())
            gap = (out - exact - carried[:n]).abs().max() / exact.abs().max().clamp_min(1e-12)
            worst["identity"] = max(worst["identity"], gap.item())

        return recorded

    for name, module in model.named_modules():
        if name in hooks:
            module.set_all_reduce_hook(wrap(name, hooks[name]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        _step(model, opt, step)
    dtypes = {e.dtype for h in hooks.values() for e in (h.worker_error, h.server_error)}
    return _local(model), worst, {k: h.stats() for k, h in hooks.items()}, dtypes


@pytest.mark.parametrize(("start_iter", "error_dtype"), [(0, torch.float32), (2, torch.float32),
                                                         (2, torch.bfloat16)])
def test_fsdp_hook_against_exact_replica_average(ranks, start_iter, error_dtype):
    got = ranks(4).run(_body_identity, 5, start_iter, error_dtype)
    # ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1: replicas must stay bitwise identical
    assert torch.equal(got[0][0], got[2][0]) and torch.equal(got[1][0], got[3][0])
    assert not torch.equal(got[0][0], got[1][0])
    for local, worst, stats, dtypes in got:
        assert torch.isfinite(local).all() and dtypes == {error_dtype}
        # compressed - exact == carried error, to float32 rounding (bfloat16's: 2^-8 of an error)
        assert worst["identity"] < (1e-5 if error_dtype == torch.float32 else 1e-2)
        assert worst["compressed"] > 1e-3  # compression did change the average (the check has teeth)
        assert worst["full"] < 1e-6
        # one hook (own error buffers) per FSDP module with parameters; the root has none of its own
        assert sorted(stats) == ["0", "2", "4"]
        for s in stats.values():
            assert s["iter"] == 5 and s["bytes_compressed"] > 0 and (s["bytes_full"] > 0) == (start_iter > 0)


def _body_resume(steps: int, cut: int):
    mesh = _mesh()
    rep = mesh.get_group("replicate")
    model = _sharded_model(mesh)
    register_fsdp_hooks(model, rep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        _step(model, opt, step)
    straight = _local(model)

    model = _sharded_model(mesh)
    hooks = register_fsdp_hooks(model, rep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(cut):
        _step(model, opt, step)
    saved = ([p.to_local().detach().clone() for p in model.parameters()],
             {k: h.state_dict() for k, h in hooks.items()})

    model = _sharded_model(mesh)
    hooks = register_fsdp_hooks(model, rep)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved[0], strict=True):
            p.to_local().copy_(s)
    for k, h in hooks.items():
        h.load_state_dict(saved[1][k])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(cut, steps):
        _step(model, opt, step)
    return torch.equal(straight, _local(model))


def test_fsdp_hook_resumes_exactly(ranks):
    assert ranks(4).run(_body_resume, 5, 2) == [True] * 4


def test_fsdp_hook_arguments():
    with pytest.raises(TypeError, match=r"^model"):
        register_fsdp_hooks("not a model", None)
    with pytest.raises(ValueError, match=r"^model: expected a module with fully_shard"):
        register_fsdp_hooks(torch.nn.Linear(2, 2), None)
    hook = OnebitAllReduceHook(None)
    with pytest.raises(ValueError, match=r"^start_iter"):
        OnebitAllReduceHook(None, start_iter=-1)
    with pytest.raises(ValueError, match=r"^state"):
        hook.load_state_dict({"iter": 0, "start_iter": 0, "bytes_full": 0, "bytes_compressed": 0,
                              "worker_error": torch.zeros(16)})
