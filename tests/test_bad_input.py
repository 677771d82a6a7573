"""Bad input to every public function and constructor, table-driven.

Each case must raise the documented exception type with a message that starts with the
name of the offending argument, and leave every tensor it was given bitwise unchanged.
Single process: argument checks come before any communication.
"""

from __future__ import annotations

import math

import pytest
import torch

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


def _env() -> dict:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(100, generator=g)
    return {
        "x": x,
        "we": torch.randn(104, generator=g),
        "se": torch.randn(104, generator=g),
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
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, call, exc, argument", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument_and_changes_nothing(name, call, exc, argument):
    env = _env()
    before = [t.detach().clone() for t in _tensors(env)]
    with pytest.raises(exc) as info:
        call(env)
    assert str(info.value).startswith(f"{argument}: "), str(info.value)
    after = list(_tensors(env))
    assert len(after) == len(before)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b.view(torch.uint8), a.detach().view(torch.uint8))
