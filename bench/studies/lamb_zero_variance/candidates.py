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
    scale of sign compression); seg: "global" (worker: one scale over N; server: one per chunk,
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

    def segments(lo, hi):
        if seg == "global":
            return [(0, hi - lo)]
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
        s = scales_of(z, segments(0, N))
        q = torch.where(z >= 0, s, -s)
        worker_error.copy_(z - q)
        qs = [torch.empty_like(q) for _ in range(W)]
        dist.all_gather(qs, q)
        m = sum(t[r * C : (r + 1) * C] for t in qs) / W + server_error
        ss = scales_of(m, segments(r * C, (r + 1) * C))
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
