"""onebit inside the training frameworks people use, one module per framework.

  onebit.integrations.transformers  ``attach(trainer)``: the Hugging Face Trainer (Accelerate)
  onebit.integrations.lightning     ``OnebitCallback()``: PyTorch Lightning's Trainer
  onebit.integrations.attach        a loop you write around Accelerate's ``Accelerator``,
                                    Lightning Fabric or plain DDP: ``attach(model, optimizer)``

This layer sits above the three others (kernels -> collectives -> optimizers -> integrations):
it uses only their public API, and nothing below imports it. Each framework is an optional
dependency, imported when its module is; ``_session`` holds what every adapter does alike
(register the right DDP hook, clip by an agreed norm, save and restore each rank's state).
"""

from __future__ import annotations

from typing import Any

from ._session import Session

__all__ = ["Session", "attach"]


def attach(model: Any, optimizer: Any, **hook_options: Any) -> Session:
    """Wire onebit into a training loop you write, after the framework prepared model and
    optimizer: ``model, opt = accelerator.prepare(model, opt)`` (Hugging Face Accelerate) or
    ``model, opt = fabric.setup(model, opt)`` (Lightning Fabric), or a plain DDP model.

    Registers the DDP hook that fits the optimizer (see :class:`Session`) and returns the
    session. For an Adam-type torch optimizer pass ``freeze_step`` (about a quarter of your
    run: 1-bit Adam's recipe, docs/ALGORITHMS.md 8.2); without it the hook compresses Adam's
    preconditioned gradient, 5-8% behind plain DDP on the demo's LM.

    In the loop, clip with ``session.clip(max_norm)`` in place of the framework's
    ``clip_grad_norm_`` / ``clip_gradients``: with a 1-bit optimizer the framework's clip sees
    each rank's own gradients, after ``freeze_step`` the momentum's 1-bit noise. Checkpoint
    with ``session.save(directory, step)`` on every rank beside the framework's own
    checkpoint, and ``session.load([directory], step)`` on resume, after the framework
    restored the optimizer. fp16: give Accelerate onebit's GradScaler before ``prepare``
    (``accelerator.scaler = onebit.optimizers.GradScaler("cuda")``)."""
    session = Session(hook_options)
    session.setup(model, optimizer)
    return session
