"""Build a onebit optimizer from a DeepSpeed ``"optimizer"`` block.

Users of DeepSpeed's removed OneBitAdam / OneBitLamb / ZeroOneAdam change one line:
``opt = from_deepspeed_config(model.parameters(), ds_config)``. Keys that only chose
DeepSpeed's transport (``cuda_aware``, ``comm_backend_name``) and keys DeepSpeed accepted
but never used (``bias_correction``, ``eps_inside_sqrt``, ``max_grad_norm``) are ignored,
so a run behaves as it did under DeepSpeed; one log message lists them. Any other unknown
key raises ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = ["from_deepspeed_config"]

log = logging.getLogger("onebit")

_TRANSPORT = ("cuda_aware", "comm_backend_name")
_UNUSED_BY_DEEPSPEED = ("bias_correction", "eps_inside_sqrt", "max_grad_norm")
_COMMON = ("lr", "betas", "eps", "weight_decay")
_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    "onebitadam": (OnebitAdam, _COMMON + ("freeze_step",)),
    "onebitlamb": (OnebitLamb, _COMMON + ("freeze_step", "max_coeff", "min_coeff", "coeff_beta",
                                          "factor_max", "factor_min", "factor_threshold")),
    "zerooneadam": (ZeroOneAdam, _COMMON + ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                                            "local_step_clipper")),
}


def from_deepspeed_config(params, config: dict[str, Any] | str | os.PathLike, *, group=None):
    """The optimizer described by ``config``: a DeepSpeed config (dict or JSON file) with an
    ``"optimizer"`` block, or the block itself (``{"type": ..., "params": {...}}``)."""
    if isinstance(config, str | os.PathLike):
        with open(config) as fh:
            config = json.load(fh)
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict or a path to a JSON file, got {type(config).__name__}")
    block = config.get("optimizer", config)
    if not isinstance(block, dict) or "type" not in block:
        raise ValueError('config: expected an "optimizer" block with a "type"')
    kind = str(block["type"]).replace("_", "").lower()
    if kind not in _TYPES:
        name = block["type"]
        raise ValueError(f"config: optimizer type {name!r} is not OneBitAdam, OneBitLamb or ZeroOneAdam")
    cls, known = _TYPES[kind]
    options = dict(block.get("params", {}))
    if options.pop("amsgrad", False):
        raise ValueError("config: amsgrad is not supported by the 1-bit optimizers (nor was it by DeepSpeed)")
    ignored = [k for k in options if k in _TRANSPORT + _UNUSED_BY_DEEPSPEED]
    unknown = [k for k in options if k not in known and k not in ignored]
    if unknown:
        raise ValueError(f"config: unknown {cls.__name__} parameter(s) {unknown}; known: {list(known)}")
    if ignored:
        log.info(
            "onebit: ignoring DeepSpeed optimizer keys %s (transport choices, or options DeepSpeed "
            "accepted without using them)", ignored,
        )
    kwargs = {k: v for k, v in options.items() if k not in ignored}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, group=group, **kwargs)
