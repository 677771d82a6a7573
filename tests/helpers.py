"""Shared test helpers: comparisons, the in-process simulation of W ranks, and the
parameters, gradients and rank bodies of the optimizer tests."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import torch
import torch.distributed as dist

from onebit.collectives import local_compressed_allreduce
from onebit.kernels.backends import use_backend
from onebit.kernels.preconditioning import inverse_sqrt_bc2, stale_denominator
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

# the optimizers' fused steps (onebit.kernels.backends.STEPS)
FUSED_STEPS = ("adam", "zoa", "local", "variance")


def fused_steps(backend: str | None):
    """The optimizers' fused steps on ``backend`` inside the block: "plain" (their unfused path,
    the codec's choice unchanged), "triton" (the Triton passes, on CPU tensors under the
    interpreter), None (the default choice)."""
    return contextlib.nullcontext() if backend is None else use_backend(backend, steps=FUSED_STEPS)


FLOOR, BC2, EPS = 0.05, 0.3, 1e-8  # the fused passes' tests' stale denominator (sqrt(v) units, bc2, eps)


def frozen_variances(sizes, gen: torch.Generator) -> list[torch.Tensor]:
    """Frozen variances for the fused passes' tests, one per size: ``sqrt(v)`` uniform in [0, 1)
    (the floor :data:`FLOOR` binds on 5% of them)."""
    return [torch.rand(s, generator=gen) ** 2 for s in sizes]


def denominator_scalars(floor: float = FLOOR, bc2: float = BC2, eps: float = EPS) -> tuple[float, ...]:
    """The ``(floor, r, eps)`` a fused table takes for these settings (floor rounded to float32)."""
    return float(torch.tensor(floor, dtype=torch.float32)), inverse_sqrt_bc2(bc2), eps


def stale_denominators(variances, floor: float = FLOOR, bc2: float = BC2, eps: float = EPS) -> list:
    """The plain path's stale denominators of ``variances`` (on CPU), as the optimizers compute them."""
    f = torch.tensor(floor, dtype=torch.float32)
    return [stale_denominator(v.cpu(), f, eps, bc2) for v in variances]


def addcmul_fuses(device="cpu") -> bool:
    """Whether torch's ``addcmul_`` rounds once on ``device`` (an FMA: docs/ALGORITHMS.md 6.4), as the
    fused ZeroOneAdam passes do. The reference's product-sum is exact in float64 here (a product of
    two float32, 48 significant bits, and a float32 term at most 4 binades above it: 52 bits), so its
    rounding to float32 is the fma's."""
    g = torch.Generator().manual_seed(3)
    m, x, d = ((torch.rand(4096, generator=g) + 0.5) * torch.randn(4096, generator=g).sign()
               for _ in range(3))
    w = torch.tensor(0.25, dtype=torch.float32)
    ref = (m.to(device) * 0.9).addcmul_(x.to(device), d.to(device), value=0.25).cpu()
    exact = ((w * x).double() * d.double() + (m * 0.9).double()).float()
    return torch.equal(ref, exact)


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


def compiled_local(tensor, worker_error, server_error, group=None):
    """An optimizer reducer's collective as a one-rank group's whole compute with the compiled
    codec (the fused passes run theirs too: ``local_compute``)."""
    return local_compressed_allreduce([tensor], [worker_error], [server_error], backend="native")[0]


compiled_local.local_compute = True


def torch_local(tensor, worker_error, server_error, group=None):
    """As :func:`compiled_local` with the plain torch codec."""
    return local_compressed_allreduce([tensor], [worker_error], [server_error], backend="torch")[0]


torch_local.local_compute = True


def count_gradient_reads(opt) -> list:
    """A list that grows by one each time ``opt``'s non-finite agreement reads the gradients."""
    reads = []
    read = opt._local_gradients_finite
    opt._local_gradients_finite = lambda: reads.append(1) or read()
    return reads


# -- the demo (examples/train_lm.py) run small -------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--freeze-step", "2", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--batch", "4", "--eval-batches", "1"]


def demo_fingerprint(stdout: str) -> str:
    """The weights fingerprint the demo prints at the end."""
    return stdout.split("weights fingerprint")[1].split()[0]


# -- optimizer tests: parameters, gradients, rank bodies shared by the per-optimizer files --
SHAPES = [(7, 5), (5,), (), (3, 4, 2), (0,), (33,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
# the reference's maths (docs/ALGORITHMS.md sections 3-4) with exact (float32) error buffers: what the
# float64 references compute
REFERENCE = dict(compression="momentum", variance_floor=None, auto_mask=None, error_dtype=torch.float32)
LAMB_SHAPES = [(7, 5), (5,), (3, 4, 2), (33,)]  # LAMB's trust ratio needs non-empty tensors here
ZO = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def make_grads(step, rank, shapes=SHAPES):
    """Rank ``rank``'s gradients at ``step``: fresh Gaussians, shifted by 0.3 x rank."""
    out = []
    for i, s in enumerate(shapes):
        g = torch.Generator().manual_seed(10_000 * step + 100 * rank + i)
        out.append(torch.randn(s, generator=g) + 0.3 * rank)
    return out


def draw_grads(params, g: torch.Generator, nan: bool = False) -> None:
    """Fresh normal gradients for ``params`` from ``g``; ``nan``: element 4 of the third one NaN (the
    device-agreement tests' bad step on one rank)."""
    grads = [torch.randn(p.shape, generator=g) for p in params]
    if nan:
        grads[2].view(-1)[4] = float("nan")
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def make_optimizer(name, params, kwargs, cap=25.0):
    if name == "lamb":
        return OnebitLamb(params, **kwargs)
    if name == "zero_one":
        return ZeroOneAdam(params, **{k: v for k, v in kwargs.items() if k != "freeze_step"}, **ZO)
    return OnebitAdam(params, bucket_cap_mb=cap, **kwargs)


def body_train(steps, kwargs, cap, state_bytes=None, save_at=None, name="adam"):
    """Rank body: train ``name`` over ``range(*steps)`` on make_grads; returns the parameters
    after every step and, with ``save_at``, the serialised model and optimizer state then."""
    r = dist.get_rank()
    params = make_params()
    opt = make_optimizer(name, params, kwargs, cap)
    if state_bytes is not None:
        opt.load_state_dict(torch.load(io.BytesIO(state_bytes[r]), weights_only=True))
    saved = None
    history = []
    for t in range(*steps):
        set_grads(params, make_grads(t, r))
        opt.step()
        history.append([p.detach().clone() for p in params])
        if save_at is not None and t + 1 == save_at:
            buf = io.BytesIO()
            torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
            saved = buf.getvalue()
    return history, saved


def body_resume(k, end, kwargs, states, name="adam"):
    """Rank body: load this rank's state from ``states`` and train steps k..end-1."""
    r = dist.get_rank()
    blob = torch.load(io.BytesIO(states[r]), weights_only=True)
    params = [torch.nn.Parameter(t.clone()) for t in blob["model"]]
    opt = make_optimizer(name, params, kwargs)
    opt.load_state_dict(blob["opt"])
    for t in range(k, end):
        set_grads(params, make_grads(t, r))
        opt.step()
    return [p.detach().clone() for p in params]


def assert_block_reference(got, worker_errors, server_errors, want, block: int) -> None:
    """Block-scale outputs and errors of W ranks (``got``: outputs; errors updated in place)
    against ``reference_allreduce(..., block=block)``: outputs to 1e-6 and equal on every rank,
    errors to 1e-6 of what each rank compressed (``||z||``: errors cancel, e = z - s*sgn(z))."""
    W = len(got)
    for r in range(W):
        assert_rel(got[r], want.output, 1e-6, f"output of rank {r}")
        assert torch.equal(got[r], got[0])
        compressed = float(torch.linalg.vector_norm(want.worker_scales[r].double()) * math.sqrt(block))
        assert_rel(worker_errors[r], want.worker_errors[r], 1e-6, "worker_error", norm=compressed)
        if W > 1:
            served = float(torch.linalg.vector_norm(want.server_scales[r].double()) * math.sqrt(block))
            assert_rel(server_errors[r], want.server_errors[r], 1e-6, "server_error", norm=served)


def block_inputs(W: int, n: int, N: int, seed: int, kind: str):
    """W inputs of n elements ("gauss"; "sparse": mostly exact zeros and a few large values, the
    case block scales are for; "heavy": Student-t, 1.5 degrees of freedom) and small random
    worker [N] and server [N / W] errors."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(W):
        x = torch.randn(n, generator=g)
        if kind == "sparse":
            x *= (torch.rand(n, generator=g) < 0.05) * 30.0
        elif kind == "heavy":
            x = torch.distributions.StudentT(1.5).sample((n,)).float()
        xs.append(x)
    we = [torch.randn(N, generator=g) * 0.1 for _ in range(W)]
    se = [torch.randn(N // W, generator=g) * 0.1 for _ in range(W)]
    return xs, we, se


class WireCounter:
    """Bytes this rank sends over ``group``, counted from outside onebit: torch.distributed's
    collectives are wrapped while the context is open (FSDP's and onebit's calls alike), each
    call's bytes by the ring algorithm's count (all-reduce 2(G-1)/G of the tensor, all-to-all and
    reduce-scatter (G-1)/G of the input, all-gather G-1 times the input), for every group over
    ``group``'s ranks. ``bytes`` sums them, ``sent`` sums them by collective;
    ``calls`` counts them by collective."""

    NAMES = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor",
             "all_gather_single", "all_gather")

    def __init__(self, group) -> None:
        self.group, self.bytes, self.calls, self.sent = group, 0, {}, {}
        self.ranks = sorted(dist.get_process_group_ranks(group))

    def _count(self, name, args, kwargs) -> None:
        group = kwargs.get("group") or dist.group.WORLD  # any group over the same ranks (two meshes)
        if sorted(dist.get_process_group_ranks(group)) != self.ranks:
            return
        G = dist.get_world_size(group)
        if name == "all_gather":
            t = args[1] if len(args) > 1 else kwargs["tensor"]
            sent = (G - 1) * t.nelement() * t.element_size()
        else:
            t = args[-1] if name != "all_reduce" else args[0]
            if name == "all_to_all_single" or name == "reduce_scatter_tensor":
                t = args[1]
            n = t.nelement() * t.element_size()
            sent = {"all_reduce": 2 * (G - 1) * n // G, "all_to_all_single": (G - 1) * n // G,
                    "reduce_scatter_tensor": (G - 1) * n // G}.get(name, (G - 1) * n)
        self.bytes += sent
        self.sent[name] = self.sent.get(name, 0) + sent
        self.calls[name] = self.calls.get(name, 0) + 1

    def __enter__(self):
        import onebit.collectives._group as onebit_group

        self._saved = {}
        for name in self.NAMES:
            real = getattr(dist, name, None)
            if real is None:
                continue

            def counted(*args, _real=real, _name=name, **kwargs):
                self._count(_name, args, kwargs)
                return _real(*args, **kwargs)

            self._saved[(dist, name)] = real
            setattr(dist, name, counted)
        real = onebit_group._all_gather
        self._saved[(onebit_group, "_all_gather")] = real

        def gathered(*args, **kwargs):
            self._count("all_gather_into_tensor", args, kwargs)
            return real(*args, **kwargs)

        onebit_group._all_gather = gathered
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), real in self._saved.items():
            setattr(module, name, real)


def refusals(makers, errors=(ValueError,)) -> dict:
    """``{name: None}`` where ``maker()`` succeeds, else ``{name: the message it raised}`` (one of
    ``errors``), for each ``(name, maker)``: what a constructor refuses, and how it says so."""
    out = {}
    for name, make in makers:
        try:
            make()
            out[name] = None
        except errors as e:
            out[name] = str(e)
    return out


def resume_point(opt, params, load: dict | None = None) -> dict:
    """At a run's checkpoint step: ``load`` loaded where given (a copy of it: the optimizer's state and
    the parameters under ``"params"``, as a training script resumes), then what to save: a copy of
    ``opt.state_dict()`` with the parameters under ``"params"``."""
    import copy

    if load is not None:
        opt.load_state_dict(copy.deepcopy(load))
        with torch.no_grad():
            for p, q in zip(params, load["params"], strict=True):
                p.copy_(q)
    saved = copy.deepcopy(opt.state_dict())
    saved["params"] = [p.detach().clone() for p in params]
    return saved


class ValueReads:
    """Reads of tensor values into Python during the block (``float``, ``int``, ``bool``, ``item``,
    ``tolist``: each a host synchronisation where the tensor lives on a GPU), counted through patched
    methods: ``where``, by the library's line that made them; ``of(tensors)``, those of given tensors."""

    NAMES = ("__float__", "__int__", "__bool__", "item", "tolist")
    LIBRARY = ("onebit", "/optimizers/", "/kernels/", "/collectives/")

    def __enter__(self):
        import collections
        import traceback

        self.where, self.ids = collections.Counter(), []
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n, fn in self.saved.items():
            def counting(t, *a, _fn=fn, **k):
                frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                              if any(part in f.filename for part in self.LIBRARY)), None)
                line = "?" if frame is None else f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                self.where[line] += 1
                self.ids.append(id(t))
                return _fn(t, *a, **k)
            setattr(torch.Tensor, n, counting)
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(torch.Tensor, n, fn)

    def of(self, tensors) -> int:
        mine = {id(t) for t in tensors}
        return sum(i in mine for i in self.ids)


def hook_denominators(n, spans, seed, kind, device="cpu"):
    """A FrozenAdam with frozen scalars per span and the hook bucket's Denominators (on ``device``):
    each span's frozen variance (float32, or bfloat16 where ``kind`` says; zero and tiny variances under
    the floor), or none (``d = 1``: an SGD's momentum) for every third span with ``mixed``."""
    from onebit.collectives._frozen_adam import Denominators, FrozenAdam

    g = torch.Generator().manual_seed(seed + 7)
    fa, spans_ = FrozenAdam(1, 0.1), []
    for k, (lo, hi) in enumerate(spans):
        if kind == "mixed" and k % 3 == 1:
            spans_.append((lo, hi, None))
            continue
        v = torch.rand(hi - lo, generator=g).pow(6) * 1e-2
        v[: (hi - lo) // 5] = 0.0  # dead units: a zero variance
        v[(hi - lo) // 5 : (hi - lo) // 4] = 1e-30  # tiny ones
        if kind == "v16":
            v = v.bfloat16()
        v = v.to(device)
        name = (0, k)
        fa.scalars[name] = (float(torch.tensor(1e-4 * (k + 1))), 1.0 - 0.999 ** (k + 3), 1e-8)
        spans_.append((lo, hi, ("v", v, fa._c_scalars(name), name)))
    return fa, Denominators(fa, n, device, spans_)
