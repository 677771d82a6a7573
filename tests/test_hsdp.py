"""The 1-bit optimizers on DTensor parameters: FSDP2 inside a replica, HSDP across (4 gloo ranks,
a 2 x 2 mesh ("replicate", "shard"); docs/ALGORITHMS.md 11)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import WireCounter, refusals

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

# odd sizes: 37 rows split 19/18 over the shard ranks, 5 rows 3/2, 20 columns
SIZES = (20, 37, 37, 5)


def _mesh(shape=(2, 2)):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _model(mesh, seed=0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


TEACHER = torch.randn(SIZES[0], SIZES[-1], generator=torch.Generator().manual_seed(12345))


def _batch(step, rank, n=8):
    """A learnable task: the labels are a fixed linear teacher's choices."""
    x = torch.randn(n, SIZES[0], generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, (x @ TEACHER).argmax(1)


def _loss(model, step):
    x, y = _batch(step, dist.get_rank())
    return torch.nn.functional.cross_entropy(model(x), y)


def _full(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _all_equal(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(parts[0], q) for q in parts)


def _train(model, opt, steps, start=0, clip=None, wire=None, per_step=None, *, optimizer=None):
    """``opt`` clips (a 1-bit optimizer, or the FSDP hooks) and steps ``optimizer`` (default: itself)."""
    optimizer = opt if optimizer is None else optimizer
    for step in range(start, steps):
        optimizer.zero_grad()
        if wire is not None:
            before = wire.bytes
        _loss(model, step).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        optimizer.step()
        if per_step is not None:
            per_step.append(wire.bytes - before)


def _body_trains(freeze: int, steps: int):
    mesh = _mesh()
    rep = mesh.get_group("replicate")
    model = _model(mesh)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    first = _loss(model, 0).item()
    per_step: list[int] = []
    with WireCounter(rep) as wire:
        _train(model, opt, steps, clip=1.0, wire=wire, per_step=per_step)
    last = sum(_loss(model, s).item() for s in range(steps - 4, steps)) / 4
    local = [p.to_local().detach().clone() for p in model.parameters()]
    return {"identical": _all_equal(_full(model)), "per_step": per_step, "first": first, "last": last,
            "stats": opt.stats(), "local": local, "calls": wire.calls}


def test_onebit_adam_trains_on_hsdp_and_compresses_across_replicas(ranks):
    freeze, steps = 6, 16
    got = ranks(4).run(_body_trains, freeze, steps)
    for out in got:
        assert out["identical"], "full tensors differ between ranks"
        warm, compressed = out["per_step"][:freeze], out["per_step"][freeze:]
        # warm-up: FSDP's own all-reduce across replicas; afterwards only onebit's 1-bit payload
        assert min(warm) > 0 and min(compressed) > 0
        assert max(compressed) * 20 <= min(warm), (warm, compressed)
        s = out["stats"]
        assert s["stage"] == "compression" and s["updates"] == steps and s["bytes_compressed"] > 0
        # the optimizer's own count of FSDP's warm-up all-reduce matches what went over the wire
        # (the first step also compares the replicas once: 16 bytes per tensor, 8 for the count)
        assert s["bytes_full"] == freeze * warm[-1] and warm[0] - warm[-1] == 16 * 6 + 8, (s, warm)
        assert out["last"] < 0.8 * out["first"]
    # shard ranks hold different slices; replicas (0, 2) and (1, 3) the same ones
    assert all(torch.equal(a, b) for a, b in zip(got[0]["local"], got[2]["local"], strict=True))
    assert got[0]["local"][0].shape != got[1]["local"][0].shape  # 19 and 18 rows


def _body_local_gradient(freeze: int, sum_convention: bool):
    """After the freeze, ``.grad`` must be the replica's own mean gradient (its two shard ranks'
    batches), not the mean over all ranks: checked against the unsharded model's gradient.
    ``sum_convention``: torchtitan's, FSDP's divide factor 1 and each rank's loss divided by the
    world size (FSDP sums); the optimizer must see the same gradients on the same scale."""
    from torch.distributed.fsdp import FSDPModule

    mesh = _mesh()
    model = _model(mesh)
    if sum_convention:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (NCCL does)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    worst = {}
    for step in range(freeze + 2):
        opt.zero_grad()
        full = [p.full_tensor().detach().clone().requires_grad_() for p in model.parameters()]
        (_loss(model, step) / (dist.get_world_size() if sum_convention else 1)).backward()
        replica = dist.get_rank() // 2
        ranks = [2 * replica, 2 * replica + 1] if step >= freeze else list(range(4))
        want = _reference_grads(full, step, ranks)
        stage = "compressed" if step >= freeze else "warm-up"
        for p, w in zip(model.parameters(), want, strict=True):
            rows = p.to_local().shape[0]
            start = 0 if dist.get_rank() % 2 == 0 else -(-p.shape[0] // 2)
            gap = (p.grad.to_local() - w[start : start + rows]).abs().max().item()
            worst[stage] = max(worst.get(stage, 0.0), gap / w.abs().max().item())
        opt.step()
    return worst


def _reference_grads(full, step, ranks):
    w1, b1, w2, b2, w3, b3 = full
    total = [torch.zeros_like(t) for t in full]
    for r in ranks:
        x, y = _batch(step, r)
        h = torch.relu(x @ w1.T + b1)
        h = torch.relu(h @ w2.T + b2)
        loss = torch.nn.functional.cross_entropy(h @ w3.T + b3, y)
        for acc, g in zip(total, torch.autograd.grad(loss, full), strict=True):
            acc += g / len(ranks)
    return total


@pytest.mark.parametrize("sum_convention", [False, True])
def test_gradient_after_the_freeze_is_the_replicas_own_mean(ranks, sum_convention):
    for worst in ranks(4).run(_body_local_gradient, 3, sum_convention):
        assert worst["warm-up"] < 1e-5 and worst["compressed"] < 1e-5, worst


def _body_warmup_is_adam(steps: int):
    mesh = _mesh()
    a, b = _model(mesh), _model(mesh)
    ours = OnebitAdam(a.parameters(), lr=1e-2, freeze_step=10**6, bias_correction=True)
    theirs = torch.optim.Adam(b.parameters(), lr=1e-2)
    _train(a, ours, steps)
    _train(b, theirs, steps)
    return (_full(a) - _full(b)).abs().max().item(), (_full(b) - _full(_model(mesh))).abs().max().item()


def test_warmup_on_hsdp_is_adam(ranks):
    for gap, moved in ranks(4).run(_body_warmup_is_adam, 5):
        assert moved > 1e-2 and gap < 1e-5 * moved * 100, (gap, moved)


def _body_refusals():
    mesh = _mesh()
    model = _model(mesh)
    out = refusals([("lamb", lambda: OnebitLamb(model.parameters())),
                    ("zero_one", lambda: ZeroOneAdam(model.parameters())),
                    ("group", lambda: OnebitAdam(model.parameters(), group=dist.group.WORLD)),
                    ("overlap", lambda: OnebitAdam(model.parameters(), overlap=True))],
                   (ValueError, TypeError))
    out.update(refusals([(name, lambda shape=shape: OnebitAdam(_model(_mesh(shape)).parameters()))
                         for name, shape in (("fsdp", (4,)), ("one_replica", (1, 4)))]))
    return out


def test_what_hsdp_does_not_support_is_refused_clearly(ranks):
    out = ranks(4).run(_body_refusals)[0]
    assert out["lamb"].startswith("params: OnebitLamb does not support DTensor")
    assert out["zero_one"].startswith("params: ZeroOneAdam does not support DTensor")
    assert out["group"].startswith("group: DTensor parameters bring their own mesh")
    assert out["overlap"].startswith("overlap: not with DTensor")
    assert out["fsdp"].startswith("params: OnebitAdam got parameters sharded over a 1-D mesh (pure FSDP)")
    assert out["one_replica"].startswith("params: OnebitAdam got parameters on a mesh with one replica")


@pytest.mark.parametrize("cut", [2, 6])  # in the warm-up, and after the freeze
def test_hsdp_resume_through_onebit_checkpoint_is_bitwise(ranks, tmp_path, cut):
    got = ranks(4).run(_body_resume, str(tmp_path), cut, "onebit")
    assert got == [True] * 4


def test_hsdp_resume_through_dcp_is_bitwise(ranks, tmp_path):
    got = ranks(4).run(_body_resume, str(tmp_path), 6, "dcp")
    assert got == [True] * 4


def _body_resume(directory: str, cut: int, how: str):
    import onebit.checkpoint

    freeze, steps = 4, 9
    mesh = _mesh()
    model = _model(mesh)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    _train(model, opt, steps, clip=1.0)
    straight = _full(model)

    model = _model(mesh)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    _train(model, opt, cut, clip=1.0)
    if how == "onebit":
        onebit.checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, directory, cut)
    else:
        _dcp_save(model, opt, directory)
    del model, opt

    model = _model(mesh, seed=1)  # other weights: the checkpoint must bring them back
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
    if how == "onebit":
        step, state = onebit.checkpoint.load_latest(directory)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    else:
        _dcp_load(model, opt, directory)
    _train(model, opt, steps, start=cut, clip=1.0)
    return torch.equal(straight, _full(model))


def _dcp_save(model, opt, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import onebit.checkpoint

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "onebit": onebit.checkpoint.RankState(opt)},
             checkpoint_id=directory)


def _dcp_load(model, opt, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import onebit.checkpoint

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "onebit": onebit.checkpoint.RankState(opt)}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _body_init_optim_state():
    """torch's DCP helpers build an optimizer's state with a step at lr 0 on zero gradients: no
    onebit update (the warm-up count stays), no parameter moves."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    mesh = _mesh()
    model = _model(mesh)
    before = _full(model)
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    sd = get_optimizer_state_dict(model, opt)
    kinds = sorted({type(v).__name__ for entry in sd["state"].values() for v in entry.values()})
    return opt.updates, torch.equal(before, _full(model)), kinds, opt.param_groups[0]["lr"]


def test_dcp_state_initialisation_is_not_an_update(ranks):
    for updates, unchanged, kinds, lr in ranks(4).run(_body_init_optim_state):
        assert updates == 0 and unchanged and lr == 1e-2
        assert kinds == ["DTensor"]  # saved per slice by DCP
