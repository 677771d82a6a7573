"""Bad input to every public function and constructor: one table.

Each case must raise the documented exception type with a message that starts with the
name of the offending argument, and leave every tensor it was given bitwise unchanged.
Cases of world 1 run in this process (argument checks come before any communication);
cases of world 2 run on both ranks of a 2-rank gloo group, where the lengths that depend
on W (N % 8W, N / W) are checked against the group's size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from onebit import checkpoint
from onebit.collectives import compressed_allreduce, local_compressed_allreduce, padded_numel, verify_replicas
from onebit.collectives.bucket import BucketedReducer, plan_buckets
from onebit.kernels import decompress, server_reduce, worker_compress
from onebit.optimizers import (
    AutoFreeze,
    OnebitAdam,
    OnebitLamb,
    ZeroOneAdam,
    from_deepspeed_config,
    register_ddp_hook,
)


def _env(W: int = 1) -> dict:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(100, generator=g)
    N = 104 if W == 1 else padded_numel(100, W)
    return {
        "x": x,
        "we": torch.randn(N, generator=g),
        "se": torch.randn(N // W, generator=g),
        "params": [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5))],
        "msg": worker_compress(x.clone(), torch.zeros(104), 1),
    }


def _ar(e, **over):
    args = dict(tensor=e["x"], worker_error=e["we"], server_error=e["se"]) | over
    return compressed_allreduce(**args)


def _lamb(e, **kw):
    return OnebitLamb(e["params"], **kw)


class _FakeDDP(torch.nn.parallel.DistributedDataParallel):
    """Passes the model type check without a process group (the optimizer check comes next)."""

    def __init__(self) -> None:  # noqa: D107 - deliberately skips DDP's set-up
        torch.nn.Module.__init__(self)


WE = "worker_error"
CASES = [
    # compressed_allreduce
    ("allreduce tensor list", lambda e: _ar(e, tensor=[1.0, 2.0]), TypeError, "tensor"),
    ("allreduce tensor float64", lambda e: _ar(e, tensor=e["x"].double()), TypeError, "tensor"),
    ("allreduce tensor int32", lambda e: _ar(e, tensor=e["x"].int()), TypeError, "tensor"),
    ("allreduce tensor sparse", lambda e: _ar(e, tensor=e["x"].to_sparse()), TypeError, "tensor"),
    ("allreduce tensor stride 0", lambda e: _ar(e, tensor=e["x"][:1].expand(100)), ValueError, "tensor"),
    ("allreduce worker_error short", lambda e: _ar(e, worker_error=e["we"][:96]), ValueError, WE),
    ("allreduce worker_error N % 8", lambda e: _ar(e, worker_error=torch.zeros(101)), ValueError, WE),
    ("allreduce worker_error fp16", lambda e: _ar(e, worker_error=e["we"].half()), TypeError, WE),
    ("allreduce worker_error 2-D", lambda e: _ar(e, worker_error=e["we"].view(8, 13)), ValueError, WE),
    ("allreduce worker_error None", lambda e: _ar(e, worker_error=None), TypeError, WE),
    ("allreduce server_error length", lambda e: _ar(e, server_error=e["se"][:52]), ValueError,
     "server_error"),
    ("allreduce server_error strided", lambda e: _ar(e, server_error=e["se"].repeat(2)[::2]), ValueError,
     "server_error"),
    ("allreduce group without init", lambda e: _ar(e, group="world"), ValueError, "group"),
    ("local allreduce tensors tensor", lambda e: local_compressed_allreduce(e["x"], [e["we"]], [e["se"]]),
     TypeError, "tensors"),
    ("local allreduce ranks differ", lambda e: local_compressed_allreduce([e["x"]], [e["we"]] * 2, [e["se"]]),
     ValueError, "tensors"),
    ("local allreduce worker_error short", lambda e: local_compressed_allreduce(
        [e["x"]], [e["we"][:96]], [e["se"]]), ValueError, WE),
    # padded_numel and the kernels
    ("padded_numel numel < 0", lambda e: padded_numel(-1, 4), ValueError, "numel"),
    ("padded_numel numel float", lambda e: padded_numel(2.5, 4), ValueError, "numel"),
    ("padded_numel world_size 0", lambda e: padded_numel(10, 0), ValueError, "world_size"),
    ("worker_compress x strided", lambda e: worker_compress(e["x"][::2], e["we"][:56], 1), ValueError, "x"),
    ("worker_compress world_size str", lambda e: worker_compress(e["x"], e["we"], "1"), ValueError,
     "world_size"),
    ("worker_compress backend", lambda e: worker_compress(e["x"], e["we"], 1, backend="cupy"), ValueError,
     "backend"),
    ("worker_compress worker_error", lambda e: worker_compress(e["x"], e["we"][:8], 1), ValueError,
     "worker_error"),
    ("server_reduce received dtype", lambda e: server_reduce(e["x"], e["se"], 1), TypeError, "received"),
    ("server_reduce server_error", lambda e: server_reduce(e["msg"], e["se"].half(), 1), TypeError,
     "server_error"),
    ("decompress out float64", lambda e: decompress(e["msg"], e["x"].double(), 1), TypeError, "out"),
    ("decompress padded", lambda e: decompress(e["msg"], e["x"], 1, padded=100), ValueError, "padded"),
    # optimizers
    ("adam lr < 0", lambda e: OnebitAdam(e["params"], lr=-1e-3), ValueError, "lr"),
    ("adam betas one", lambda e: OnebitAdam(e["params"], betas=(0.9,)), ValueError, "betas"),
    ("adam betas 1.0", lambda e: OnebitAdam(e["params"], betas=(0.9, 1.0)), ValueError, "betas"),
    ("adam eps nan", lambda e: OnebitAdam(e["params"], eps=math.nan), ValueError, "eps"),
    ("adam weight_decay str", lambda e: OnebitAdam(e["params"], weight_decay="0.1"), ValueError,
     "weight_decay"),
    ("adam freeze_step < 0", lambda e: OnebitAdam(e["params"], freeze_step=-3), ValueError, "freeze_step"),
    ("adam freeze_step float", lambda e: OnebitAdam(e["params"], freeze_step=2.5), ValueError, "freeze_step"),
    ("adam bucket_cap_mb < 0", lambda e: OnebitAdam(e["params"], bucket_cap_mb=-1), ValueError,
     "bucket_cap_mb"),
    ("adam nonfinite", lambda e: OnebitAdam(e["params"], nonfinite="ignore"), ValueError, "nonfinite"),
    ("adam group without init", lambda e: OnebitAdam(e["params"], group=object()), ValueError, "group"),
    ("lamb min_coeff > max_coeff", lambda e: _lamb(e, min_coeff=20.0), ValueError, "min_coeff"),
    ("lamb factor_min > factor_max", lambda e: _lamb(e, factor_min=5.0), ValueError, "factor_min"),
    ("lamb coeff_beta < 0", lambda e: _lamb(e, coeff_beta=-0.1), ValueError, "coeff_beta"),
    ("lamb coeff_beta 1.5", lambda e: _lamb(e, coeff_beta=1.5), ValueError, "coeff_beta"),
    ("lamb factor_threshold 1", lambda e: _lamb(e, factor_threshold=1.0), ValueError, "factor_threshold"),
    ("adam auto_mask 1", lambda e: OnebitAdam(e["params"], auto_mask=1.0), ValueError, "auto_mask"),
    ("adam freeze_step 'Auto'", lambda e: OnebitAdam(e["params"], freeze_step="Auto"), ValueError,
     "freeze_step"),
    ("lamb auto_mask nan", lambda e: _lamb(e, auto_mask=math.nan), ValueError, "auto_mask"),
    ("zero_one var_freeze_step AutoFreeze bad", lambda e: ZeroOneAdam(e["params"], var_freeze_step=AutoFreeze(
        window=0)), ValueError, "AutoFreeze.window"),
    ("lamb non_freeze group", lambda e: OnebitLamb([{"params": e["params"], "non_freeze": True}]), ValueError,
     "params"),
    ("zero_one var_update_scaler 0", lambda e: ZeroOneAdam(e["params"], var_update_scaler=0), ValueError,
     "var_update_scaler"),
    ("zero_one local_step_clipper bool", lambda e: ZeroOneAdam(e["params"], local_step_clipper=True),
     ValueError, "local_step_clipper"),
    ("zero_one var_freeze_step str", lambda e: ZeroOneAdam(e["params"], var_freeze_step="10"), ValueError,
     "var_freeze_step"),
    ("deepspeed config int", lambda e: from_deepspeed_config(e["params"], 5), TypeError, "config"),
    ("deepspeed unknown key", lambda e: from_deepspeed_config(
        e["params"], {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "lr_decay": 2}}}),
     ValueError, "config"),
    ("deepspeed amsgrad", lambda e: from_deepspeed_config(
        e["params"], {"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}),
     ValueError, "config"),
    ("ddp hook model", lambda e: register_ddp_hook(torch.nn.Linear(2, 2), OnebitAdam(e["params"])), TypeError,
     "model"),
    ("lamb max_coeff < 0", lambda e: _lamb(e, max_coeff=-1.0), ValueError, "max_coeff"),
    ("lamb factor_max nan", lambda e: _lamb(e, factor_max=math.nan), ValueError, "factor_max"),
    ("lamb eps bool", lambda e: _lamb(e, eps=True), ValueError, "eps"),
    ("zero_one local_step_scaler float", lambda e: ZeroOneAdam(e["params"], local_step_scaler=2.0),
     ValueError,
     "local_step_scaler"),
    ("zero_one betas list of 3", lambda e: ZeroOneAdam(e["params"], betas=[0.9, 0.99, 0.9]), ValueError,
     "betas"),
    ("adam AutoFreeze tolerance 0", lambda e: OnebitAdam(e["params"], freeze_step=AutoFreeze(tolerance=0)),
     ValueError, "AutoFreeze.tolerance"),
    ("adam AutoFreeze min_step > max_step", lambda e: OnebitAdam(
        e["params"], freeze_step=AutoFreeze(min_step=500, max_step=400)), ValueError, "AutoFreeze.min_step"),
    ("adam AutoFreeze patience 0", lambda e: OnebitAdam(e["params"], freeze_step=AutoFreeze(patience=0)),
     ValueError, "AutoFreeze.patience"),
    ("ddp hook optimizer", lambda e: register_ddp_hook(_FakeDDP(), torch.optim.SGD(e["params"])), TypeError,
     "optimizer"),
    ("decompress out strided", lambda e: decompress(e["msg"], e["x"].repeat(2)[::2], 1), ValueError, "out"),
    ("decompress padded str", lambda e: decompress(e["msg"], e["x"], 1, padded="104"), ValueError, "padded"),
    # buckets, checkpoints, replica check
    ("reducer bucket_cap_mb", lambda e: BucketedReducer([(3,)], torch.device("cpu"), bucket_cap_mb=-2),
     ValueError, "bucket_cap_mb"),
    ("plan_buckets bucket_cap_mb nan", lambda e: plan_buckets([3], 4, math.nan), ValueError, "bucket_cap_mb"),
    ("checkpoint state list", lambda e: checkpoint.save([e["x"]], "/nonexistent/x", 1), TypeError, "state"),
    ("checkpoint step < 0", lambda e: checkpoint.save({"x": e["x"]}, "/nonexistent/x", -1), ValueError,
     "step"),
    ("checkpoint keep 1", lambda e: checkpoint.save({"x": e["x"]}, "/nonexistent/x", 1, keep=1), ValueError,
     "keep"),
    ("verify_replicas tensor", lambda e: verify_replicas(e["x"]), TypeError, "tensors"),
    ("verify_replicas items", lambda e: verify_replicas([e["x"], 3]), TypeError, "tensors"),
]


N2 = padded_numel(100, 2)  # the world-2 cases' N (112): the chunk is N2 // 2
CASES_W2 = [  # compressed_allreduce on a 2-rank group
    ("W2 allreduce tensor None", lambda e: _ar(e, tensor=None), TypeError, "tensor"),
    ("W2 allreduce tensor int64", lambda e: _ar(e, tensor=torch.arange(100)), TypeError, "tensor"),
    ("W2 allreduce tensor bool", lambda e: _ar(e, tensor=torch.ones(100, dtype=torch.bool)), TypeError,
     "tensor"),
    ("W2 allreduce tensor sparse", lambda e: _ar(e, tensor=torch.zeros(100).to_sparse()), TypeError,
     "tensor"),
    ("W2 allreduce tensor expanded", lambda e: _ar(e, tensor=torch.randn(1).expand(100)), ValueError,
     "tensor"),
    ("W2 allreduce worker_error None", lambda e: _ar(e, worker_error=None), TypeError, WE),
    ("W2 allreduce worker_error float64", lambda e: _ar(e, worker_error=e["we"].double()), TypeError, WE),
    ("W2 allreduce worker_error int32", lambda e: _ar(e, worker_error=e["we"].int()), TypeError, WE),
    ("W2 allreduce worker_error fp16", lambda e: _ar(e, worker_error=e["we"].half()), TypeError, WE),
    ("W2 allreduce worker_error short", lambda e: _ar(e, worker_error=torch.zeros(96)), ValueError, WE),
    ("W2 allreduce worker_error N % 16", lambda e: _ar(e, worker_error=torch.zeros(N2 + 8)), ValueError, WE),
    ("W2 allreduce worker_error 2-D", lambda e: _ar(e, worker_error=torch.zeros(2, N2 // 2)), ValueError, WE),
    ("W2 allreduce worker_error strided", lambda e: _ar(e, worker_error=torch.zeros(2 * N2)[::2]), ValueError,
     WE),
    ("W2 allreduce worker_error meta", lambda e: _ar(e, worker_error=torch.zeros(N2, device="meta")),
     ValueError, WE),
    ("W2 allreduce server_error None", lambda e: _ar(e, server_error=None), TypeError, "server_error"),
    ("W2 allreduce server_error fp16", lambda e: _ar(e, server_error=e["se"].half()), TypeError,
     "server_error"),
    ("W2 allreduce server_error long", lambda e: _ar(e, server_error=torch.zeros(N2 // 2 + 8)), ValueError,
     "server_error"),
    ("W2 allreduce server_error N", lambda e: _ar(e, server_error=torch.zeros(N2)), ValueError,
     "server_error"),
    ("W2 allreduce server_error meta", lambda e: _ar(e, server_error=torch.zeros(N2 // 2, device="meta")),
     ValueError, "server_error"),
    ("W2 allreduce group not a group", lambda e: _ar(e, group="world"), TypeError, "group"),
    ("W2 adam betas on 2 ranks", lambda e: OnebitAdam(e["params"], betas=(1.5, 0.9)), ValueError, "betas"),
]
TABLE = [(*c, 1) for c in CASES] + [(*c, 2) for c in CASES_W2]


def _outcome(name: str, W: int) -> tuple[str, bool]:
    """Run one case on fresh inputs: ("ok" or what went wrong, every tensor unchanged)."""
    _, call, exc, argument, _ = next(c for c in TABLE if c[0] == name)
    env = _env(W)
    before = [t.detach().clone() for t in _tensors(env)]
    try:
        call(env)
        outcome = "no exception"
    except exc as error:
        outcome = "ok" if str(error).startswith(f"{argument}: ") else f"message: {error}"
    except Exception as error:  # noqa: BLE001 - reported as a wrong exception type
        outcome = f"wrong type {type(error).__name__}: {error}"
    after = list(_tensors(env))
    same = len(after) == len(before) and all(torch.equal(b.view(torch.uint8), a.detach().view(torch.uint8))
                                             for b, a in zip(before, after, strict=True))
    return outcome, same


def _body_case(name: str) -> tuple[str, bool]:
    return _outcome(name, dist.get_world_size())


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def test_the_table_is_large_enough():
    names = [c[0] for c in TABLE]
    assert len(TABLE) >= 90 and len(set(names)) == len(names)


@pytest.mark.parametrize("name, world", [(c[0], c[4]) for c in TABLE], ids=[c[0] for c in TABLE])
def test_bad_input_raises_naming_the_argument_and_changes_nothing(ranks, name, world):
    got = [_outcome(name, 1)] if world == 1 else ranks(world).run(_body_case, name)
    for rank, (outcome, untouched) in enumerate(got):
        assert outcome == "ok", f"rank {rank}: {outcome}"
        assert untouched, f"rank {rank}: a tensor it was given changed"


def _body_group_not_a_member():
    x, we, se = torch.randn(10), torch.zeros(padded_numel(10, 2)), torch.zeros(padded_numel(10, 2) // 2)
    only_zero = dist.new_group([0])
    outcome = "member"
    if dist.get_rank() != 0:
        try:
            compressed_allreduce(x, we, se, group=only_zero)
            outcome = "no exception"
        except ValueError as exc:
            outcome = "ok" if str(exc).startswith("group:") else f"message: {exc}"
    else:
        dist.destroy_process_group(only_zero)
    return outcome, not we.any()


def test_a_rank_outside_the_group_is_told_so(ranks):
    got = ranks(2).run(_body_group_not_a_member)
    assert got == [("member", True), ("ok", True)]
