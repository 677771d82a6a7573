"""How an optimizer folds its gradient into its ``momentum_buffer``: what the DDP hook needs to compress
each rank's own momentum (docs/ALGORITHMS.md 8.1 for SGD, 8.3 for Muon).

Both conventions onebit knows are ``m_t = b m_{t-1} + (1 - tau) s g`` on the gradient ``g`` the optimizer
is handed, with ``m_{t-1}`` the same on every rank:

- ``torch.optim.SGD`` (and its subclasses): ``b`` its ``momentum``, ``tau`` its ``dampening``, ``s = -1``
  under ``maximize``; its weight decay joins ``g`` after the hook.
- ``torch.optim.Muon`` (torch 2.9+, and its subclasses): ``buf.lerp_(g, 1 - momentum)``: ``b = tau =
  momentum``; its weight decay is decoupled (on the parameter), its Nesterov term reads the same ``g``.

The hook adds ``c = s b / (1 - tau) m_{t-1}`` to each rank's gradient before the compressed all-reduce and
takes it off the mean after: the optimizer's momentum is then the compressed mean of the ranks' momenta.
The hook's ``momentum_share`` scales ``c``: "auto" takes SGD's whole momentum and none of Muon's (its
gradient compressed: measured better, docs/ALGORITHMS.md 8.3).
Another optimizer whose groups hold a ``momentum`` (RMSprop's buffer is a momentum of the preconditioned
step; a Muon written elsewhere may keep ``b m + g``) would be misread: it is refused, naming it."""

from __future__ import annotations

import torch


def _muon_type():
    return getattr(torch.optim, "Muon", None)


def convention(optimizer: torch.optim.Optimizer, name: str = "optimizer") -> str | None:
    """``"sgd"`` or ``"lerp"`` (Muon's); None: no group of ``optimizer`` has a momentum. Raises
    ``TypeError`` for an optimizer with a momentum whose convention onebit does not know."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    muon = _muon_type()
    if muon is not None and isinstance(optimizer, muon):
        return "lerp"
    if any(float(g.get("momentum", 0.0) or 0.0) > 0 for g in optimizer.param_groups):
        raise TypeError(
            f"{name}: {type(optimizer).__name__} keeps a momentum whose update onebit does not know (it "
            "knows torch.optim.SGD's, m = b m + (1 - dampening) g, and torch.optim.Muon's, m = m.lerp(g, 1 - "
            "momentum)); read as SGD's it would compress the wrong quantity")
    return None


AUTO_SHARE = {"sgd": 1.0, "lerp": 0.0}  # momentum_share="auto": SGD's momentum, Muon's gradient (8.3)


def share_of(optimizer: torch.optim.Optimizer, share) -> float:
    """The momentum share of ``optimizer``'s parameters: ``share`` (a number in [0, 1]), or for "auto"
    (None too) :data:`AUTO_SHARE` of its convention (0 without a momentum)."""
    if share is None or share == "auto":
        kind = convention(optimizer)
        return 0.0 if kind is None else AUTO_SHARE[kind]
    return float(share)


def check(optimizer: torch.optim.Optimizer, name: str = "optimizer") -> None:
    """Refuse an optimizer whose momentum the hook would misread (:func:`convention`), or a group whose
    momentum never takes a gradient (:func:`factor`)."""
    for group in optimizer.param_groups:
        factor(optimizer, group, name)


def factor(optimizer: torch.optim.Optimizer, group: dict, name: str = "optimizer") -> float:
    """``s b / (1 - tau)`` of ``group`` (0.0 without momentum): the multiple of its ``momentum_buffer``
    that makes the compressed quantity each rank's own momentum (in gradient units)."""
    kind, b = convention(optimizer, name), float(group.get("momentum", 0.0) or 0.0)
    if kind is None or b == 0.0:
        return 0.0
    tau = b if kind == "lerp" else float(group.get("dampening", 0.0))
    if tau >= 1.0:
        raise ValueError(f"{name}: a group's {'momentum' if kind == 'lerp' else 'dampening'} is {tau}: "
                         "its momentum never takes a gradient, expected less than 1")
    s = -1.0 if group.get("maximize", False) else 1.0
    return s * b / (1.0 - tau)
