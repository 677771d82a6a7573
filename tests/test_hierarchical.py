"""compressed_allreduce on a 2-D DeviceMesh (nodes x ranks per node): full precision inside a
node, 1-bit between nodes (onebit.collectives.hierarchical). Against a float64 reference of
the hierarchical algorithm, on meshes 2 x 2, 2 x 3, 3 x 2 and the degenerate 1 x 4, 4 x 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import assert_rel

from onebit.collectives import compressed_allreduce, error_buffers, padded_numel, traffic
from onebit.collectives.wire import compressed_bytes
from onebit.kernels.reference import reference_allreduce


def _input(seed: int, call: int, rank: int, n: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + call * 1009 + rank)
    x = torch.randn(n, generator=g)
    if kind == "heavy":  # heavy tails and exact zeros of both signs
        x = x**5
        x[torch.rand(n, generator=g) < 0.3] = 0.0
        x[torch.rand(n, generator=g) < 0.2] = -0.0
    return x


def _mesh(M: int, L: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (M, L), mesh_dim_names=("node", "local"))


def _body_chain(M, L, n, kind, calls, block, seed=3):
    mesh = _mesh(M, L)
    r = dist.get_rank()
    we, se = error_buffers(n, mesh, block=block)
    outs = []
    for c in range(calls):
        x = _input(seed, c, r, n, kind)
        assert compressed_allreduce(x, we, se, mesh, block=block) is x
        outs.append(x.clone())
    return outs, we, se


def _reference_chain(M, L, n, kind, calls, block, seed=3):
    """The hierarchical algorithm in float64: node means, then reference_allreduce of each shard
    across the nodes with the error buffers of the ranks that serve it."""
    W, s = M * L, -(-n // L)
    N = padded_numel(s, M, block)
    we = {(a, i): torch.zeros(N, dtype=torch.float64) for a in range(M) for i in range(L)}
    se = {(a, i): torch.zeros(N // M, dtype=torch.float64) for a in range(M) for i in range(L)}
    outs = []
    for c in range(calls):
        xs = [_input(seed, c, r, n, kind).double() for r in range(W)]
        means = []
        for a in range(M):
            m = torch.zeros(L * s, dtype=torch.float64)
            m[:n] = sum(xs[a * L + k] for k in range(L)) / L
            means.append(m)
        out = torch.empty(L * s, dtype=torch.float64)
        for i in range(L):
            res = reference_allreduce([m[i * s:(i + 1) * s] for m in means], [we[(a, i)] for a in range(M)],
                                      [se[(a, i)] for a in range(M)], block=block)
            for a in range(M):
                we[(a, i)], se[(a, i)] = res.worker_errors[a], res.server_errors[a]
            out[i * s:(i + 1) * s] = res.output
        outs.append(out[:n])
    return outs, we, se


MESHES = [(2, 2), (2, 3), (3, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize(("M", "L"), MESHES, ids=[f"{m}x{k}" for m, k in MESHES])
@pytest.mark.parametrize(("n", "kind", "block"), [
    (1, "randn", None), (7, "heavy", None), (1000, "randn", None), (4099, "heavy", None),
    (1003, "heavy", 16)])
def test_matches_the_hierarchical_reference(ranks, M, L, n, kind, block):
    calls = 6
    got = ranks(M * L).run(_body_chain, M, L, n, kind, calls, block)
    ref_outs, ref_we, ref_se = _reference_chain(M, L, n, kind, calls, block)
    for r, (outs, we, se) in enumerate(got):
        for c in range(calls):
            assert torch.equal(outs[c], got[0][0][c]), f"rank {r} differs from rank 0 at call {c}"  # bitwise
            assert_rel(outs[c], ref_outs[c], 1e-6, f"output of call {c}")
        a, i = divmod(r, L)
        for name, mine, ref in (("worker_error", we, ref_we[(a, i)]), ("server_error", se, ref_se[(a, i)])):
            assert_rel(mine, ref, 1e-6, f"{name} of rank {r}", norm=max(float(ref.norm()), 1e-30))


def _body_nonfinite(M, L, bad_rank):
    mesh = _mesh(M, L)
    r = dist.get_rank()
    we, se = error_buffers(100, mesh)
    x = _input(1, 0, r, 100, "randn")
    compressed_allreduce(x, we, se, mesh)  # errors now nonzero
    before = (we.clone(), se.clone())
    y = _input(1, 1, r, 100, "randn")
    if r == bad_rank:
        y[17] = float("nan")
    compressed_allreduce(y, we, se, mesh)
    return bool(torch.isnan(y).all()), torch.equal(we, before[0]) and torch.equal(se, before[1])


@pytest.mark.parametrize(("M", "L", "bad"), [(2, 2, 3), (2, 3, 1), (3, 2, 4)])
def test_a_non_finite_input_on_one_rank_gives_nan_everywhere_and_keeps_every_error(ranks, M, L, bad):
    for all_nan, unchanged in ranks(M * L).run(_body_nonfinite, M, L, bad):
        assert all_nan and unchanged


def _body_convergence(M, L, n, calls):
    """Running mean of repeated calls on fixed inputs: its error against the exact mean, for
    the flat all-reduce over all ranks and for the hierarchical one."""
    r, W = dist.get_rank(), dist.get_world_size()
    x = _input(7, 0, r, n, "heavy")
    exact = sum(_input(7, 0, q, n, "heavy").double() for q in range(W)) / W
    errors = {}
    for name, group in (("flat", None), ("hierarchical", _mesh(M, L))):
        we, se = error_buffers(n, group)
        total = torch.zeros(n, dtype=torch.float64)
        curve = []
        for c in range(calls):
            total += compressed_allreduce(x.clone(), we, se, group).double()
            curve.append(float((total / (c + 1) - exact).norm() / exact.norm()))
        errors[name] = curve
    return errors


@pytest.mark.parametrize(("M", "L"), [(2, 2), (2, 3), (3, 2)])
def test_error_feedback_converges_at_least_as_fast_as_flat(ranks, M, L):
    errors = ranks(M * L).run(_body_convergence, M, L, 4096, 40)[0]
    flat, hier = errors["flat"], errors["hierarchical"]
    assert hier[-1] < 0.5 * hier[0]  # it converges (slowly on x^5 with one scale per chunk)
    for k in (9, 19, 39):  # after 10, 20, 40 calls
        assert hier[k] <= flat[k], (k, hier[k], flat[k])


def _body_bytes(M, L, n, block):
    mesh = _mesh(M, L)
    we, se = error_buffers(n, mesh, block=block)
    traffic.reset()
    compressed_allreduce(torch.ones(n), we, se, mesh, block=block)
    hier = (traffic.compressed, traffic.intra)
    fw, fs = error_buffers(n, None, block=block)
    traffic.reset()
    compressed_allreduce(torch.ones(n), fw, fs, block=block)
    return hier, traffic.compressed, we.numel(), fw.numel()


@pytest.mark.parametrize(("M", "L", "n", "block"), [
    (2, 2, 1 << 16, 64), (2, 3, 100_003, None), (3, 2, 4099, 16)])
def test_bytes_across_nodes_fall_by_the_ranks_per_node(ranks, M, L, n, block):
    W = M * L
    for (hier, intra), flat, N, N_flat in ranks(W).run(_body_bytes, M, L, n, block):
        assert hier == compressed_bytes(N, M, block)  # every one of them crosses between nodes
        assert flat == compressed_bytes(N_flat, W, block)
        # of the flat call's 2 (W - 1) segments, 2 (W - L) go to ranks on other nodes
        flat_across = flat * (W - L) // (W - 1)
        assert hier <= (1 / L + 0.05) * flat_across, (hier, flat_across)
        s = -(-n // L)
        # gloo: the node all-reduces its sums (twice a reduce-scatter's bytes), then all-gathers
        assert intra == 2 * (L - 1) * (s + 1) * 4 + (L - 1) * s * 4


def _body_bad(kind):
    from torch.distributed.device_mesh import init_device_mesh

    r = dist.get_rank()
    x = _input(2, 0, r, 50, "randn")
    before = x.clone()
    if kind == "3d":
        mesh = init_device_mesh("cpu", (1, 2, 2))
        we, se = torch.zeros(64), torch.zeros(32)
    elif kind == "flat-buffers":
        mesh = _mesh(2, 2)
        we, se = error_buffers(50, None)  # sized for the flat group (W = 4), not the mesh (2 nodes)
    else:
        mesh = _mesh(2, 2)
        we, se = torch.zeros(16), torch.zeros(8)  # shorter than this rank's shard (25)
    we0 = we.clone()
    try:
        compressed_allreduce(x, we, se, mesh)
    except (ValueError, TypeError) as e:
        return str(e), torch.equal(x, before) and torch.equal(we, we0)
    return "", False


def test_bad_meshes_and_buffers_are_refused_with_what_to_do(ranks):
    for message, untouched in ranks(4).run(_body_bad, "3d"):
        assert message.startswith("group: expected a ProcessGroup or a 1-D or 2-D DeviceMesh") and untouched
    for message, untouched in ranks(4).run(_body_bad, "short"):
        assert message.startswith("worker_error: expected float32 or bfloat16 of length N >= ceil(numel / "
                                  "per_node) (25)")
        assert "error_buffers(numel, mesh)" in message and untouched
    for message, untouched in ranks(4).run(_body_bad, "flat-buffers"):
        assert message.startswith("server_error: expected float32 or bfloat16 of length N / nodes = 32")
        assert untouched


def _body_one_d():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    r = dist.get_rank()
    out = {}
    for name, group in (("mesh", mesh), ("group", None)):
        we, se = error_buffers(300, group)
        x = _input(5, 0, r, 300, "randn")
        compressed_allreduce(x, we, se, group)
        out[name] = (x, we)
    return out


def test_a_one_dimensional_mesh_is_its_group(ranks):
    for out in ranks(3).run(_body_one_d):
        assert torch.equal(out["mesh"][0], out["group"][0]) and torch.equal(out["mesh"][1], out["group"][1])


def test_error_buffers_without_a_process_group():
    we, se = error_buffers(10)
    assert we.shape == (16,) and se.shape == (16,) and we.dtype == torch.float32 and not we.any()
    with pytest.raises(ValueError, match="numel: expected"):
        error_buffers(-1)


def _body_missing():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor([[0], [1]]))  # ranks 2 and 3 are not in it
    x = torch.ones(10)
    try:
        we, se = error_buffers(10, mesh)
        compressed_allreduce(x, we, se, mesh)
    except ValueError as e:
        return str(e)
    return ""


def test_a_rank_outside_the_mesh_is_told_so(ranks):
    got = ranks(4).run(_body_missing)
    assert got[:2] == ["", ""]  # ranks 0 and 1: two nodes of one rank each
    for r in (2, 3):
        assert got[r] == f"group: this rank (global rank {r}) is not in the mesh [0, 1]"


def _body_part_of_the_world(n, calls, block):
    from torch.distributed.device_mesh import DeviceMesh

    r = dist.get_rank()
    # ranks that know different numbers of process groups (torch names a group that only its
    # members create by a hash that counts them: onebit's groups over the mesh must still agree)
    dist.new_group([0, 1])
    dist.new_group([0])
    mesh = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]))  # rank 4 is not in it
    if r == 4:
        return None
    we, se = error_buffers(n, mesh, block=block)
    outs = []
    for c in range(calls):
        x = _input(5, c, r, n, "heavy")
        outs.append(compressed_allreduce(x, we, se, mesh, block=block).clone())
    return outs, we, se


def test_a_mesh_over_part_of_the_world_whose_ranks_know_different_groups(ranks):
    calls, n = 3, 1001
    got = ranks(5).run(_body_part_of_the_world, n, calls, None)
    assert got[4] is None
    ref_outs, ref_we, _ = _reference_chain(2, 2, n, "heavy", calls, None, seed=5)
    for r, (outs, we, _) in enumerate(got[:4]):
        for c in range(calls):
            assert torch.equal(outs[c], got[0][0][c]), f"rank {r} differs from rank 0 at call {c}"
            assert_rel(outs[c], ref_outs[c], 1e-6, f"output of call {c}")
        assert_rel(we, ref_we[divmod(r, 2)], 1e-6, f"worker_error of rank {r}")


def _task(seed: int, rank: int, step: int):
    """A regression task whose data differ per rank: y = A x + noise, with a dead input feature."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 131 + rank)
    x = torch.randn(32, 24, generator=g)
    x[:, 5] = 0.0
    A = torch.linspace(-1, 1, 24 * 4, dtype=torch.float32).view(4, 24)
    return x, x @ A.T + 0.1 * torch.randn(32, 4, generator=g)


def _body_optimizer(M, L, name, steps, use_mesh, resume_at=None):
    from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

    group = _mesh(M, L) if use_mesh else None
    r = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    cls = {"exact": OnebitAdam, "adam": OnebitAdam, "lamb": OnebitLamb, "zero_one": ZeroOneAdam}[name]
    # exact: Adam on exactly averaged gradients (the freeze never comes)
    kw = {"exact": {"freeze_step": float("inf")}, "zero_one": {"var_freeze_step": 20}}

    buckets = {} if name == "lamb" else {"bucket_cap_mb": 0.001}  # several buckets (LAMB: one per tensor)

    def make():
        return cls(model.parameters(), lr=3e-3, group=group, **buckets, **kw.get(name, {"freeze_step": 20}))

    opt = make()
    snapshots = []  # the parameters at every step at which the replicas should agree
    losses = []
    for step in range(steps):
        if step == resume_at:  # a new optimizer from this one's state: it continues bitwise
            state = opt.state_dict()
            opt = make()
            opt.load_state_dict(state)
        x, y = _task(1, r, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if opt.replicas_identical:
            snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    # compared once at the end (an all-gather after every step cost a fifth of these runs)
    mine = torch.stack(snapshots)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    identical = all(torch.equal(t, table[0]) for t in table)
    # the final loss on every rank's data, averaged
    total = torch.tensor([0.0])
    with torch.no_grad():
        for q in range(dist.get_world_size()):
            x, y = _task(2, q, 0)
            total += torch.nn.functional.mse_loss(model(x), y)
    return float(total) / dist.get_world_size(), identical, opt.stats(), \
        torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(("M", "L", "name"), [(2, 2, "adam"), (2, 2, "lamb"), (2, 2, "zero_one"),
                                               (2, 3, "adam"), (3, 2, "zero_one")])
def test_optimizers_on_a_mesh_train_as_on_the_flat_group(ranks, M, L, name):
    # the mesh changes where the bits go, not how the optimizer trains: within 2% of the flat
    # 1-bit run (against exact averaging: test_an_optimizer_on_a_mesh_trains_like_adam_on_a_suite_task)
    pool = ranks(M * L)
    flat = pool.run(_body_optimizer, M, L, name, 150, False)[0][0]
    got = pool.run(_body_optimizer, M, L, name, 150, True)
    for loss, identical, stats, _ in got:
        assert identical  # bitwise the same parameters on every rank whenever they should be
        assert loss <= 1.02 * flat, (loss, flat)
        if M > 1:
            assert stats["bytes_compressed"] > 0 and (stats["bytes_intra"] > 0) == (L > 1)


def test_an_optimizer_on_a_mesh_trains_like_adam_on_a_suite_task(tmp_path):
    # the convergence suite's "mlp" task (bench/suite.py), W = 4 as 2 nodes x 2: OnebitAdam on
    # the mesh against Adam on exactly averaged gradients, final validation loss within 2% after
    # 300 steps (measured 2026-11-27: 1-bit 0.1059, Adam 0.1119, 0.947x; 18 s per run; 1-bit
    # compression runs from the freeze at step 60, 20% of the run). Until 2026-11-27 the "words"
    # task at 200 steps (1.013x; 3.6835 against 3.6378), 80 s per run: the CI's longest test
    import json
    import os

    from zygote import launch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    losses = {}
    for name, extra in (("adam", []), ("onebit_adam", ["--per-node", "2"])):
        log = tmp_path / f"{name}.jsonl"
        run = launch(os.path.join(root, "bench", "train_task.py"), "--task", "mlp", "--steps", "300",
                     "--optimizer", name, "--log-jsonl", str(log), "--eval-every", "300", *extra,
                     nproc=4, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))  # eval at the end
        assert run.returncode == 0, run.stderr[-3000:]
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        losses[name] = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
        if name == "onebit_adam":
            assert rows[-1]["stats"]["bytes_compressed"] > 0 and rows[-1]["stats"]["bytes_intra"] > 0
    assert losses["onebit_adam"] <= 1.02 * losses["adam"], losses


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_an_optimizer_on_a_mesh_resumes_bitwise(ranks, name):
    pool = ranks(6)
    straight = pool.run(_body_optimizer, 3, 2, name, 40, True)
    resumed = pool.run(_body_optimizer, 3, 2, name, 40, True, 27)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a[3], b[3])


def _train(model, opt, task: int, steps: int) -> None:
    """``steps`` steps of ``opt`` on this rank's batches of ``_task(task, ...)`` (mean squared error)."""
    r = dist.get_rank()
    for step in range(steps):
        x, y = _task(task, r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _body_ddp_hook(M, L, use_mesh, steps=60):
    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(),
                                                        torch.nn.Linear(32, 4)), bucket_cap_mb=0.002)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = None
    if use_mesh is not None:  # None: plain DDP (exact averaging)
        state = OnebitCompressHookState(process_group=_mesh(M, L) if use_mesh else None, start_iter=2,
                                        optimizer=sgd)
        model.register_comm_hook(state, onebit_compress_hook)
    _train(model, sgd, 3, steps)
    total = 0.0
    with torch.no_grad():
        for q in range(dist.get_world_size()):
            x, y = _task(5, q, 0)
            total += float(torch.nn.functional.mse_loss(model(x), y))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, None if state is None else state.stats(), total / dist.get_world_size()


@pytest.mark.parametrize(("M", "L"), [(2, 2), (2, 3)])
def test_the_ddp_hook_on_a_mesh(ranks, M, L):
    pool = ranks(M * L)
    got = pool.run(_body_ddp_hook, M, L, True)
    flat = pool.run(_body_ddp_hook, M, L, False)
    exact = pool.run(_body_ddp_hook, M, L, None)[0][2]
    for params, stats, loss in got:
        assert torch.equal(params, got[0][0])  # bitwise the same on every rank
        assert stats["compressing"] and stats["bytes_compressed"] > 0
        # 1-bit between M nodes: fewer bytes than the flat hook's over all M L ranks
        assert stats["bytes_compressed"] < flat[0][1]["bytes_compressed"]
        assert loss <= 1.05 * exact, (loss, flat[0][2], exact)  # trains as plain DDP does


def _body_fsdp_mesh(steps=5):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from onebit.collectives import register_fsdp_hooks

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("node", "local", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 37), torch.nn.ReLU(), torch.nn.Linear(37, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    hooks = register_fsdp_hooks(model, mesh["node", "local"], start_iter=1)  # replicas: 2 nodes x 2
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, steps)
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return local, {k: h.stats() for k, h in hooks.items()}


def test_the_fsdp_hook_on_a_mesh_of_replicas(ranks):
    got = ranks(4).run(_body_fsdp_mesh)
    for local, stats in got:
        assert torch.equal(local, got[0][0])  # every replica holds the same shard, bitwise
        for s in stats.values():
            assert s["iter"] == 5 and s["bytes_compressed"] > 0 and s["bytes_full"] > 0


def _body_bfloat16(M, L, n, block, calls=3):
    """The same calls with bfloat16 and float32 error buffers, from the same (bfloat16) values
    before each call: the outputs bitwise equal, the stored errors the float32 ones rounded."""
    mesh = _mesh(M, L)
    r = dist.get_rank()
    we, se = error_buffers(n, mesh, block=block, dtype=torch.bfloat16)
    same, near = True, True
    for c in range(calls):
        x = _input(5, c, r, n, "heavy")
        fw, fs = we.float(), se.float()
        y = x.clone()
        compressed_allreduce(x, we, se, mesh, block=block)
        compressed_allreduce(y, fw, fs, mesh, block=block)
        same = same and torch.equal(x, y)
        for got, want in ((we, fw), (se, fs)):
            lo = (want.view(torch.int32) & ~0xFFFF).view(torch.float32)
            hi = ((want.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
            near = near and bool(((got.float() == lo) | (got.float() == hi)).all())
    return same, near, we.dtype, bool(we.ne(0).any())


@pytest.mark.parametrize(("M", "L", "block"), [(2, 2, None), (3, 2, 8)])
def test_bfloat16_error_buffers_on_a_mesh(ranks, M, L, block):
    got = ranks(M * L).run(_body_bfloat16, M, L, 301, block)
    assert got == [(True, True, torch.bfloat16, True)] * (M * L)
