"""1-bit Adam's recipe for a torch Adam-type optimizer behind the DDP hook (docs/ALGORITHMS.md 8.2).

``OnebitCompressHookState(optimizer=adamw, freeze_step=F)``: F iterations of full-precision
averaging (plain DDP), then the variance freezes and each rank compresses its own momentum in
the frozen preconditioned space:

    d   = max(sqrt(v_F), f) / sqrt(1 - b2^F) + eps       frozen at the end of iteration F
    A   = compressed_allreduce((b1 * m + (1 - b1) * g_r) / d)
    g~  = (d * A - b1 * m) / (1 - b1)                    what DDP hands the optimizer

so that the optimizer's own ``m <- b1 m + (1 - b1) g~`` gives ``m = d * A``: the compressed
average of the ranks' momenta. torch's Adam and AdamW: the step pre-hook makes that update itself
(``FrozenAdam._own_step``) and hides the gradient from torch's step. Other Adam-type optimizers:
the state is set so that their step computes exactly that momentum and the frozen denominator
(``exp_avg <- m_new / b1``, ``exp_avg_sq <- ((d - eps) * sqrt(1 - b2^t))^2 / b2`` and a zero
gradient for this one call, all restored by the post-hook), because the optimizer would otherwise
square the 1-bit noise of ``g~`` into its variance. A clip between backward and step scales
``g~``, that is each rank's gradient contribution, as it would scale the gradient.

``d`` is not kept: the optimizer's ``exp_avg_sq`` stays as it was at the freeze (``v_F``), and ``d``
is computed from it wherever it is read (the frozen scalars ``floor``, ``r = 1 / sqrt(1 - b2^F)``
and ``eps`` per parameter; docs/ALGORITHMS.md 6.2), bitwise the ``d`` the freeze computed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..kernels import backends, cpu_fused, cpu_simd
from ..kernels._checks import check_number
from ..kernels.preconditioning import inverse_sqrt_bc2, sqrt_rn, sqrt_v_floors, stale_denominator
from ..kernels.sketch import signed
from . import _hook_fused, _momentum, _several
from ._clip_sketch import ClipSketch
from ._fsdp_replicas import to_local


def is_adam_type(optimizer: torch.optim.Optimizer) -> bool:
    """Adam-type: every group has ``betas``; SGD-type groups have ``momentum``."""
    return bool(optimizer.param_groups) and all("betas" in g for g in optimizer.param_groups)


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    for i, g in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize"):
            if g.get(key, False):
                raise ValueError(f"optimizer: param_groups[{i}] has {key}=True, which freeze_step does not "
                                 "support (the frozen variance replaces exp_avg_sq; maximize flips the "
                                 "gradient the momentum is rebuilt from)")


def step_counts(steps: list) -> list[float]:
    """An optimizer state's ``step`` entries as floats: numbers as they are, tensors read together, one
    host read per device and dtype (torch's fused and capturable Adam-types keep them on the
    parameters' device, where reading each would be a host synchronisation per parameter)."""
    out: list[float] = [0.0] * len(steps)
    together: dict[tuple, list[int]] = {}
    for i, s in enumerate(steps):
        if isinstance(s, torch.Tensor):
            together.setdefault((s.device, s.dtype), []).append(i)
        else:
            out[i] = float(s)
    for idx in together.values():
        values = torch.stack([steps[i].detach().reshape(()) for i in idx]).tolist()
        for i, value in zip(idx, values, strict=True):
            out[i] = float(value)
    return out


def counts_on_device(steps: list, forced: bool | None = None) -> bool:
    """Whether the step counts are used where they live, as device tensors, with no host read (issue 57):
    where any is a tensor off the CPU (torch's fused and capturable Adam-types on a GPU keep them there).
    ``forced``: True or False decides (the tests force True on a CPU)."""
    if forced is not None:
        return forced and any(isinstance(s, torch.Tensor) for s in steps)
    return any(isinstance(s, torch.Tensor) and s.device.type != "cpu" for s in steps)


def device_counts(steps: list, device: torch.device) -> list[torch.Tensor]:
    """The step counts as 0-dim float32 tensors on ``device`` (a tensor's own value, a number copied
    there), with no host read."""
    return [s.detach().reshape(()).to(device=device, dtype=torch.float32) if isinstance(s, torch.Tensor)
            else torch.tensor(float(s), dtype=torch.float32, device=device) for s in steps]


def device_bc2(b2: float, steps: torch.Tensor) -> torch.Tensor:
    """``1 - b2^steps`` (1 where ``steps`` is 0) from a 0-dim device count, in float64 on the device as
    the host computes it in Python floats (no host read)."""
    t = steps.to(torch.float64)
    return torch.where(t > 0, 1.0 - torch.pow(b2, t), 1.0)


class FrozenAdam:
    """The frozen denominators (by the hook's parameter names) and the step hooks."""

    def __init__(self, freeze_step: int, variance_floor: float) -> None:
        self.freeze_step = freeze_step
        self.variance_floor = variance_floor
        # name -> (floor, bc2, eps): d = stale_denominator(v_F, floor, eps, bc2) from the optimizer's
        # exp_avg_sq, which stays v_F after the freeze
        self.scalars: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._floors: dict[tuple[int, int], torch.Tensor] = {}  # the floors as 0-dim tensors, by device
        # name -> d, loaded from a checkpoint of a release that kept d (its exp_avg_sq is no longer v_F)
        self.legacy: dict[tuple[int, int], torch.Tensor] = {}
        self._frozen = False
        self.pending = False  # this iteration's buckets were compressed in the frozen space
        self.local_sq: torch.Tensor | None = None  # this rank's squared gradient norm, this iteration
        self._handles: list[Any] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, grad) hidden from torch's step
        # the step counts used on their device, not read (None: where they live off the CPU; counts_on_device)
        self.device_counts: bool | None = None

    @property
    def frozen(self) -> bool:
        return self._frozen

    def denominator(self, opt: torch.optim.Optimizer, p: torch.Tensor, name) -> torch.Tensor | None:
        """Parameter ``p``'s frozen denominator (float32, its local shape; a new tensor, or the loaded
        one of an old checkpoint); None where it has none."""
        if name in self.legacy:
            return self.legacy[name]
        entry = opt.state.get(p)
        if name not in self.scalars or not entry or "exp_avg_sq" not in entry:
            return None
        return self._denominator(to_local(entry["exp_avg_sq"]).detach(), name)

    def _denominator(self, v: torch.Tensor, name) -> torch.Tensor:
        """``stale_denominator`` of ``v`` with ``name``'s frozen scalars: the freeze's own call."""
        floor, bc2, eps = self.scalars[name]
        t = self._floors.get(name)
        if t is None or t.device != v.device:  # kept on the variance's device: no copy per step
            t = self._floors[name] = torch.tensor(floor, dtype=torch.float32, device=v.device)
        return stale_denominator(v.float(), t, eps, bc2)

    def _c_scalars(self, name) -> tuple[float, float, float]:
        """``(floor, r, eps)`` for the C passes (d = max(sqrt(v), floor) * r + eps)."""
        floor, bc2, eps = self.scalars[name]
        return floor, inverse_sqrt_bc2(bc2), eps

    # -- the optimizer's step hooks ------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, names) -> None:
        """Hook ``optimizer.step``; ``names()`` maps id(parameter) to the hook's names."""
        self.detach()
        check_supported(optimizer)
        self._handles = [optimizer.register_step_pre_hook(lambda opt, a, k: self._before(opt, names())),
                         optimizer.register_step_post_hook(lambda opt, a, k: self._after(opt, names()))]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before(self, opt: torch.optim.Optimizer, names: dict[int, tuple[int, int]]) -> None:
        # without a closure the gradients exist now; with one (Lightning) backward has not run
        # yet and prepare() is called after it, before the update (this rank's norm is stale)
        if self.pending:
            self.prepare(opt, names)
        self.local_sq = None

    def prepare(self, opt: torch.optim.Optimizer, names: dict[int, tuple[int, int]]) -> None:
        """Set the optimizer's state for the update on this iteration's (clipped) gradients; for
        torch's own Adam and AdamW, make the update here instead (:meth:`_own_step`)."""
        if not self.pending:
            return
        self.pending = False
        self._saved = []
        own = backends.route("own_step") and type(opt) in (torch.optim.Adam, torch.optim.AdamW)
        rows = []
        for group in opt.param_groups:
            for p in group["params"]:
                name = names.get(id(p), (-1, -1))
                entry = opt.state.get(p)
                if (name not in self.scalars and name not in self.legacy) or p.grad is None or not entry \
                        or "exp_avg" not in entry:
                    continue
                rows.append((group, p, name, entry))
        steps = [entry["step"] for *_, entry in rows]
        if rows and counts_on_device(steps, self.device_counts):
            # a fused or capturable AdamW's counts on a GPU: used there, as torch's capturable step does
            # (t + 1 in one multi-tensor add; the bias corrections made on the device), no host read
            ts: list = torch._foreach_add(device_counts(steps, to_local(rows[0][1]).device), 1.0)
        else:
            # every step count read at once (one host read in all, not one per parameter)
            ts = [count + 1.0 for count in step_counts(steps)]  # torch counts the step before its corrections
        batch = OwnSteps()  # what the C does not take, made at the end (multi-tensor)
        for (group, p, name, entry), t in zip(rows, ts, strict=True):
            b1, b2 = group["betas"]
            eps = group["eps"]
            if own and self._own_step(p, entry, group, name, t, batch):
                continue
            d = self.denominator(opt, p, name)
            if d is None:
                continue
            m, grad = to_local(entry["exp_avg"]), to_local(p.grad)  # DTensors (FSDP2): their slices
            m.mul_(b1).add_(grad, alpha=1.0 - b1).div_(b1)  # the optimizer's b1 * m gives m_new
            root = (1.0 - torch.pow(b2, t.to(torch.float64))).sqrt().to(torch.float32) \
                if isinstance(t, torch.Tensor) else math.sqrt(1.0 - b2**t)
            target = (d - eps).mul_(root).square_().div_(b2)
            v = to_local(entry["exp_avg_sq"])
            self._saved.append((v, v.clone()))  # v_F, put back after the step
            v.copy_(target)  # the optimizer's b2 * v gives the frozen one
            self._saved.append((grad, grad.clone()))
            grad.zero_()
        batch.run()

    def _own_step(self, p: torch.Tensor, entry: dict, group: dict, name, t: float | torch.Tensor,
                  batch: OwnSteps) -> bool:
        """torch's Adam/AdamW update of ``p`` on the frozen denominator, done here: the momentum
        takes this iteration's gradient, ``p -= lr * m / (bc1 * d)`` (after AdamW's decay; Adam's
        L2 term joins the gradient), ``d`` computed from ``exp_avg_sq`` (``v_F``, left as it is) and
        the step count advances; then the gradient is hidden from torch's step (set to None,
        restored by the post-hook), which skips the parameter. One pass over p, g, m and v
        instead of preparing the state, torch's step and the restore (bench/TRAFFIC.md section 4,
        item 1). The same maths as :meth:`prepare`'s route, to rounding (that route's denominator
        is ``d`` after a square and a root). Where the C pass does not take it (a GPU, a small tensor,
        an old checkpoint's denominator) the update joins ``batch``, which :func:`own_steps` makes for
        the whole group in multi-tensor ops (:class:`OwnSteps`), and the step counts advance there, all
        at once. ``t``: the count after this step, a number or (counts kept on a device) a 0-dim tensor there,
        whose ``lr / bc1`` the batch makes on the device. False: not done (options this does not model: the
        caller takes the preparing route)."""
        if any(group.get(k) for k in ("maximize", "amsgrad", "capturable", "differentiable")):
            return False
        b1 = group["betas"][0]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        on_device = isinstance(t, torch.Tensor)
        decoupled = group.get("decoupled_weight_decay", False)
        pl, grad = to_local(p).detach(), to_local(p.grad)
        m, v = to_local(entry["exp_avg"]), to_local(entry["exp_avg_sq"])
        legacy, done = self.legacy.get(name), False
        if legacy is None and pl.device.type == "cpu" and not on_device:  # the C pass (a large CPU tensor)
            g = grad.add(pl, alpha=wd) if wd and not decoupled else grad
            decay = 1.0 - lr * wd if wd and decoupled else 1.0
            done = cpu_fused.frozen_adam_(pl, m, g, v, beta1=b1, decay=decay, step=lr / (1.0 - b1**t),
                                          denominator=self._c_scalars(name))
        if not done:
            size = t if on_device else lr / (1.0 - b1**t)
            batch.add(group, (pl, m, grad, v, legacy, self.scalars.get(name), size))
        batch.steps.append(entry)
        self._hidden.append((p, p.grad))
        p.grad = None
        return True

    def _after(self, opt: torch.optim.Optimizer, names) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = []
        for grad, saved in self._saved:
            grad.copy_(saved)
        self._saved = []
        if self.pending:  # the gradients came from a closure inside step() and nobody prepared
            self.pending = False
            raise RuntimeError(
                "optimizer.step(closure): onebit_compress_hook with freeze_step compressed this step's "
                "gradients inside the closure, after the step's pre-hook, so the optimizer stepped with "
                "its own variance; call state.prepare_step() at the end of the closure (after backward "
                "and any clip). onebit.integrations.lightning.OnebitCallback does it for Lightning")

    # -- freezing --------------------------------------------------------------------------
    def freeze(self, opt: torch.optim.Optimizer, names: dict[int, tuple[int, int]]) -> None:
        """Take each parameter's frozen scalars from the optimizer's state now (after step F); its
        ``exp_avg_sq`` is v_F from now on."""
        self._frozen = True
        for group in opt.param_groups:
            params = [p for p in group["params"] if opt.state.get(p) and "exp_avg_sq" in opt.state[p]
                      and id(p) in names]
            if not params:
                continue
            vs = [to_local(opt.state[p]["exp_avg_sq"]).detach().float() for p in params]
            floors = sqrt_v_floors(vs, self.variance_floor)
            for p, floor in zip(params, floors, strict=True):
                steps = float(opt.state[p]["step"])
                bc2 = 1.0 - group["betas"][1] ** steps if steps else 1.0
                self.scalars[names[id(p)]] = (float(floor), bc2, float(group["eps"]))
                self._floors[names[id(p)]] = floor

    def add_local(self, buffer: torch.Tensor, sq: float | torch.Tensor | None = None) -> None:
        """Count a bucket of this rank's own gradient into this iteration's squared norm (``sq``:
        its sum of squares, already counted by the caller's pass)."""
        b = buffer.detach()
        cpu = b.dtype == torch.float32 and b.device.type == "cpu" and b.is_contiguous()
        if isinstance(sq, torch.Tensor):  # on the bucket's device (the GPU pre-pass: no host sync)
            sq = sq.to(torch.float64)
        elif sq is not None:
            sq = torch.tensor(sq, dtype=torch.float64)
        elif cpu and backends.select("cpu", "hook").name == "native":
            sq = torch.tensor(cpu_simd.sumsq(b), dtype=torch.float64)  # one read, no float64 copy
        else:  # (on CPU this makes a float64 copy of the bucket)
            sq = torch.linalg.vector_norm(b, dtype=torch.float64).square()
        self.local_sq = sq if self.local_sq is None else self.local_sq + sq

    def terms(self, opt: torch.optim.Optimizer, p: torch.Tensor, name, group: dict):
        """``(source, m, b1 / (1 - b1))`` of one parameter in a compressed iteration: where its frozen
        denominator comes from (:meth:`source`), ``exp_avg`` and the factor of ``c``; None where the
        parameter has neither."""
        entry = opt.state.get(p)
        if not entry or "exp_avg" not in entry:
            return None
        src = self.source(opt, p, name)
        if src is None:
            return None
        b1 = group["betas"][0]
        return src, to_local(entry["exp_avg"]).detach(), b1 / (1.0 - b1)

    def source(self, opt: torch.optim.Optimizer, p: torch.Tensor, name):
        """Where ``p``'s frozen denominator comes from, not made: ``("v", v, (floor, r, eps), name)`` (its
        ``exp_avg_sq``, v_F: ``d = max(sqrt(v), floor) * r + eps``) or ``("d", d)`` (an old
        checkpoint's); None where it has none. :meth:`made` makes it."""
        if name in self.legacy:
            return ("d", self.legacy[name])
        entry = opt.state.get(p)
        if name not in self.scalars or not entry or "exp_avg_sq" not in entry:
            return None
        return ("v", to_local(entry["exp_avg_sq"]).detach(), self._c_scalars(name), name)

    def made(self, src) -> torch.Tensor:
        """The denominator of a :meth:`source` (float32; a new tensor, or the loaded one)."""
        return src[1] if src[0] == "d" else self._denominator(src[1], src[3])

    # -- checkpoint ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The frozen scalars (the denominators are the optimizer's ``exp_avg_sq``, in its own state);
        loaded denominators of an old checkpoint as they came."""
        return {"freeze_step": self.freeze_step, "frozen": self._frozen,
                "names": [list(n) for n in self.scalars], "scalars": [list(s) for s in self.scalars.values()],
                "legacy_names": [list(n) for n in self.legacy],
                "denominators": [d.clone() for d in self.legacy.values()]}

    def load(self, state: dict[str, Any]) -> None:
        self._floors = {}
        if "scalars" in state:
            self.scalars = {tuple(n): tuple(s) for n, s in zip(state["names"], state["scalars"], strict=True)}
            names = state.get("legacy_names", [])
            self._frozen = bool(state.get("frozen", self.scalars))
        else:  # a release that kept d: its exp_avg_sq was rewritten each step, so d is kept as it came
            self.scalars, names = {}, state["names"]
            self._frozen = bool(names)
        self.legacy = {tuple(n): d for n, d in zip(names, state["denominators"], strict=True)}


class OwnSteps:
    """The own steps of one optimizer step (:meth:`FrozenAdam._own_step`) that the C pass does not make,
    per group, and the step counts to advance: made at the end in multi-tensor ops (:func:`own_steps`;
    the counts kept on a device, a fused AdamW's, in one ``_foreach_add_``)."""

    def __init__(self) -> None:
        self.groups: dict[int, tuple[dict, list]] = {}
        self.steps: list[dict] = []

    def add(self, group: dict, item: tuple) -> None:
        self.groups.setdefault(id(group), (group, []))[1].append(item)

    def run(self) -> None:
        for group, items in self.groups.values():
            own_steps(items, group)
        counts = [e["step"] for e in self.steps if isinstance(e["step"], torch.Tensor)]
        if counts:
            torch._foreach_add_(counts, 1.0)
        for e in self.steps:
            if not isinstance(e["step"], torch.Tensor):
                e["step"] += 1


def own_steps(items: list[tuple], group: dict) -> None:
    """:meth:`FrozenAdam._own_step`'s update for several parameters of ``group`` in multi-tensor ops (on a
    GPU one launch per operation for them all, not 7-8 per parameter: issue 57): each item ``(p, m, grad,
    v, d, (floor, bc2, eps), lr / bc1)``, ``d`` an old checkpoint's denominator or None (made from ``v``:
    ``max(sqrt(v), floor) * r + eps``, each operation rounded, as ``stale_denominator``). Each element
    takes the per-parameter route's operations in its order: ``m = b1 m + (1 - b1) g`` (``g = grad + wd p``
    for Adam's L2 term), ``p = p * (1 - lr wd)`` (AdamW), ``p = p + (-lr / bc1) m / d``. With the step
    counts on the device the last item is the count ``t`` (0-dim tensors there): ``-lr / bc1`` is made
    there as torch's capturable Adam makes it (``1 / ((b1^t - 1) / lr)``) and ``p = p + m / (d / (-lr /
    bc1))`` (the same to rounding; no host read)."""
    b1, lr, wd = group["betas"][0], float(group["lr"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", False)
    ps, ms, grads, vs = ([it[k] for it in items] for k in range(4))
    gs = torch._foreach_add(grads, ps, alpha=wd) if wd and not decoupled else grads
    ds = [it[4] for it in items]
    fresh = [k for k, d in enumerate(ds) if d is None]
    if fresh:
        roots = [vs[k].float() for k in fresh]
        # a CPU's float32 sqrt is not correctly rounded (preconditioning.sqrt_rn); a GPU's is
        roots = [sqrt_rn(x) for x in roots] if roots[0].device.type == "cpu" else torch._foreach_sqrt(roots)
        torch._foreach_maximum_(roots, [items[k][5][0] for k in fresh])
        torch._foreach_mul_(roots, [inverse_sqrt_bc2(items[k][5][1]) for k in fresh])  # exactly 1.0: bc2 1
        torch._foreach_add_(roots, [items[k][5][2] for k in fresh])
        for k, d in zip(fresh, roots, strict=True):
            ds[k] = d
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, gs, alpha=1.0 - b1)
    if wd and decoupled:
        torch._foreach_mul_(ps, 1.0 - lr * wd)
    last = [it[6] for it in items]
    if isinstance(last[0], torch.Tensor):  # the step counts on the device
        size = torch._foreach_pow(b1, last)
        torch._foreach_sub_(size, 1.0)
        torch._foreach_div_(size, lr)
        torch._foreach_reciprocal_(size)  # -lr / bc1
        torch._foreach_addcdiv_(ps, ms, torch._foreach_div(ds, size))  # (ds kept: an old d may be one)
    else:
        torch._foreach_addcdiv_(ps, ms, ds, [-s for s in last])


class Denominators:
    """A bucket's frozen denominators (section 8.2), not made: per parameter span ``[lo, hi)`` its
    :meth:`FrozenAdam.source` (or None: ``d = 1``), 1 elsewhere. The fused passes (C and Triton) make
    ``d`` from each span's variance as they read it (:func:`onebit.kernels.fused.hook.table`); the
    plain routes take :meth:`flat`, the bucket's float32 denominators, made on their first call and freed
    with this."""

    def __init__(self, fa: FrozenAdam, numel: int, device, spans: list) -> None:
        self.fa, self.spans = fa, spans  # (lo, hi, source)
        self._by_lo = {lo: src for lo, _, src in spans}
        self._numel, self.device = numel, torch.device(device)
        self._flat: torch.Tensor | None = None

    def numel(self) -> int:
        return self._numel

    def source(self, lo: int):
        """The source of the span that starts at ``lo`` (None: ``d = 1``)."""
        return self._by_lo.get(lo)

    def flat(self) -> torch.Tensor | None:
        """The bucket's float32 denominators; None where every span's is 1 (momenta alone)."""
        if all(src is None for _, _, src in self.spans):
            return None
        if self._flat is None:
            d = torch.ones(self._numel, dtype=torch.float32, device=self.device)
            for lo, hi, src in self.spans:
                if src is not None:
                    d[lo:hi].copy_(self.fa.made(src).reshape(-1))
            self._flat = d
        return self._flat


def flat_denominators(d) -> torch.Tensor | None:
    """``d`` as the bucket's flat float32 denominators (a :class:`Denominators` made, a tensor as it is;
    None where every one is 1)."""
    return d.flat() if isinstance(d, Denominators) else d


def frozen_terms(opt: torch.optim.Optimizer, fa: FrozenAdam | None, bucket, layout, share="auto"):
    """``(d, parts)`` of section 8.2: the bucket's frozen denominators (a :class:`Denominators`: not
    made; 1 where a parameter has none) and, per parameter that has them, ``(lo, hi, exp_avg, b1 /
    (1 - b1))`` (its place in the bucket, the momentum and the factor of ``c``); None, None if none
    has them. Beside the Adam-type optimizer (``opt`` several: Muon and its AdamW), a parameter of an
    SGD or a Muon takes its momentum's part with ``d = 1`` (sections 8.1, 8.3: ``(lo, hi,
    momentum_buffer, its factor)``). ``fa`` None (no ``freeze_step``): the momenta's parts alone."""
    groups = {id(p): group for group in opt.param_groups for p in group["params"]}
    grads = bucket.gradients()
    found = []
    for i, (p, name) in enumerate(zip(bucket.parameters(), layout, strict=True)):
        group = groups.get(id(p))
        if group is None:
            continue
        if "betas" in group:
            terms = None if fa is None else fa.terms(opt, p, name, group)
        else:
            terms = momentum_terms(opt, p, group, share)
        if terms is not None and terms[1].shape == grads[i].shape:
            found.append((i, *terms))
    if not found:
        return None, None
    buffer = bucket.buffer()
    offsets = [0]
    for g in grads:
        offsets.append(offsets[-1] + g.numel())
    spans = [(offsets[i], offsets[i + 1], src) for i, src, _, _ in found]
    d = Denominators(fa, buffer.numel(), buffer.device, spans)
    return d, [(offsets[i], offsets[i + 1], mi, factor) for i, _, mi, factor in found]


def momentum_terms(opt, p: torch.Tensor, group: dict, share="auto"):
    """``(None, momentum_buffer, factor)`` of an SGD's or a Muon's parameter (no denominator: 1; the
    factor times the hook's ``momentum_share``), None where its optimizer made no buffer yet, the group
    has no momentum or the share is 0."""
    entry = opt.state.get(p)
    buf = None if not entry else entry.get("momentum_buffer")
    if buf is None:
        return None
    owner = _several.owner(opt, group)
    factor = _momentum.factor(owner, group) * _momentum.share_of(owner, share)
    return None if factor == 0.0 else (None, to_local(buf).detach(), factor)


def frozen_pre_(buffer: torch.Tensor, d, parts: list, fa: FrozenAdam | None = None,
                tables: dict | None = None):
    """The hook's pass before the collective, ``buffer <- (g + c) / d`` with ``c = factor * m``
    (section 8.2), in place; returns ``post(out)``, the pass after it, ``out <- out * d - c``.
    With ``fa``, the bucket also counts into ``fa``'s local gradient norm. ``tables``: where the fused
    passes keep their tables between calls (the hook state's; None: made for this call).

    Where a backend has the passes fused (:func:`onebit.collectives._hook_fused.backend`: the native C on
    CPU, Triton on a GPU), one pass each way over the whole bucket, ``d`` made as it is read, the norm
    inside the pre-pass (the same float32 operations, bitwise); else the plain ops, ``c`` kept for the
    post-pass in one bucket-sized buffer and ``d`` made flat (no division where every ``d`` is 1)."""
    name = _hook_fused.backend(buffer, d, parts)
    if name is not None:
        return _hook_fused.pre_(buffer, d, parts, fa, name, tables)
    d = flat_denominators(d)
    if fa is not None:
        fa.add_local(buffer)
    c = torch.zeros_like(buffer)
    for lo, hi, m, factor in parts:  # written in place: no per-parameter temporaries
        torch.mul(m, factor, out=c[lo:hi].view_as(m))
    buffer.add_(c)
    if d is not None:
        buffer.div_(d)

    def post(out: torch.Tensor) -> torch.Tensor:
        return (out if d is None else out.mul_(d)).sub_(c)

    return post


def clip_agreed(opt: torch.optim.Optimizer | None, fa: FrozenAdam | None, max_norm: float, norm_type: float,
                group, replicas: int, who: str, sent=None, sketch: ClipSketch | None = None) -> torch.Tensor:
    """The hooks' ``clip_grad_norm_`` (DDP's and FSDP's) by the norm of the ranks' mean gradient, what plain
    DDP clips by, the same on every rank. Where the hook handed gradients over compressed this iteration
    (their 1-bit noise in them), an estimate (docs/ALGORITHMS.md 8.2): the hook count-sketched each rank's
    own gradients of those parameters (``sketch``; linear, so the sum over ``group``, one all-reduce of
    ``sketch.size`` floats, is ``replicas`` times the mean's sketch); the parameters averaged in full
    precision count exactly. Where nothing was sketched: torch's clip of the gradients as they are (full
    precision), or, in ``freeze_step``'s compressed iterations, the root mean square over ``replicas`` of
    their own gradient norms (``fa.local_sq``; at least the mean's norm), which a first call past the
    freeze takes (the hook sketches from the next iteration on). ``who`` names the caller in the error
    without an optimizer; ``sent(numel, element_size)`` counts an all-reduce made here."""
    max_norm = check_number("max_norm", max_norm, low=0.0)
    if norm_type != 2.0:
        raise ValueError(f"norm_type: only 2.0 is supported, got {norm_type!r}")
    if opt is None:
        raise RuntimeError(f"clip_grad_norm_: {who} no optimizer=")
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if sketch is not None:
        sketch.start(sum(p.numel() for g in opt.param_groups for p in g["params"]))
    group = group if group is not None else dist.group.WORLD
    summed = None if sketch is None or replicas == 1 else sketch.sums()
    if summed is not None:
        sums = signed(summed)
        dist.all_reduce(sums, group=group)
        sq = sums.double().square().sum() / replicas**2
        exact = [p.grad for p in params if id(p) not in sketch.covered]  # averaged in full precision
        if exact:  # (a sharded one whole: its slices are on other ranks)
            sq = sq + torch.stack([torch.linalg.vector_norm(_whole(g), dtype=torch.float64).square()
                                   for g in exact]).sum().to(sq.device)
        norm = sq.sqrt()
    elif fa is not None and fa.pending and fa.local_sq is not None:
        sums = fa.local_sq.reshape(1).clone()
        if replicas > 1:
            dist.all_reduce(sums, group=group)
        norm = (sums[0] / replicas).sqrt()
    else:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if sent is not None and replicas > 1:
        sent(sums.numel(), sums.element_size())
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def _whole(g: torch.Tensor) -> torch.Tensor:
    """``g`` itself, or a DTensor's full tensor (gathered)."""
    full = getattr(g, "full_tensor", None)
    return g if full is None else full()
