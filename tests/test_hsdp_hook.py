"""register_fsdp_hooks on a model sharded over a 2-D HSDP mesh: FSDP's own all-reduce across
replicas off, 1-bit in its place; reduce="sum"; AdamW with freeze_step (docs/ALGORITHMS.md 11.2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import WireCounter, refusals
from test_hsdp import _all_equal, _full, _loss, _mesh, _model, _train

from onebit.collectives import register_fsdp_hooks


def _body_sum_is_twice_the_mean(steps: int):
    """R = 2: compressing 2x is exactly 2x the compressed value (scales are powers-of-two exact),
    so SGD at lr/2 on the sums must walk bitwise the path of SGD at lr on the means."""
    mesh = _mesh()
    paths = []
    for reduce, lr in (("mean", 0.1), ("sum", 0.05)):
        model = _model(mesh)
        # exact errors: the sum is exactly replicas times the mean only without rounding the errors
        hooks = register_fsdp_hooks(model, start_iter=2, reduce=reduce, error_dtype=torch.float32)
        _train(model, torch.optim.SGD(model.parameters(), lr=lr), steps)
        paths.append(_full(model))
        compressed = hooks.stats()["bytes_compressed"]
    moved = (paths[0] - _full(_model(mesh))).abs().max().item()
    return torch.equal(paths[0], paths[1]), moved, compressed


def test_reduce_sum_is_exactly_replicas_times_the_mean(ranks):
    for same, moved, compressed in ranks(4).run(_body_sum_is_twice_the_mean, 5):
        assert same and moved > 1e-3 and compressed > 0


def _body_adamw_hooks(freeze: int, steps: int):
    mesh = _mesh()
    rep = mesh.get_group("replicate")
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=freeze)
    first = _loss(model, 0).item()
    per_step: list[int] = []
    with WireCounter(rep) as wire:
        _train(model, hooks, steps, clip=1.0, wire=wire, per_step=per_step, optimizer=opt)
    last = sum(_loss(model, s).item() for s in range(steps - 4, steps)) / 4
    return {"identical": _all_equal(_full(model)), "per_step": per_step, "first": first, "last": last,
            "stats": hooks.stats(), "frozen": hooks._frozen_adam.frozen}


def test_adamw_behind_the_hsdp_hooks_trains_and_compresses(ranks):
    freeze, steps = 5, 14
    for out in ranks(4).run(_body_adamw_hooks, freeze, steps):
        assert out["identical"] and out["frozen"]
        warm, compressed = out["per_step"][:freeze], out["per_step"][freeze:]
        # block 64 (1.5 bits per element) and each module's block padded to 1024 elements: 1/18.7
        # on this small model (the digits MLP of bench/bench_hsdp.py: below 1/20)
        assert min(compressed) > 0 and max(compressed) * 15 <= min(warm), (warm, compressed)
        # nothing else crossed: FSDP's all-reduce across replicas is off
        assert out["stats"]["bytes_full"] == sum(warm) and out["stats"]["bytes_compressed"] == sum(compressed)
        assert out["last"] < 0.8 * out["first"]


def _body_hooks_resume(directory: str, cut: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import onebit.checkpoint

    freeze, steps = 3, 8

    def fresh(seed=0):
        model = _model(mesh, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, register_fsdp_hooks(model, optimizer=opt, freeze_step=freeze)

    mesh = _mesh()
    model, opt, hooks = fresh()
    _train(model, hooks, steps, clip=1.0, optimizer=opt)
    straight = _full(model)
    model, opt, hooks = fresh()
    _train(model, hooks, cut, clip=1.0, optimizer=opt)
    m, o = get_state_dict(model, opt)
    dcp.save({"model": m, "optim": o, "onebit": onebit.checkpoint.RankState(hooks)}, checkpoint_id=directory)
    model, opt, hooks = fresh(seed=1)
    m, o = get_state_dict(model, opt)
    state = {"model": m, "optim": o, "onebit": onebit.checkpoint.RankState(hooks)}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, hooks, steps, start=cut, clip=1.0, optimizer=opt)
    return torch.equal(straight, _full(model))


def test_adamw_hsdp_hooks_resume_through_dcp_bitwise(ranks, tmp_path):
    assert ranks(4).run(_body_hooks_resume, str(tmp_path), 5) == [True] * 4


def _body_hook_arguments():
    mesh = _mesh()
    def hooks(**kwargs):
        model = _model(mesh)
        if kwargs.get("optimizer") == "adamw":
            kwargs = {"optimizer": torch.optim.AdamW(model.parameters())}
        register_fsdp_hooks(model, **kwargs)

    return refusals([("reduce", lambda: hooks(reduce="avg")), ("no_freeze", lambda: hooks(optimizer="adamw")),
                     ("group", lambda: hooks(process_group=dist.group.WORLD))])


def test_hsdp_hook_arguments(ranks):
    out = ranks(4).run(_body_hook_arguments)[0]
    assert out["reduce"].startswith("reduce:")
    assert out["no_freeze"].startswith("optimizer: the FSDP hooks take optimizer= together with freeze_step")
    assert out["group"].startswith("process_group: the model is sharded over a 2-D (HSDP) mesh")


def _body_conventions(freeze: int, steps: int):
    """torchtitan's convention (FSDP's divide factor 1, each rank's loss divided by the world
    size: FSDP sums; on gloo the division then comes after the hook) trains AdamW behind the hooks
    along the same path as FSDP's default averaging, up to rounding."""
    from torch.distributed.fsdp import FSDPModule

    mesh = _mesh()
    paths = []
    for sum_convention in (False, True):
        model = _model(mesh)
        if sum_convention:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=freeze)
        scale = dist.get_world_size() if sum_convention else 1
        for step in range(steps):
            opt.zero_grad()
            (_loss(model, step) / scale).backward()
            hooks.clip_grad_norm_(1.0)
            opt.step()
        paths.append(_full(model))
    moved = (paths[0] - _full(_model(mesh))).abs().max().item()
    return (paths[0] - paths[1]).abs().max().item(), moved


def test_hooks_follow_fsdps_sum_convention(ranks):
    for gap, moved in ranks(4).run(_body_conventions, 3, 8):
        assert moved > 1e-2 and gap < 1e-4 * moved, (gap, moved)


def _body_fused_against_plain(freeze: int, steps: int, sum_convention: bool):
    """AdamW behind the hooks with freeze_step: the frozen terms' passes fused (on CPU inside the
    codec's C passes) against the plain ops, bitwise; and how many buckets took the C passes."""
    import contextlib

    from torch.distributed.fsdp import FSDPModule

    from onebit.kernels.backends import use_backend
    from onebit.kernels.fused import hook

    mesh, paths, calls, real = _mesh(), [], [0], hook.NativePasses.worker

    def counted(self, *a):
        calls[0] += 1
        return real(self, *a)

    hook.NativePasses.worker = counted
    try:
        for plain in (False, True):
            model = _model(mesh)
            if sum_convention:  # FSDP divides after the hook (gloo: no PREMUL_SUM)
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_gradient_divide_factor(1.0)
                        m.set_force_sum_reduction_for_comms(True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=freeze)
            with use_backend("plain", steps=["hook", "tensor"]) if plain else contextlib.nullcontext():
                _train(model, hooks, steps, clip=1.0, optimizer=opt)
            paths.append(_full(model))
            if not plain:
                fused = calls[0]
    finally:
        hook.NativePasses.worker = real
    moved = (paths[0] - _full(_model(mesh))).abs().max().item()
    return torch.equal(paths[0], paths[1]), fused, calls[0] - fused, moved


@pytest.mark.parametrize("sum_convention", [False, True])
def test_the_fsdp_hooks_take_the_fused_passes_bitwise(ranks, sum_convention):
    freeze, steps = 3, 8
    for same, fused, plain, moved in ranks(4).run(_body_fused_against_plain, freeze, steps, sum_convention):
        assert fused >= steps - freeze and plain == 0  # every compressed iteration's buckets, C passes
        assert same and moved > 1e-3
