"""Muon's matrices compressed in the singular bases of their momentum (docs/ALGORITHMS.md 8.4).

Before a compressed all-reduce the DDP hook turns the gradient ``G`` of each of a Muon's matrices into
``U^T G V`` in its place in the bucket, and the average back into ``U A V^T`` after it: ``U``, ``V`` the
singular vectors of the Muon's ``momentum_buffer`` (the same on every rank), made anew every ``every``
iterations. The errors stay in the turned coordinates; at new bases a bucket's own errors are carried
into them (:func:`carry_`: the server's debt moved into its rank's worker error, each worker error
turned), so that error feedback owes what it owed. Element ``(k, l)`` of the turned matrix is sent
divided by ``w_kl``, ``s_k + s_l`` of the momentum's singular values (:func:`weights`), and multiplied
back after: the error that reaches Newton-Schulz's output is ``E_kl / (s_k + s_l)``, so the codec
minimises that one. Only where the Muon's momentum share is 0 (its
gradient compressed: the hook's default): a momentum term added before the call would be in the other
coordinates."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

from . import _momentum, _several

Name = tuple[int, int]
FLOOR = 0.01  # weights: s_k + s_l raised to at least this fraction of their mean


def _mkl_threads_local():
    """MKL's ``MKL_Set_Num_Threads_Local`` (its C interface) from torch's own library where torch was
    built with MKL and ships it as ``lib/libtorch_cpu.so`` (None elsewhere: the calls keep MKL's
    threads)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        fn = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = fn.MKL_Set_Num_Threads_Local  # (the lower-case names take a pointer)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_THREADS_LOCAL = _mkl_threads_local()


@contextlib.contextmanager
def serial():
    """MKL single-threaded on this thread inside the block (restored after). The bases' SVD and products
    run on every rank and must round alike there: MKL's rounding follows the threads a call gets, which
    with its dynamic threading follow what else runs (the turn back runs in the communication callback
    while the backward pass goes on), and on a 2-core AMD EPYC the replicas of the tests' small model
    ended 1e-4 apart after 30 iterations (docs/ALGORITHMS.md 8.4, "Cost")."""
    if _THREADS_LOCAL is None:
        yield
        return
    before = _THREADS_LOCAL(1)
    try:
        yield
    finally:
        _THREADS_LOCAL(before)


def _serial(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with serial():
            return fn(*args, **kwargs)
    return wrapper


def weights(shape, s: torch.Tensor | None) -> torch.Tensor | None:
    """``w_kl = max(s_k + s_l, FLOOR)`` for an ``a x b`` matrix, ``s`` its momentum's singular values
    (descending; 0 past its rank) divided as :func:`bases_of` leaves them (``s_k + s_l`` has mean 1);
    None where ``s`` is None (the turned matrix sent as it is). Nothing read back to the host."""
    if s is None:
        return None
    a, b = shape
    sa, sb = s.new_zeros(a), s.new_zeros(b)
    sa[: len(s)], sb[: len(s)] = s, s
    return (sa[:, None] + sb[None, :]).clamp_min_(FLOOR)


class MomentumBases:
    """Each matrix's bases by its name in the hook's layout: ``(made at iteration, U, V^T, s)``, ``s``
    the momentum's singular values then, as :func:`bases_of` divides them (None: sent unweighted)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.bases: dict[Name, tuple] = {}

    def state(self) -> dict:
        return {"every": self.every,
                "bases": {name: (it, u.clone(), vh.clone(), None if sv is None else sv.clone())
                          for name, (it, u, vh, sv) in self.bases.items()}}

    def load(self, saved: dict) -> None:
        """The saved bases (the interval stays this state's own)."""
        self.bases = {tuple(name): (int(got[0]), got[1], got[2], got[3] if len(got) > 3 else None)
                      for name, got in saved["bases"].items()}

    @_serial
    def turn_(self, optimizer, share, bucket, buffer: torch.Tensor, layout, it: int) -> tuple[list, list]:
        """Turn the bucket's Muon matrices in ``buffer`` in place (``G <- (U^T G V) / w``), their bases made
        first where due; returns what :func:`turn_back_` needs (empty: nothing turned) and what
        :func:`carry_` needs (the matrices given new bases)."""
        spans, made, lo = [], [], 0
        for p, name in zip(bucket.parameters(), layout, strict=True):
            hi = lo + p.numel()
            m = None if p.ndim != 2 or name == (-1, -1) else momentum_of(optimizer, p, share)
            if m is not None:
                got = self.bases.get(name)
                if got is None or it - got[0] >= self.every:
                    new = bases_of(m)
                    if new is not None:
                        made.append((lo, hi, p.shape, None if got is None else got[1:], new))
                        got = (it, *new)
                        self.bases[name] = got
                if got is not None:
                    if got[1].device != buffer.device:  # (loaded elsewhere)
                        got = (got[0], *(None if t is None else t.to(buffer.device) for t in got[1:]))
                        self.bases[name] = got
                    _, u, vh, sv = got
                    w = weights(p.shape, sv)
                    view = buffer[lo:hi].view(p.shape)
                    turned = u.T @ view.float() @ vh.T
                    view.copy_(turned if w is None else turned.div_(w))
                    spans.append((lo, hi, p.shape, u, vh, w))
            lo = hi
        return spans, made


@_serial
def turn_back_(out: torch.Tensor, spans: list) -> torch.Tensor:
    """``A <- U (A w) V^T`` for each span :meth:`MomentumBases.turn_` turned; ``out`` returned."""
    for lo, hi, shape, u, vh, w in spans:
        view = out[lo:hi].view(shape)
        a = view.float() if w is None else view.float() * w
        view.copy_(u @ a @ vh)
    return out


@_serial
def carry_(worker_error: torch.Tensor, server_error: torch.Tensor, made: list, rank: int,
           world_size: int) -> None:
    """Before a bucket's first call in new bases (``made``, from :meth:`MomentumBases.turn_`), its
    errors carried into them: what this rank's server still owes added to its own worker error on the
    chunk it serves, ``world_size`` times (the server averages the workers' messages, so the total owed
    is the same) and the server error zeroed; then each matrix's worker error (this rank holds it whole)
    turned from the old bases into the new, ``E <- (U'^T U (E w) V^T V') / w'`` (``w``, ``w'`` the
    weights of the old bases and of the new)."""
    size = server_error.numel()
    chunk = worker_error[rank * size:(rank + 1) * size]
    chunk.copy_(chunk.float() + world_size * server_error.float())
    server_error.zero_()
    for lo, hi, shape, old, new in made:
        view = worker_error[lo:hi].view(shape)
        e = view.float()
        u, vh, sv = new
        if old is None:  # from the plain coordinates
            e = u.T @ e @ vh.T
        else:
            w_old = weights(shape, old[2])
            e = (u.T @ old[0]) @ (e if w_old is None else e * w_old) @ (old[1] @ vh.T)
        w = weights(shape, sv)
        view.copy_(e if w is None else e.div_(w))


def momentum_of(optimizer, p: torch.Tensor, share) -> torch.Tensor | None:
    """The ``momentum_buffer`` of ``p`` where its optimizer is a Muon (``torch.optim.Muon``'s lerp
    convention) whose momentum share is 0; None elsewhere and before the Muon made it."""
    if optimizer is None:
        return None
    owner = optimizer.owner_of(p) if isinstance(optimizer, _several.Several) else optimizer
    if owner is None or _momentum.convention(owner) != "lerp" or _momentum.share_of(owner, share) != 0.0:
        return None
    buf = owner.state.get(p, {}).get("momentum_buffer")
    return None if buf is None or buf.shape != p.shape else buf.detach()


def bases_of(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(U, V^T, s / mean)`` of ``m = U diag(s) V^T`` (full, float32, on ``m``'s device), ``mean`` that
    of ``s_k + s_l`` over the ``a x b`` elements, ``sum(s) (1/a + 1/b)``; its third None where ``m`` is 0
    (sent unweighted); None where ``m`` is not finite (the bases in use are kept). Two host reads."""
    m = m.float()
    if not bool(torch.isfinite(m).all()):
        return None
    u, sv, vh = torch.linalg.svd(m, full_matrices=True)
    a, b = m.shape
    mean = float(sv.sum()) * (1.0 / a + 1.0 / b)
    return u.contiguous(), vh.contiguous(), sv.div(mean).contiguous() if mean > 0.0 else None
