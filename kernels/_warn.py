"""Warnings attributed to the user's line, wherever in onebit they are raised (lowest layer:
the kernels, the collectives and the optimizers all warn through it)."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]


def _internal_dirs() -> tuple[str, ...]:
    """Directories whose frames a warning skips: onebit's packages (wherever they are
    installed) and torch (its optimizer wrappers, no_grad decorators and autograd engine sit
    between a user's line and ours)."""
    names = ("onebit", "onebit.kernels", "onebit.collectives", "onebit.optimizers", "torch")
    files = [getattr(sys.modules.get(name), "__file__", None) for name in names]
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)


def warn_user(message: str, category: type[Warning]) -> None:
    """warnings.warn attributed to the first frame outside onebit and torch: the user's line
    (``opt.step()``, ``loss.backward()``, ``opt.stats()``), however deep the call came from."""
    internal = _internal_dirs()
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)
