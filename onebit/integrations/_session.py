"""What every framework adapter does alike, once the framework has built the DDP model and the
optimizer: register the right DDP communication hook, clip by a norm every rank agrees on,
and save and restore each rank's onebit state (error buffers, counters, the hook's state).

* A torch optimizer (AdamW, SGD, ...) gets :func:`~onebit.collectives.onebit_compress_hook`
  with ``optimizer=`` the framework's optimizer unwrapped. Its gradients come out of the hook
  bitwise identical on every rank, so the framework's own clipping is already agreed.
* A 1-bit optimizer gets :func:`~onebit.optimizers.register_ddp_hook` (full-precision averaging
  while it wants it, its local gradient otherwise). After the freeze each rank holds its own
  gradient, so the framework's ``clip_grad_norm_`` must become ``opt.clip_grad_norm_``.
* Per-rank state goes through :mod:`onebit.checkpoint` (one file per rank, written atomically,
  loaded after every rank agreed on the step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import checkpoint
from ..collectives import OnebitCompressHookState, _several, onebit_compress_hook
from ..collectives._frozen_adam import is_adam_type
from ..collectives._group import warn_collective
from ..collectives._unwrap import unwrap_optimizer
from ..optimizers import GradScaler, register_ddp_hook, warmup_averaging_hook
from ..optimizers._base import OnebitOptimizerBase

HOOK_OPTIONS = ("start_iter", "block", "variance_floor", "freeze_step")
ADAM_FREEZE = 0.25  # an Adam-type optimizer's default freeze_step, as a fraction of the run
STATE_DIR = "onebit"  # inside a framework's checkpoint folder: <folder>/onebit/step<N>/rank<r>.pt


def check_hook_options(options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments an adapter passes on to :class:`OnebitCompressHookState`."""
    unknown = sorted(set(options) - set(HOOK_OPTIONS))
    if unknown:
        raise TypeError(f"hook_options: unknown option(s) {unknown}; expected any of {list(HOOK_OPTIONS)} "
                        "(OnebitCompressHookState's arguments; the process group and optimizer come from "
                        "the framework)")
    return dict(options)


def find_ddp(model: Any) -> DistributedDataParallel | None:
    """The DistributedDataParallel inside what a framework holds: the model itself, or under
    ``torch.compile``'s wrapper (``_orig_mod``) or Lightning Fabric's (``_forward_module``);
    None without one (one process, FSDP, ...)."""
    for _ in range(4):
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "_forward_module", None)
        if model is None:
            return None
    return None


class Session:
    """One training run's onebit wiring: the hook, the clip and the per-rank state.

    ``clip(max_norm)`` clips by the norm every rank agrees on (see :meth:`clip`),
    ``save(directory, step)`` writes this rank's onebit state (not a collective),
    ``load([directory], step)`` restores it on every rank (a collective), ``hook_state`` is the
    compression hook's state (a torch optimizer) and ``optimizer`` the unwrapped optimizer."""

    def __init__(self, hook_options: dict[str, Any]) -> None:
        self.hook_options = check_hook_options(hook_options)
        self.hook_state: OnebitCompressHookState | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.ddp: DistributedDataParallel | None = None

    @property
    def onebit_optimizer(self) -> OnebitOptimizerBase | None:
        return self.optimizer if isinstance(self.optimizer, OnebitOptimizerBase) else None

    def setup(self, model: Any, optimizer: torch.optim.Optimizer, total_steps: int | None = None) -> None:
        """Register the hook that fits ``optimizer`` on the DDP model inside ``model``. Called
        again for the same DDP (a second ``train()``/``fit()``), it keeps the hook and its state.
        An Adam-type torch optimizer gets 1-bit Adam's recipe (``freeze_step``, docs/ALGORITHMS.md
        8.2), frozen after ``ADAM_FREEZE`` of ``total_steps`` unless ``freeze_step`` was given;
        without either, the hook's gradient compression in Adam's preconditioned space. So does the
        one Adam-type among several (``Combined([muon, adamw])``): Muon's matrices are compressed from
        the hook's ``start_iter`` all the same (measured: bench/RESULTS.md "The DDP hook with Muon")."""
        self.optimizer = unwrap_optimizer(optimizer)
        self.ddp = ddp = find_ddp(model)
        if ddp is None:
            return
        hooks = [(hook, state) for hook, state in getattr(ddp, "_comm_hooks", [])]
        onebit = self.onebit_optimizer
        if onebit is not None:
            if any(h is warmup_averaging_hook and s is onebit for h, s in hooks):
                return
            if hooks:
                raise ValueError(self._taken(hooks))
            register_ddp_hook(ddp, onebit)
            return
        if len(hooks) == 1 and hooks[0][0] is onebit_compress_hook:
            self.hook_state = hooks[0][1]
            self.hook_state.optimizer = self.optimizer  # the same run's optimizer, or a new one
            return
        if hooks:
            raise ValueError(self._taken(hooks))
        options = dict(self.hook_options)
        if "freeze_step" not in options and total_steps and _one_adam(self.optimizer):
            options["freeze_step"] = max(1, round(ADAM_FREEZE * total_steps))
        self.hook_state = OnebitCompressHookState(ddp.process_group, optimizer=self.optimizer, **options)
        ddp.register_comm_hook(self.hook_state, onebit_compress_hook)

    @staticmethod
    def _taken(hooks) -> str:
        names = ", ".join(getattr(h, "__name__", repr(h)) for h, _ in hooks)
        return (f"model: the DistributedDataParallel model already has a communication hook ({names}); "
                "onebit would average (or compress) the gradients a second time. Remove that hook (or the "
                "framework option that adds it) and let onebit register its own")

    # -- clipping ----------------------------------------------------------------------------
    @property
    def clip_is_local(self) -> bool:
        """Whether the framework's clip_grad_norm_ would not see the averaged gradient: each
        rank's own with a 1-bit optimizer on several ranks (after its freeze; before it, to
        keep one code path), or with the compression hook its compressed iterations' average,
        whose 1-bit noise the norm reads (1.5-4x the mean gradient's on the HF page's GPT-2): an
        SGD's or a Muon's from ``start_iter``, the gradient rebuilt from 1-bit momentum after
        ``freeze_step``. The hook state's clip is torch's in its full-precision iterations."""
        opt = self.onebit_optimizer
        if opt is not None:
            return opt.world_size > 1
        return self.hook_state is not None and self.hook_state.world_size > 1

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the optimizer's gradients by a norm every rank agrees on and return it: a 1-bit
        optimizer's ``clip_grad_norm_``; with the compression hook, the hook state's (torch's on
        the averaged gradient, the same on every rank, or after ``freeze_step`` the ranks' agreed
        gradient norm)."""
        opt = self.onebit_optimizer
        if opt is not None:
            return opt.clip_grad_norm_(max_norm, norm_type)
        if self.optimizer is None:
            raise RuntimeError("clip: called before the session was set up with an optimizer")
        if self.hook_state is not None:
            return self.hook_state.clip_grad_norm_(max_norm, norm_type)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    # -- per-rank state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.onebit_optimizer is not None:
            out["optimizer"] = self.onebit_optimizer.state_dict()
        if self.hook_state is not None:
            out["hook"] = self.hook_state.__getstate__()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer" in state and self.onebit_optimizer is not None:
            self.onebit_optimizer.load_state_dict(state["optimizer"])
        if "hook" in state and self.hook_state is not None:
            self.hook_state.__setstate__(state["hook"])

    @property
    def has_state(self) -> bool:
        return self.onebit_optimizer is not None or self.hook_state is not None

    def save(self, directory: str, step: int, keep: int = 2) -> str | None:
        """This rank's state for ``step`` in ``directory`` (not a collective)."""
        if not self.has_state:
            return None
        return checkpoint.save(self.state_dict(), directory, step, keep=keep)

    def load(self, directories: list[str], step: int) -> str | None:
        """Restore this rank's state for ``step`` from the first of ``directories`` where every
        rank has it (a collective); returns that directory, or None (said once for the group)."""
        if not self.has_state:
            return None
        group = self._group()
        candidates = list(dict.fromkeys(d for d in directories if d))
        for directory in candidates:
            found = checkpoint.load_step(directory, step, group=group)
            if found is not None:
                self.load_state_dict(found)
                return directory
        warn_collective(
            f"onebit: resuming at step {step}, but no directory among {candidates} holds every rank's "
            "onebit state for that step (step.../rank....pt): each rank's error-feedback buffers start "
            "from zero and the run does not resume exactly", RuntimeWarning, group)
        return None

    def _group(self):
        if self.onebit_optimizer is not None:
            return self.onebit_optimizer.process_group
        return self.hook_state.process_group if self.hook_state is not None else None


def agreed_scaler(scaler: torch.amp.GradScaler) -> GradScaler:
    """onebit's GradScaler (overflow check agreed over the optimizer's group) with the settings
    and the current scale of torch's ``scaler``."""
    agreed = GradScaler(scaler._device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                        backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
                        enabled=scaler.is_enabled())
    agreed.load_state_dict(scaler.state_dict())
    return agreed


def _one_adam(optimizer) -> bool:
    """Whether ``optimizer`` is an Adam-type torch optimizer, or several (a ``Combined``) of which one is."""
    if is_adam_type(optimizer):
        return True
    try:
        members = _several.members(_several.combine(optimizer))
    except (TypeError, ValueError):
        return False
    return len(members) > 1 and sum(is_adam_type(m) for m in members) == 1
