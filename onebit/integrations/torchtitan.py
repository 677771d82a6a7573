"""torchtitan (0.3.0): the 1-bit optimizers and the AdamW hooks, chosen from the command line.

torchtitan trains data-parallel with FSDP2 over DTensors; with
``--parallelism.data_parallel_replicate_degree R`` it is HSDP on the 2-D mesh
``["dp_replicate", "fsdp"]``, and the all-reduce across the R replicas is the traffic onebit
compresses (docs/ALGORITHMS.md 11). Two overrides of torchtitan's optimizer config, activated
with ``--override.imports``:

- ``onebit.integrations.torchtitan.onebit_adam``: :class:`~onebit.optimizers.OnebitAdam` in
  place of every Adam/AdamW parameter group (their lr, betas, eps and weight decay kept, with
  Adam's bias correction), e.g. ``'onebit.integrations.torchtitan.onebit_adam={"freeze_step":
  200}'``. FSDP averages the warm-up's gradients; from the freeze on each rank compresses its
  slice of the momentum across the replicas.
- ``onebit.integrations.torchtitan.adamw_hooks``: torchtitan's AdamW unchanged, behind
  ``register_fsdp_hooks(model, optimizer=adamw, freeze_step=...)`` on every model part (1-bit
  Adam's recipe, ALGORITHMS 8.2). No ``parallelize_fn`` of your own: the hooks go on the FSDP
  modules torchtitan's own parallelize made (its mixed precision, activation checkpointing and
  compile stay), once the optimizer exists, which they need. Not with gradient accumulation
  (torchtitan reduces every micro-batch): use ``onebit_adam`` there.

Both take ``freeze_step`` (full-precision steps first; about a quarter of the run),
``block`` (elements per scale) and ``max_norm``: torchtitan clips with each replica's own
gradient norm, which after the freeze differs between replicas (and, behind the hooks, carries
the momentum's 1-bit noise); with ``max_norm`` the container clips by the norm every rank
agrees on inside its ``step()``: set ``--training.max_norm inf`` so that torchtitan's clip does
nothing. The container's ``state_dict()`` adds each rank's error buffers, counters and frozen
denominators under a key of the rank's own (``onebit.rank00003``), so torchtitan's DCP
checkpoints resume exactly; torchtitan's ``init_optim_state`` step (lr 0, zero gradients) makes
no onebit update. Tensor, context and pipeline parallelism are not supported (the parameters
must be placed ``(Replicate(), Shard(0))``).

torchtitan's torchft experiment (``--module torchft...``, ``--fault_tolerance.enable``) picks its
process group by name and cannot take one; ``onebit_torchft`` (below) makes its gloo group
:class:`~onebit.collectives.torchft.OnebitProcessGroupGloo` and attaches it to the Manager with
the run's fragment count, so torchft's DiLoCo (``--fault_tolerance.semi_sync_method diloco``)
sends 1-bit error-compensated pseudo-gradients (docs/diloco.md, "torchft").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.experiments.torchft.manager import TorchFTManager

from ..checkpoint import RankState
from ..collectives import register_fsdp_hooks
from ..optimizers import OnebitAdam

__all__ = ["OnebitOptimizersContainer", "OnebitTorchFTManager", "adamw_hooks", "onebit_adam",
           "onebit_torchft"]

_KEY = "onebit."


class OnebitOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with onebit's choices (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        mode: str = "onebit_adam"
        """``"onebit_adam"``: OnebitAdam for the Adam/AdamW groups; ``"adamw_hooks"``: the FSDP hooks."""
        freeze_step: int = 100
        """Full-precision steps before compression (about a quarter of the run)."""
        block: int | None = 64
        """Elements per scale of the compressed all-reduces."""
        max_norm: float | None = None
        """Clip by the norm every rank agrees on, in ``step()`` (with ``--training.max_norm inf``)."""

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "OnebitAdam":
            return OnebitAdam
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if config.mode not in ("onebit_adam", "adamw_hooks"):
            raise ValueError(f"mode: expected 'onebit_adam' or 'adamw_hooks', got {config.mode!r}")
        if config.mode == "onebit_adam":
            config = _with_onebit_adam(config)
        super().__init__(config, model_parts=model_parts)
        self.onebit_config = config
        self.hooks = []
        if config.mode == "adamw_hooks":
            if len(self.optimizers) != len(model_parts):
                raise ValueError("param_groups: adamw_hooks expects one AdamW optimizer per model part, got "
                                 f"{len(self.optimizers)} optimizers for {len(model_parts)} parts")
            for model, opt in zip(model_parts, self.optimizers, strict=True):
                self.hooks.append(register_fsdp_hooks(model, block=config.block, optimizer=opt,
                                                      freeze_step=config.freeze_step))

    def _rank_state(self) -> RankState | None:
        objects = [o for o in self.optimizers if isinstance(o, OnebitAdam)] + self.hooks
        return RankState(*objects) if objects else None

    def step(self, closure=None):
        max_norm = self.onebit_config.max_norm
        if max_norm is not None:
            if self.hooks:
                for hooks in self.hooks:
                    hooks.clip_grad_norm_(max_norm)
            else:
                for opt in self.optimizers:
                    opt.clip_grad_norm_(max_norm)
        return super().step(closure)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()  # runs init_optim_state: no onebit update (see the module docstring)
        ranks = self._rank_state()
        if ranks is not None:
            out.update({_KEY + key: blob for key, blob in ranks.state_dict().items()})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = {key[len(_KEY):]: value for key, value in state_dict.items() if key.startswith(_KEY)}
        rest = {key: value for key, value in state_dict.items() if not key.startswith(_KEY)}
        super().load_state_dict(rest)
        ranks = self._rank_state()
        if ranks is not None:
            ranks.load_state_dict(mine)


def _with_onebit_adam(config):
    """The param groups with OnebitAdam in place of Adam/AdamW (their kwargs kept, Adam's bias
    correction on), and OnebitAdam's constructor options."""
    import copy

    config = copy.copy(config)
    groups = []
    for pg in config.param_groups:
        if pg.optimizer_name in ("Adam", "AdamW"):
            kwargs = {k: v for k, v in pg.optimizer_kwargs.items() if k not in ("fused", "foreach")}
            pg = type(pg)(pattern=pg.pattern, optimizer_name="OnebitAdam",
                          optimizer_kwargs={**kwargs, "bias_correction": True})
        groups.append(pg)
    config.param_groups = groups
    by_name = dict(config.optimizer_factory_kwargs_by_name)
    by_name["OnebitAdam"] = {"freeze_step": config.freeze_step, "block": config.block,
                             **by_name.get("OnebitAdam", {})}
    config.optimizer_factory_kwargs_by_name = by_name
    config.implementation = "for-loop"  # torch's fused/foreach flags mean nothing to OnebitAdam
    return config


def _options(freeze_step: int, block: int | None, max_norm: float | None) -> dict[str, Any]:
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or not max_norm > 0
                                 or math.isinf(max_norm)):
        raise ValueError(f"max_norm: expected a positive finite number, got {max_norm!r}")
    return {"freeze_step": int(freeze_step), "block": block, "max_norm": max_norm}


@override(target=OptimizersContainer.Config, description="onebit: OnebitAdam (1-bit Adam) on HSDP")
def onebit_adam(cfg: OptimizersContainer.Config, *, freeze_step: int = 100, block: int | None = 64,
                max_norm: float | None = None) -> OnebitOptimizersContainer.Config:
    """torchtitan override (``--override.imports 'onebit.integrations.torchtitan.onebit_adam={...}'``):
    OnebitAdam in place of the Adam/AdamW parameter groups (module docstring)."""
    return derive(cfg, OnebitOptimizersContainer.Config, mode="onebit_adam",
                  **_options(freeze_step, block, max_norm))


@override(target=OptimizersContainer.Config, description="onebit: AdamW behind 1-bit FSDP hooks (HSDP)")
def adamw_hooks(cfg: OptimizersContainer.Config, *, freeze_step: int = 100, block: int | None = 64,
                max_norm: float | None = None) -> OnebitOptimizersContainer.Config:
    """torchtitan override (``--override.imports 'onebit.integrations.torchtitan.adamw_hooks={...}'``):
    torchtitan's AdamW behind ``register_fsdp_hooks(optimizer=..., freeze_step=...)`` (module
    docstring)."""
    return derive(cfg, OnebitOptimizersContainer.Config, mode="adamw_hooks",
                  **_options(freeze_step, block, max_norm))


class OnebitTorchFTManager(TorchFTManager):
    """torchtitan's ``TorchFTManager`` whose gloo process group is ``OnebitProcessGroupGloo``,
    attached to the Manager with the run's fragment count (semi-sync DiLoCo only)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerance):
        onebit_block: int | None = 128
        """Elements per scale of the 1-bit all-reduce (OnebitProcessGroupGloo's ``block``)."""
        onebit_error_decay: float = 0.5
        """The error buffers' decay between syncs (OnebitProcessGroupGloo's ``error_decay``)."""

    def __init__(self, config: Config) -> None:
        if not config.enable:
            super().__init__(config)
            return
        if config.semi_sync_method != "diloco" or config.process_group != "gloo":
            raise ValueError(
                "fault_tolerance: onebit_torchft sends DiLoCo's pseudo-gradients 1-bit; it needs "
                f"semi_sync_method='diloco' and process_group='gloo', got {config.semi_sync_method!r} "
                f"and {config.process_group!r} (in torchft's synchronous mode every gradient would go "
                "through the group: use onebit_adam or adamw_hooks for that)")
        import torchft

        from ..collectives.torchft import OnebitProcessGroupGloo

        made: list = []

        def gloo(timeout):
            made.append(OnebitProcessGroupGloo(timeout=timeout, block=config.onebit_block,
                                               error_decay=config.onebit_error_decay))
            return made[-1]

        real = torchft.ProcessGroupGloo
        torchft.ProcessGroupGloo = gloo  # TorchFTManager looks it up when it builds the group
        try:
            super().__init__(config)
        finally:
            torchft.ProcessGroupGloo = real
        fragments = len(config.module_fqns_per_model_fragment) or config.num_fragments
        self.onebit_pg = made[0]
        self.onebit_pg.attach(self.manager, fragments=fragments)


@override(target=TorchFTManager.Config, description="onebit: DiLoCo's pseudo-gradients 1-bit through torchft")
def onebit_torchft(cfg, *, block: int | None = 128, error_decay: float = 0.5):
    """torchtitan override (``--override.imports 'onebit.integrations.torchtitan.onebit_torchft'``)
    of the torchft experiment's fault-tolerance config: its gloo process group becomes onebit's
    1-bit one for DiLoCo (module docstring)."""
    return derive(cfg, OnebitTorchFTManager.Config, onebit_block=block, onebit_error_decay=error_decay)
