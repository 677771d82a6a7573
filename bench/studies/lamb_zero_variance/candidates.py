"""Candidate fixes, applied as subclasses of zv's StudyLamb (no library file changes).

gradcomp: compress the preconditioned GRADIENT g/d (error feedback in the reducer's flat
  buffer, as now) and keep the momentum u = b1*u + (1-b1)*mean_hat(g/d) outside the reducer,
  from the decompressed average (identical on every rank). The compression noise
  E_{t-1} - E_t then enters u through the (1-b1) low-pass instead of through the whole buffer.
  Wire cost unchanged (one compressed all-reduce of n + the sketches); memory: one more
  float32 buffer per parameter (u), the reducer's flat buffer now holds g/d.
"""

import torch

from onebit.optimizers._functional import TRUST_SKETCH, count_sketch, lamb_sketched_update


def wrap(cls, cand):
    if cand is None:
        return cls
    if cand == "gradcomp":
        return GradComp(cls)
    raise ValueError(cand)


def GradComp(base):
    class _GradComp(base):
        def _enter_compression(self):
            super()._enter_compression()  # views <- m/d, sketch y <- S(m/d)
            views = self.reducer().views
            self._u = [v.clone() for v in views]
            for v in views:
                v.zero_()

        def _applied(self, views):
            return self._u

        def _step_body(self, reducer, pairs):
            views, index = reducer.views, self._sketch_indices(pairs)
            sketches = []
            for k, (p, g) in enumerate(pairs):
                d = self.stale_denominator(k, p, g)
                if p.grad is not None:
                    torch.div(p.grad, d, out=views[k])
                else:
                    views[k].zero_()
                sketches.append(count_sketch(views[k], index[k], TRUST_SKETCH))
            sketches += [count_sketch(p.detach(), index[k], TRUST_SKETCH) for k, (p, _) in enumerate(pairs)]
            means = self._mean_over_ranks(torch.cat(sketches))
            reducer.compressed_mean_()
            coeffs, offset, half = [], 0, means.numel() // 2
            for k, (p, g) in enumerate(pairs):
                b1 = g["betas"][0]
                u = self._u[k].mul_(b1).add_(views[k], alpha=1.0 - b1)
                size = min(p.numel(), TRUST_SKETCH)
                y = self.state[p]["lamb_sketch"]
                y.mul_(b1).add_(means[offset : offset + size], alpha=1.0 - b1)
                sketch_p = means[half + offset : half + offset + size]
                estimate = torch.linalg.vector_norm(y + g["weight_decay"] * sketch_p)
                offset += size
                coeffs.append(sketched_step(self, p, u, estimate, g))
            return coeffs

    return _GradComp


# -- an emulated compressed_allreduce (docs/ALGORITHMS.md section 2, the maths only: the signs
# travel as float32 through all_gather) with a choice of scale and of the segments that share one
def make_allreduce(scale: str, seg: str, bounds):
    """scale: "rms" (the library's, ||z||/sqrt(L)) or "l1" (||z||_1 / L, the error-minimising
    scale of sign compression); seg: "block" (one scale per `block` elements, the library's
    block=B; pass block=B to OnebitLamb too), "global" (worker: one scale over N; server: one per chunk,
    the library's) or "tensor" (one scale per tensor segment, on both sides). bounds: the
    tensors' (offset, numel) in the flat buffer."""
    import torch.distributed as dist

    def scales_of(z, segs):
        out = torch.empty_like(z)
        for a, b in segs:
            part = z[a:b]
            if b <= a:
                continue
            if scale == "rms":
                s = part.norm() / (b - a) ** 0.5
            else:
                s = part.abs().sum() / (b - a)
            out[a:b] = s
        return out

    def segments(lo, hi, block=None):
        if seg == "global":
            return [(0, hi - lo)]
        if seg == "block":  # one scale per `block` elements on both stages, as block=B does
            return [(a, min(a + block, hi - lo)) for a in range(0, hi - lo, block)]
        cuts = sorted(
            {lo, hi} | {min(max(o, lo), hi) for o, _ in bounds} | {min(max(o + n, lo), hi) for o, n in bounds}
        )
        return [(a - lo, b - lo) for a, b in zip(cuts[:-1], cuts[1:], strict=False) if b > a]

    def allreduce(flat, worker_error, server_error, group=None, block=None):
        W, r = dist.get_world_size(), dist.get_rank()
        N = worker_error.numel()
        C = N // W
        x = torch.zeros(N)
        x[: flat.numel()] = flat.reshape(-1)
        z = x + worker_error
        s = scales_of(z, segments(0, N, block))
        q = torch.where(z >= 0, s, -s)
        worker_error.copy_(z - q)
        qs = [torch.empty_like(q) for _ in range(W)]
        dist.all_gather(qs, q)
        m = sum(t[r * C : (r + 1) * C] for t in qs) / W + server_error
        ss = scales_of(m, segments(r * C, (r + 1) * C, block))
        out = torch.where(m >= 0, ss, -ss)
        server_error.copy_(m - out)
        outs = [torch.empty_like(out) for _ in range(W)]
        dist.all_gather(outs, out)
        full = torch.cat(outs)
        flat.reshape(-1).copy_(full[: flat.numel()])

    return allreduce


def sketched_step(opt, p, u, estimate, group):
    """LAMB's step with the trust ratio from ``estimate`` (onebit's lamb_sketched_update)."""
    return lamb_sketched_update(p, u, estimate, lr=group["lr"], weight_decay=group["weight_decay"],
                                min_coeff=opt.min_coeff, max_coeff=opt.max_coeff)


# -- candidate C: a variance-sorted block layout (same wire format as block=B: signs + one scale
# per B elements; no extra all-reduce). At the freeze every rank holds the same frozen v, so every
# rank can compute the same permutation of the flat buffer: coordinates that never had a gradient
# (v == 0) go to the end, where they fill all-zero blocks (scale 0: sent exactly, no error
# feedback), and the active coordinates are ordered so that each block of B holds coordinates of
# similar |u| = |m| / d (sorted by v), which keeps rho near sqrt(2/pi) inside each block.
def layout_slots(mode: str, vs, offsets, N: int, block: int) -> torch.Tensor:
    """slots[i]: the position in the permuted length-N buffer of flat coordinate i."""
    n = sum(v.numel() for v in vs)
    act, inact = [], []
    for v, off in zip(vs, offsets, strict=True):
        f = v.reshape(-1)
        idx = torch.arange(f.numel()) + off
        on = f > 0
        a = idx[on]
        if mode in ("tsort", "gsort"):
            a = a[torch.argsort(f[on], descending=True, stable=True)]
        act.append((a, f[on]))
        inact.append(idx[~on])
    inactive = torch.cat(inact)
    slots = torch.full((n,), -1, dtype=torch.long)
    free = torch.ones(N, dtype=torch.bool)
    if mode == "gsort":
        a = torch.cat([x for x, _ in act])
        val = torch.cat([y for _, y in act])
        a = a[torch.argsort(val, descending=True, stable=True)]
        slots[a] = torch.arange(a.numel())
        free[: a.numel()] = False
    else:
        cur = 0
        spare = N - n + inactive.numel()  # slots that may be left as gaps (filled below)
        for a, _ in act:
            slots[a] = torch.arange(cur, cur + a.numel())
            free[cur : cur + a.numel()] = False
            cur += a.numel()
            if mode == "tsort":
                up = -(-cur // block) * block
                if up - cur <= spare:  # align while gap room is left (gaps get inactive coordinates)
                    spare -= up - cur
                    cur = up
    empty = free.nonzero().reshape(-1)[: inactive.numel()]
    slots[inactive] = empty
    assert bool((slots >= 0).all()) and slots.unique().numel() == n
    return slots


def make_layout(allreduce, mode: str, vs, offsets, N: int, block: int):
    slots = layout_slots(mode, vs, offsets, N, block)

    def permuted(flat, worker_error, server_error, group=None, block=None):
        n = slots.numel()  # the flat buffer may carry padding beyond the n coordinates (left as is)
        x = torch.zeros(N, dtype=torch.float32, device=flat.device)
        x[slots] = flat.reshape(-1)[:n]
        allreduce(x, worker_error, server_error, group, block=block)
        flat.reshape(-1)[:n].copy_(x[slots])

    return permuted


# -- candidate C2: decayed error feedback (worker and server errors times gamma before each
# compressed all-reduce): bounds the error's growth where the sign compression is not a
# contraction (rho < 1/2), at the cost of a bias of (1 - gamma) of the error each step.
def make_decay(allreduce, gamma: float):
    def decayed(flat, worker_error, server_error, group=None, block=None):
        worker_error.mul_(gamma)
        server_error.mul_(gamma)
        allreduce(flat, worker_error, server_error, group, block=block)

    return decayed
