"""Shared test helpers: comparisons and the in-process simulation of W ranks."""

from __future__ import annotations

import torch

from onebit.collectives import local_compressed_allreduce


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, norm: float | None = None) -> float:
    """||actual - expected|| / norm in float64; ``norm`` defaults to ||expected||.

    Error buffers (``e = z - s*sgn(z)``) cancel: compare them against the norm of what was
    compressed (``s * sqrt(len)``), the scale at which float32 rounds them.
    """
    a, e = actual.double().reshape(-1), expected.double().reshape(-1)
    diff = torch.linalg.vector_norm(a - e).item()
    if norm is None:
        norm = torch.linalg.vector_norm(e).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def assert_rel(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, norm: float | None = None
) -> None:
    err = rel_rms(actual, expected, norm)
    if not err <= tol:
        d = (actual.double().reshape(-1) - expected.double().reshape(-1)).abs()
        i = int(torch.argmax(torch.nan_to_num(d, nan=float("inf"))))
        raise AssertionError(
            f"{what}: relative RMS error {err:.3g} > {tol:g}; worst element {i}: "
            f"{actual.reshape(-1)[i].item()!r} vs {expected.reshape(-1)[i].item()!r}"
        )


def simulate_allreduce(xs, worker_errors, server_errors, backend=None):
    """The local compute of one compressed_allreduce for W ranks in one process (the public
    local_compressed_allreduce on copies of ``xs``); errors are updated in place. Returns the
    per-rank outputs (new tensors of the inputs' dtype)."""
    return local_compressed_allreduce([x.clone() for x in xs], worker_errors, server_errors, backend=backend)
