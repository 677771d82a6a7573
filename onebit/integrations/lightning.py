"""onebit in PyTorch Lightning's ``Trainer``: one callback, on CPU and CUDA.

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", gradient_clip_val=1.0,
                        callbacks=[OnebitCallback()])
    trainer.fit(module)  # configure_optimizers returns AdamW, SGD, ... or OnebitAdam

Lightning registers ``DDPStrategy(ddp_comm_hook=...)`` on CUDA only, before
``configure_optimizers`` runs; this callback does it at ``on_fit_start`` instead, when the
DDP model and the optimizer both exist, on any device:

* a torch optimizer gets the DDP compression hook with ``optimizer=`` (SGD's momentum; an
  Adam-type optimizer 1-bit Adam's recipe, ``freeze_step`` a quarter of the run by default:
  docs/ALGORITHMS.md 8.2); a 1-bit optimizer gets its warm-up hook (``register_ddp_hook``);
* where the framework's clip would not see the averaged gradient (a 1-bit optimizer, or a torch
  optimizer behind the hook, whose compressed average carries 1-bit noise), the clip uses the
  norm every rank agrees on;
  ``gradient_clip_val`` (algorithm ``"norm"``) is applied that way instead of torch's
  ``clip_grad_norm_``;
* every rank's onebit state (error buffers, counters, the hook's state) is written beside the
  checkpoint, ``<dirpath>/onebit/step<global step>/rank<r>.pt`` (Lightning writes rank 0's
  checkpoint only), named in the checkpoint, and restored when ``fit(ckpt_path=...)`` resumes;
* under 16-bit mixed precision, Lightning's ``GradScaler`` (local overflow check) becomes
  onebit's :class:`~onebit.optimizers.GradScaler` with the same settings.

One optimizer per ``fit`` (the hook compresses for the first). Works with
``accumulate_grad_batches`` (Lightning's ``no_sync``) and a second ``fit``. Imports
``pytorch_lightning`` if installed, else ``lightning.pytorch``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - depends on the environment
    try:
        import lightning.pytorch as pl
    except ImportError as e:
        raise ImportError("onebit.integrations.lightning needs pytorch-lightning (or lightning): "
                          "pip install 'onebit[lightning]'") from e

from ..optimizers import GradScaler
from ._session import STATE_DIR, Session, agreed_scaler, check_hook_options

__all__ = ["OnebitCallback"]


class OnebitCallback(pl.Callback):
    """See the module's docstring. ``hook_options``: ``freeze_step`` (an Adam-type optimizer's
    full-precision steps; default a quarter of the run), ``start_iter``, ``block``,
    ``variance_floor`` of :class:`~onebit.collectives.OnebitCompressHookState`. ``state_dir``:
    where each rank writes its state (default: the checkpoint callback's ``dirpath``, else the
    Trainer's ``default_root_dir``); ``keep``: steps kept there per rank (at least 2)."""

    def __init__(self, *, state_dir: str | None = None, keep: int = 3, **hook_options: Any) -> None:
        self.session = Session(check_hook_options(hook_options))
        self.state_dir = state_dir
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 2:
            raise ValueError(f"keep: expected an int >= 2 (a rank killed mid-save needs the step before), "
                             f"got {keep!r}")
        self.keep = keep
        self.gradient_clip_val: float | None = None  # the Trainer's, while onebit clips in its place
        self._pending: tuple[int, str] | None = None  # (step, directory) named by a loaded checkpoint

    # -- start: scaler, hook, clip -------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, GradScaler):
            plugin.scaler = agreed_scaler(scaler)

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"trainer: OnebitCallback handles one optimizer, configure_optimizers gave "
                             f"{len(trainer.optimizers)}")
        session = self.session
        total = trainer.estimated_stepping_batches
        session.setup(trainer.strategy.model, trainer.optimizers[0],
                      total_steps=int(total) if total != float("inf") else None)
        if (session.clip_is_local and trainer.gradient_clip_val
                and trainer.gradient_clip_algorithm in (None, "norm")):
            self.gradient_clip_val, trainer.gradient_clip_val = trainer.gradient_clip_val, None

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.gradient_clip_val is not None:
            trainer.gradient_clip_val, self.gradient_clip_val = self.gradient_clip_val, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # inside optimizer.step(closure), after backward and the scaler's unscale_, where
        # Lightning would clip next and before the optimizer's update
        if self.gradient_clip_val is not None:
            norm = self.session.clip(float(self.gradient_clip_val))
            pl_module.log("grad_norm", norm.float(), on_step=True, on_epoch=False, rank_zero_only=True)
        if self.session.hook_state is not None:
            self.session.hook_state.prepare_step()  # freeze_step: the state for this update

    # -- checkpoints -------------------------------------------------------------------------
    def _directory(self, trainer) -> str:
        if self.state_dir is not None:
            return self.state_dir
        ckpt = trainer.checkpoint_callback
        base = getattr(ckpt, "dirpath", None) or trainer.default_root_dir
        return os.path.join(base, STATE_DIR)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # every rank runs this hook; Lightning writes rank 0's dict only, so each rank writes its
        # own file, and the checkpoint names where they are
        if not self.session.has_state:
            return
        directory = self._directory(trainer)
        self.session.save(directory, trainer.global_step, keep=self.keep)
        checkpoint["onebit"] = {"directory": os.path.abspath(directory), "step": trainer.global_step}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # runs before Lightning restores the optimizer from rank 0's state: applied at on_train_start
        entry = checkpoint.get("onebit")
        self._pending = None if entry is None else (int(entry["step"]), entry["directory"])

    def on_train_start(self, trainer, pl_module) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, directory = pending
        self.session.load([directory], step)
