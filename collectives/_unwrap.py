"""Reaching the optimizer inside a training framework's wrapper."""

from __future__ import annotations


def unwrap_optimizer(optimizer):
    """The optimizer inside the wrappers that frameworks put around it and that hold it as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``);
    anything else as it is."""
    seen = 0
    while optimizer is not None and not hasattr(optimizer, "wants_averaged_gradients") and seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer, seen = inner, seen + 1
    return optimizer
