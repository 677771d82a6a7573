"""onebit in the Hugging Face ``Trainer``: one line after building it.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3}))  # or OnebitAdam
    onebit.integrations.transformers.attach(trainer)
    trainer.train()

``attach`` adds a :class:`OnebitTrainerCallback` that, at the start of every ``train()`` (once
the Trainer has built the optimizer and Accelerate the DDP model):

* gives a torch optimizer the DDP compression hook (``onebit_compress_hook`` with the
  optimizer unwrapped from Accelerate's ``AcceleratedOptimizer`` as ``optimizer=``; an
  Adam-type one follows 1-bit Adam's recipe with ``freeze_step`` a quarter of ``max_steps`` by
  default: docs/ALGORITHMS.md 8.2), and a 1-bit optimizer its warm-up hook (``register_ddp_hook``);
* where torch's clip would not see the averaged gradient (a 1-bit optimizer: after its freeze
  each rank holds its own gradient; a torch optimizer behind the hook: its compressed iterations'
  average carries 1-bit noise), turns the Trainer's gradient clipping
  (``max_grad_norm``, on by default) into a clip by the norm every rank agrees on, with the same
  ``max_grad_norm``. The logged ``grad_norm`` is then the agreed norm;
* saves every rank's onebit state (the optimizer's error buffers and counters, the hook's
  state) inside the Trainer's checkpoint folder, ``checkpoint-<step>/onebit/``, and restores it
  on ``train(resume_from_checkpoint=...)`` (the Trainer saves rank 0's ``optimizer.pt`` only and
  loads it on every rank);
* a step that a 1-bit optimizer skipped for a non-finite gradient (``nonfinite="skip"``, the
  same on every rank) does not advance the learning-rate schedule, as a skipped fp16 step does not.

``attach`` also replaces Accelerate's fp16 ``GradScaler`` (whose overflow check is local) by
onebit's :class:`~onebit.optimizers.GradScaler`, with the same settings. Gradient accumulation
(Accelerate's ``no_sync``), ``torch.compile`` and a second ``train()`` work unchanged.
Pass ``ddp_find_unused_parameters=False`` in ``TrainingArguments`` for a model that uses every
parameter (the Trainer's default, True, costs a graph walk every step).
"""

from __future__ import annotations

import os
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    if getattr(e, "name", None) not in ("transformers", "accelerate"):
        raise  # installed, but its import failed for another reason: show that one
    raise ImportError("onebit.integrations.transformers needs transformers and accelerate: "
                      "pip install 'onebit[transformers]'") from e

from ..optimizers import GradScaler
from ._session import STATE_DIR, Session, agreed_scaler, check_hook_options

__all__ = ["OnebitTrainerCallback", "attach"]


def attach(trainer: Trainer, **hook_options: Any) -> OnebitTrainerCallback:
    """Wire onebit into ``trainer`` (see the module's docstring); returns the callback added.

    ``hook_options``: ``freeze_step``, ``start_iter``, ``block``, ``variance_floor`` of
    :class:`~onebit.collectives.OnebitCompressHookState` (used with a torch optimizer). Call it
    once per Trainer, before ``train()``."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    if any(isinstance(cb, OnebitTrainerCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("trainer: onebit is attached to it already")
    callback = OnebitTrainerCallback(trainer, **hook_options)
    trainer.add_callback(callback)
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None and not isinstance(scaler, GradScaler):
        trainer.accelerator.scaler = agreed_scaler(scaler)
    return callback


class OnebitTrainerCallback(TrainerCallback):
    """The callback :func:`attach` adds; ``session`` holds the hook state and the optimizer."""

    def __init__(self, trainer: Trainer, **hook_options: Any) -> None:
        self.trainer = trainer
        self.session = Session(check_hook_options(hook_options))
        self.max_grad_norm: float | None = None  # the Trainer's, while onebit clips in its place
        self.grad_norm: float | None = None  # the agreed norm of the last step
        self._skipped = 0

    # -- start: hook, clip, resume -----------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        trainer, session = self.trainer, self.session
        session.setup(trainer.model_wrapped, trainer.optimizer, total_steps=state.max_steps)
        if session.clip_is_local and args.max_grad_norm and args.max_grad_norm > 0:
            # the Trainer clips with torch's clip_grad_norm_ on local gradients; onebit clips
            # by the agreed norm in on_pre_optimizer_step instead (restored at on_train_end)
            self.max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0
        if state.global_step > 0:  # resumed: the Trainer loaded rank 0's optimizer.pt everywhere
            folders = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
            if isinstance(args.resume_from_checkpoint, str):
                folders.insert(0, args.resume_from_checkpoint)
            session.load([os.path.join(f, STATE_DIR) for f in folders], state.global_step)
        opt = session.onebit_optimizer
        self._skipped = opt.skipped_steps if opt is not None else 0

    def on_train_end(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None:
            args.max_grad_norm, self.max_grad_norm = self.max_grad_norm, None

    # -- every step --------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None:
            self.grad_norm = float(self.session.clip(self.max_grad_norm))

    def on_optimizer_step(self, args, state, control, **kwargs):
        opt = self.session.onebit_optimizer
        if opt is None:
            return
        skipped, self._skipped = opt.skipped_steps > self._skipped, opt.skipped_steps
        wrapper = self.trainer.optimizer
        # Accelerate's AcceleratedOptimizer reports a skipped step through _is_overflow (what its
        # fp16 scaler sets), and the Trainer then leaves the learning-rate schedule where it was
        if hasattr(wrapper, "_is_overflow"):
            if skipped:
                wrapper._is_overflow = True
            elif getattr(wrapper, "scaler", None) is None:
                wrapper._is_overflow = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        # the Trainer logs a norm it computed itself on this rank's gradients: the agreed one instead
        if self.max_grad_norm is not None and self.grad_norm is not None and logs and "grad_norm" in logs:
            logs["grad_norm"] = self.grad_norm
            if state.log_history and "grad_norm" in state.log_history[-1]:
                state.log_history[-1]["grad_norm"] = self.grad_norm

    # -- checkpoints -------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        if args.save_only_model:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.session.save(os.path.join(folder, STATE_DIR), state.global_step)
