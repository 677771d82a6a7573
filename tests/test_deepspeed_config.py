"""from_deepspeed_config with the optimizer blocks of DeepSpeed's published tutorials."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam, from_deepspeed_config

ONEBIT_ADAM = {"optimizer": {"type": "OneBitAdam", "params": {
    "lr": 4e-4, "weight_decay": 0.01, "bias_correction": False, "freeze_step": 23000,
    "cuda_aware": False, "comm_backend_name": "nccl"}}}
ONEBIT_LAMB = {"optimizer": {"type": "OneBitLamb", "params": {
    "lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01,
    "freeze_step": 1000, "cuda_aware": False, "comm_backend_name": "nccl", "coeff_beta": 0.9,
    "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}}}
ZERO_ONE_ADAM = {"optimizer": {"type": "ZeroOneAdam", "params": {
    "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000,
    "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": False,
    "comm_backend_name": "nccl"}}}


def _params():
    return torch.nn.Linear(4, 3).parameters()


def test_tutorial_blocks(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="onebit"):
        adam = from_deepspeed_config(_params(), ONEBIT_ADAM)
    assert isinstance(adam, OnebitAdam) and adam.freeze_step == 23000
    assert adam.param_groups[0]["lr"] == 4e-4 and adam.param_groups[0]["weight_decay"] == 0.01
    assert adam.param_groups[0]["bias_correction"] is False
    messages = [r.getMessage() for r in caplog.records if "ignoring DeepSpeed" in r.getMessage()]
    assert len(messages) == 1 and "comm_backend_name" in messages[0]

    lamb = from_deepspeed_config(_params(), ONEBIT_LAMB["optimizer"])  # the block alone works too
    assert isinstance(lamb, OnebitLamb) and lamb.max_coeff == 0.3 and lamb.freeze_step == 1000

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_ONE_ADAM))
    zoa = from_deepspeed_config(_params(), str(path))
    assert isinstance(zoa, ZeroOneAdam) and zoa.local_step_scaler == 1000 and zoa.var_freeze_step == 1000


@pytest.mark.parametrize("block,match", [
    ({"type": "Adam", "params": {}}, "optimizer type"),
    ({"type": "OneBitAdam", "params": {"freeze_stp": 3}}, "freeze_stp"),
    ({"type": "OneBitAdam", "params": {"amsgrad": True}}, "amsgrad"),
    ({"type": "ZeroOneAdam", "params": {"freeze_step": 3}}, "freeze_step"),
    ({"params": {}}, "type"),
])
def test_bad_blocks(block, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed_config(_params(), {"optimizer": block})
