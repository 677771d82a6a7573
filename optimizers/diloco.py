"""DiLoCo with 1-bit error-compensated pseudo-gradients (docs/ALGORITHMS.md, section 10).

Each replica takes ``sync_every`` inner steps with its own optimizer; then the replicas
average the pseudo-gradient ``theta - x`` (global minus local weights) with
``compressed_allreduce`` (error buffers kept from sync to sync) and an outer optimizer applies
it to the global weights, which every replica then continues from. Streaming: the parameters
in ``fragments`` synced in turn, each all-reduce overlapped with ``delay`` inner steps.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives import _momentum
from ..collectives._failure import guard
from ..collectives._group import group_size, warn_collective
from ..collectives.allreduce import compressed_allreduce, error_buffers
from ..collectives.hierarchical import intra_bytes, shard_numel
from ..collectives.mesh import flat_group, hierarchy, is_mesh
from ..collectives.replicas import verify_replicas
from ..collectives.telemetry import counting
from ..collectives.wire import Traffic
from ..kernels._checks import check_choice, check_instance, check_int, check_number
from ..kernels.layout import check_block
from ..kernels.rounding import check_error_dtype
from ._copying import _handles

__all__ = ["DiLoCo"]

ORDERS = ("strided", "sequential")


@dataclass
class _InFlight:
    """A fragment's all-reduce between its start and its apply step."""

    fragment: int
    due: int  # the inner step at whose end it is applied
    handle: object  # a Future (1-bit), a Work (float32) or None once finished
    result: torch.Tensor  # the fragment's pseudo-gradient buffer; the mean once finished
    share: float = 0.0  # the momentum share g this sync compressed with (section 10)


def _split(params: list[torch.Tensor], F: int, order: str) -> list[list[int]]:
    """Indices of the parameters of each fragment (docs/ALGORITHMS.md, section 10)."""
    if order == "strided":
        return [list(range(f, len(params), F)) for f in range(F)]
    sizes = [p.numel() for p in params]
    total, out, start, acc = sum(sizes), [], 0, 0
    for f in range(F):
        stop = start
        target = total * (f + 1) / F
        while stop < len(params) - (F - 1 - f) and (acc + sizes[stop] <= target or stop == start):
            acc += sizes[stop]
            stop += 1
        if f == F - 1:
            stop = len(params)
        out.append(list(range(start, stop)))
        start = stop
    return out


class DiLoCo:
    """DiLoCo over ``group`` with 1-bit error-compensated pseudo-gradients.

    ``loss.backward(); diloco.step(); diloco.zero_grad()``. ``inner_optimizer`` steps every
    call (local to this replica); every ``sync_every`` calls each fragment's pseudo-gradient
    is averaged over the group and ``outer_optimizer`` (over the same parameters: e.g.
    ``SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)``) applies it to the global
    weights. ``compress=False`` averages in float32 (exact). ``group``: a ProcessGroup, None
    (the default group) or a 2-D DeviceMesh (1-bit between nodes only; each node's ranks hold
    one replica, e.g. DDP over the node's group, or each its own). ``block``: block scales of
    that many elements (None: one scale per chunk). ``fragments``, ``fragment_order``,
    ``delay`` and ``mixing``: streaming (the fragments synced in turn every
    ``sync_every / fragments`` steps, each all-reduce started ``delay`` steps before it is
    applied, local weights merged as ``mixing * local + (1 - mixing) * global``).
    ``nonfinite``: "skip" (the fragment restarts from the global weights, counted in
    ``skipped_syncs``) or "raise" (FloatingPointError after the same reset).

    The 1-bit sync (docs/ALGORITHMS.md section 10): each replica compresses its pseudo-gradient
    plus ``g`` times the outer SGD's momentum term, and SGD is handed the mean minus the same
    term. ``momentum_share`` is ``g``: "auto" (the default) takes ``g = 1 - lr`` of the outer
    optimizer at each sync (clipped to [0, 1]; 0 where the outer optimizer has no momentum),
    0.0 is the plain form, 1.0 the momentum form. After each sync the error buffers are
    multiplied by ``1 - (1 - error_decay) * (1 - g)``: ``error_decay`` for the plain form, 1 for
    the momentum form. ``momentum_form`` (deprecated): True is ``momentum_share=1.0``, False
    ``0.0``. ``error_dtype``: the error buffers' dtype, bfloat16 (the default: half the bytes, stored
    with stochastic rounding, docs/ALGORITHMS.md 12; the decay then rounds to nearest, once per sync;
    measured against float32 errors in bench/RESULTS.md "DiLoCo") or float32.
    """

    def __init__(
        self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer, sync_every: int, group=None, compress: bool = True, *,
        block: int | None = 128, fragments: int = 1, fragment_order: str = "strided", delay: int = 0,
        mixing: float = 0.0, nonfinite: str = "skip", momentum_share: float | str = "auto",
        error_decay: float = 0.5, momentum_form: bool | None = None,
        error_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        check_instance("model", model, torch.nn.Module, "a torch.nn.Module")
        check_instance("inner_optimizer", inner_optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        check_instance("outer_optimizer", outer_optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        self.sync_every = check_int("sync_every", sync_every, low=1)
        self.fragments = check_int("fragments", fragments, low=1)
        if sync_every % fragments:
            raise ValueError(f"sync_every: expected a multiple of fragments ({fragments}), got {sync_every}")
        self.fragment_order = check_choice("fragment_order", fragment_order, ORDERS)
        self.delay = check_int("delay", delay, low=0, high=sync_every // fragments)
        self.mixing = check_number("mixing", mixing, 0.0, 1.0)
        self.nonfinite = check_choice("nonfinite", nonfinite, ("skip", "raise"))
        self.compress = check_instance("compress", compress, bool, "a bool")
        if momentum_form is not None:
            check_instance("momentum_form", momentum_form, bool, "a bool")
            momentum_share = 1.0 if momentum_form else 0.0
            warnings.warn(f"DiLoCo: momentum_form is deprecated and goes in 0.3.0; use "
                          f"momentum_share={momentum_share} (docs/ALGORITHMS.md 10)", FutureWarning,
                          stacklevel=2)
        if momentum_share != "auto":
            if isinstance(momentum_share, str):
                raise ValueError(f"momentum_share: expected 'auto' or a number in [0, 1], "
                                 f"got {momentum_share!r}")
            if not (check_number("momentum_share", momentum_share, 0.0) <= 1.0):
                raise ValueError(f"momentum_share: expected a number in [0, 1], got {momentum_share!r}")
        self.momentum_share = momentum_share
        self.error_decay = check_number("error_decay", error_decay, 0.0)
        if self.error_decay > 1.0:
            raise ValueError(f"error_decay: expected a number in [0, 1], got {error_decay!r}")
        self.block = check_block(block)
        self.error_dtype = check_error_dtype(error_dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model: expected parameters that require grad, found none")
        if len(self.params) < fragments:
            raise ValueError(f"fragments: expected at most the model's {len(self.params)} trainable tensors, "
                             f"got {fragments}")
        for name, opt in (("inner_optimizer", inner_optimizer), ("outer_optimizer", outer_optimizer)):
            theirs = {id(p) for g in opt.param_groups for p in g["params"]}
            if theirs != {id(p) for p in self.params}:
                raise ValueError(f"{name}: expected an optimizer over exactly the model's trainable "
                                 f"parameters ({len(self.params)} tensors), got one over {len(theirs)} "
                                 "tensors that differ")
        _momentum.check(outer_optimizer, "outer_optimizer")  # a momentum read as what it is, or refused
        self.inner, self.outer = inner_optimizer, outer_optimizer
        self.group = group
        self._mesh = group if is_mesh(group) else None
        self.hierarchy = None if self._mesh is None else hierarchy(self._mesh)
        self.process_group = flat_group(group)
        self.world_size = group_size(self.process_group)
        self.fragment_params = _split(self.params, fragments, fragment_order)
        with torch.no_grad():
            self.theta = [p.detach().clone() for p in self.params]  # the global weights
        self._numel = [sum(self.params[i].numel() for i in idx) for idx in self.fragment_params]
        device = self.params[0].device
        self._errors = [error_buffers(n, group, block=self.block, device=device, dtype=self.error_dtype)
                        if compress else None
                        for n in self._numel]
        self.inner_steps = 0
        self.syncs = 0  # fragment syncs applied
        self.skipped_syncs = 0  # fragment syncs skipped for a non-finite pseudo-gradient
        self._in_flight: _InFlight | None = None
        self._warned = False
        self._verified = False  # the global weights compared across replicas at the first step
        self.traffic = Traffic()

    # -- the training loop -------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; then start and apply the fragment syncs that fall on this step."""
        if not self._verified:  # every replica starts from the same weights, or they never meet
            verify_replicas([(f"parameter {i}", t) for i, t in enumerate(self.theta)], self.process_group)
            self._verified = True
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.inner_steps += 1
        t, per = self.inner_steps, self.sync_every // self.fragments
        if (t + self.delay) % per == 0:
            self._start(((t + self.delay) // per - 1) % self.fragments, t + self.delay)
        if t % per == 0:
            self._apply(t)
        return loss

    def _start(self, f: int, due: int) -> None:
        """Pseudo-gradient of fragment f into a float32 buffer, its all-reduce started."""
        if self._in_flight is not None:  # cannot happen: delay < sync_every / fragments
            raise RuntimeError("DiLoCo: a fragment's all-reduce is still in flight")
        buf = torch.empty(self._numel[f], dtype=torch.float32, device=self.params[0].device)
        off = 0
        with torch.no_grad():
            for i in self.fragment_params[f]:
                k = self.params[i].numel()
                theta, p = self.theta[i].reshape(-1), self.params[i].detach().reshape(-1)
                if theta.dtype == torch.float32 and p.dtype == torch.float32:
                    torch.sub(theta, p, out=buf[off:off + k])  # one pass (the copy and sub_ were two)
                else:  # the difference in float32, not in the parameters' dtype
                    buf[off:off + k].copy_(theta).sub_(p)
                off += k
        wait = self.delay > 0
        share = self._share(f) if self.compress else 0.0
        if self.compress:
            if share:
                self._add_momentum(f, buf, share)  # g times each replica's outer momentum (section 10)
            we, se = self._errors[f]
            with counting(self.traffic):
                handle = compressed_allreduce(buf, we, se, self.group, block=self.block, async_op=wait)
            self._count_compressed(we.numel(), buf.numel())
        else:
            with guard("DiLoCo float32 all-reduce", self.process_group):
                handle = dist.all_reduce(buf, group=self.process_group, async_op=wait) \
                    if self.world_size > 1 else None
            self.traffic.add_full(buf.numel(), self.world_size)
        self._in_flight = _InFlight(f, due, handle if wait else None, buf, share)
        if not wait and not self.compress and self.world_size > 1:
            buf.div_(self.world_size)

    def _finish(self) -> _InFlight:
        """Wait for the fragment in flight; its result is then the mean pseudo-gradient."""
        job = self._in_flight
        if job.handle is not None:
            if self.compress:
                job.handle.wait()  # raises CollectiveError on a failed peer
            else:
                with guard("DiLoCo float32 all-reduce", self.process_group):
                    job.handle.wait()
                job.result.div_(self.world_size)
            job.handle = None
        return job

    @torch.no_grad()
    def _apply(self, t: int) -> None:
        job = self._finish()
        if job.due != t:
            raise RuntimeError(f"DiLoCo: fragment {job.fragment} was due at inner step {job.due}, not {t}")
        self._in_flight = None
        f, mean = job.fragment, job.result
        idx = self.fragment_params[f]
        if self.compress and job.share:
            self._add_momentum(f, mean, -job.share)  # the pseudo-gradient that rebuilds the averaged momentum
        if not bool(torch.isfinite(mean).all()):  # the same on every replica (section 1.1)
            for i in idx:
                self.params[i].copy_(self.theta[i])
            self.skipped_syncs += 1
            message = (f"DiLoCo: the pseudo-gradient of fragment {f} at inner step {t} is not finite on some "
                       f"replica; the outer step was skipped and every replica restarts that fragment from "
                       f"the global weights ({self.skipped_syncs} skipped so far)")
            if self.nonfinite == "raise":
                raise FloatingPointError(message)
            if not self._warned:
                self._warned = True
                warn_collective(message, RuntimeWarning, self.process_group)
            return
        grads = [p.grad for p in self.params]
        local = [self.params[i].detach().clone() for i in idx] if self.mixing > 0 else None
        for p in self.params:
            p.grad = None
        off = 0
        for i in idx:
            p = self.params[i]
            k = p.numel()
            p.copy_(self.theta[i])
            p.grad = mean[off:off + k].view_as(p).to(p.dtype)
            off += k
        self.outer.step()  # only fragment f's tensors have a gradient
        for n, i in enumerate(idx):
            p = self.params[i]
            self.theta[i].copy_(p)
            if local is not None:
                p.lerp_(local[n], self.mixing)
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        decay = 1.0 - (1.0 - self.error_decay) * (1.0 - job.share)
        if self.compress and decay != 1.0:  # what this sync left over, decayed (section 10)
            for buf in self._errors[f]:
                buf.mul_(decay)
        self.syncs += 1

    def _share(self, f: int) -> float:
        """The momentum share g of fragment f's sync: the fixed ``momentum_share``, or "auto":
        ``1 - lr`` of the outer optimizer's groups (clipped to [0, 1]; 0 for a group without
        momentum), averaged over the fragment's elements (section 10)."""
        if self.momentum_share != "auto":
            return float(self.momentum_share)
        groups = {id(p): g for g in self.outer.param_groups for p in g["params"]}
        total = weighted = 0.0
        for i in self.fragment_params[f]:
            p = self.params[i]
            group = groups[id(p)]
            g = min(1.0, max(0.0, 1.0 - float(group["lr"]))) if group.get("momentum", 0.0) else 0.0
            weighted += g * p.numel()
            total += p.numel()
        return weighted / total

    @torch.no_grad()
    def _add_momentum(self, f: int, buf: torch.Tensor, scale: float) -> None:
        """``buf += scale * c`` over fragment f, ``c = s * momentum / (1 - dampening) *
        momentum_buffer`` of an SGD-type outer optimizer (a Muon: its lerp's, collectives/_momentum.py;
        0 where the buffer does not exist yet, and for optimizers without a momentum): the replicas
        compress ``Delta + g c`` and SGD is handed ``D - g c``, which keeps its momentum the average of
        the replicas' (ALGORITHMS.md 8.1, 10)."""
        groups = {id(p): g for g in self.outer.param_groups for p in g["params"]}
        off = 0
        for i in self.fragment_params[f]:
            p = self.params[i]
            k = p.numel()
            group, m = groups[id(p)], self.outer.state.get(p, {}).get("momentum_buffer")
            if m is not None and group.get("momentum", 0.0):
                factor = _momentum.factor(self.outer, group, "outer_optimizer")
                buf[off:off + k].add_(m.reshape(-1), alpha=scale * factor)
            off += k

    def _count_compressed(self, N: int, n: int) -> None:
        h = self.hierarchy
        if h is None:
            self.traffic.add_compressed(N, self.world_size, self.block)
            return
        if h.nodes > 1:
            self.traffic.add_compressed(N, h.nodes, self.block)
        self.traffic.intra += intra_bytes(shard_numel(n, h.per_node), h)

    # -- reporting ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Inner steps, syncs, skipped syncs and the bytes this rank sent (see Traffic)."""
        t = self.traffic.state()
        return {"inner_steps": self.inner_steps, "syncs": self.syncs, "skipped_syncs": self.skipped_syncs,
                "bytes_compressed": t["compressed"], "bytes_full": t["full"], "bytes_intra": t["intra"],
                "bytes_sent": t["compressed"] + t["full"],
                "bytes_per_inner_step": (t["compressed"] + t["full"]) / max(self.inner_steps, 1)}

    # -- checkpoints ----------------------------------------------------------------------------

    def _config(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": self.fragments,
                "fragment_order": self.fragment_order,
                "delay": self.delay, "compress": self.compress, "block": self.block,
                "momentum_share": self.momentum_share, "error_decay": self.error_decay,
                "world_size": self.world_size, "numel": list(self._numel),
                "mesh": None if self.hierarchy is None else [self.hierarchy.nodes, self.hierarchy.per_node]}

    def __deepcopy__(self, memo: dict):
        """A copy that goes on bitwise as the original (issue 58): every attribute copied, the process
        group, the mesh and its groups shared. Copied in one call with the model and both optimizers
        (``copy.deepcopy((model, inner, outer, diloco))``) it works on the copied parameters and
        optimizers; copied alone, on copies of its own (then of no model). A fragment's all-reduce in
        flight is waited for first (as ``state_dict`` does: its mean, applied at its due step, is
        the same)."""
        if self._in_flight is not None:
            self._finish()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for handle in _handles(self.__dict__):
            memo[id(handle)] = handle
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def state_dict(self) -> dict:
        """Everything but the model's weights: the global weights, both optimizers, the error
        buffers, the counters and a fragment in flight (waited for: its mean is saved)."""
        pending = None
        if self._in_flight is not None:
            job = self._finish()
            pending = {"fragment": job.fragment, "due": job.due, "mean": job.result.clone(),
                       "share": job.share}
        return {
            "config": self._config(), "inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
            "theta": [t.clone() for t in self.theta],
            "errors": None if not self.compress else [(we.clone(), se.clone()) for we, se in self._errors],
            "counters": {"inner_steps": self.inner_steps, "syncs": self.syncs,
                         "skipped_syncs": self.skipped_syncs},
            "pending": pending, "traffic": self.traffic.state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (load the model's weights as well)."""
        mine = self._config()
        theirs = state.get("config") if isinstance(state, dict) else None
        if isinstance(theirs, dict) and "momentum_form" in theirs:  # saved before momentum_share
            theirs = dict(theirs)
            form = theirs.pop("momentum_form")
            if not form or theirs.get("error_decay") == 1.0:  # the forms momentum_share keeps exactly
                theirs["momentum_share"] = 1.0 if form else 0.0
        if theirs != mine:
            key = next((k for k in mine if theirs is None or theirs.get(k) != mine[k]), "config")
            got = None if theirs is None else theirs.get(key)
            raise ValueError(f"state: saved with {key}={got!r}, this DiLoCo has {key}={mine[key]!r}")
        if self._in_flight is not None:
            self._finish()
            self._in_flight = None
        for t, saved in zip(self.theta, state["theta"], strict=True):
            t.copy_(saved)
        if self.compress:
            for (we, se), (swe, sse) in zip(self._errors, state["errors"], strict=True):
                we.copy_(swe)
                se.copy_(sse)
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        for name, value in state["counters"].items():
            setattr(self, name, value)
        pending = state["pending"]
        if pending is not None:
            self._in_flight = _InFlight(pending["fragment"], pending["due"], None,
                                        pending["mean"].to(self.params[0].device).clone(),
                                        pending.get("share", 0.0))
        self.traffic = Traffic(**state["traffic"])
        self._verified = False

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, compress={self.compress}, block={self.block}, "
                f"momentum_share={self.momentum_share!r}, error_decay={self.error_decay}, "
                f"fragments={self.fragments}, delay={self.delay}, mixing={self.mixing}, "
                f"world_size={self.world_size})")
