"""Float64 reference of the 1-bit optimizers (docs/ALGORITHMS.md sections 3-4), W simulated ranks."""

from __future__ import annotations

import math

import torch

from onebit.collectives.bucket import plan_buckets
from onebit.kernels.layout import padded_numel
from onebit.kernels.reference import reference_allreduce


def bucketed_mean(per_rank, buckets, numels, shapes, errors) -> list:
    """The 1-bit mean per parameter (``per_rank[r][i]``), bucket by bucket through the float64
    reference collective; ``errors[b]`` (worker, server) replaced by the updated ones."""
    out = [None] * len(numels)
    for b, idx in enumerate(buckets):
        flats = [torch.cat([rank[i].reshape(-1) for i in idx]) for rank in per_rank]
        res = reference_allreduce(flats, *errors[b])
        errors[b] = (res.worker_errors, res.server_errors)
        off = 0
        for i in idx:
            out[i] = res.output[off : off + numels[i]].view(shapes[i]).clone()
            off += numels[i]
    return out


def reference_onebit_adam(params, grads, *, lr, betas, eps, weight_decay, freeze_step, masks=None,
                          bucket_cap_mb=25.0, bias_correction=False, eps_inside_sqrt=False):
    """params: list of tensors (identical on all ranks); grads[t][r][i]: gradient of param i
    on rank r at update t+1. Returns the float64 parameters after all updates."""
    W = len(grads[0])
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    numels = [x.numel() for x in p]
    buckets = plan_buckets(numels, 4, bucket_cap_mb)
    errors = []
    for idx in buckets:
        N = padded_numel(sum(numels[i] for i in idx), W)
        errors.append(([torch.zeros(N, dtype=torch.float64) for _ in range(W)],
                       [torch.zeros(N // W, dtype=torch.float64) for _ in range(W)]))
    b1, b2 = betas
    for t, step_grads in enumerate(grads, start=1):
        compress = t > freeze_step
        if not compress:
            for i in range(len(p)):
                g = sum(step_grads[r][i].double() for r in range(W)) / W
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
        else:
            local = [[b1 * m[i] + (1 - b1) * step_grads[r][i].double() for i in range(len(p))]
                     for r in range(W)]
            m = bucketed_mean(local, buckets, numels, [x.shape for x in p], errors)
            if masks is not None:
                m = [mi * mk.double() if mk is not None else mi for mi, mk in zip(m, masks, strict=True)]
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2 ** min(t, freeze_step) if bias_correction else 1.0
        for i in range(len(p)):
            denom = torch.sqrt(v[i] / bc2 + eps) if eps_inside_sqrt else torch.sqrt(v[i] / bc2) + eps
            update = (m[i] / bc1) / denom + weight_decay * p[i]
            p[i] = p[i] - lr * update
    return p


def reference_dead(v: torch.Tensor, ratio: float | None, samples: int) -> torch.Tensor | None:
    """float64 twin of the automatic momentum mask: True where sqrt(v) <= ratio * mean of the
    tensor's nonzero sqrt(v), the ratio 0 below 8 variance updates (None when off)."""
    if ratio is None:
        return None
    if samples < 8:
        ratio = 0.0
    s = torch.sqrt(v.double())
    nonzero = s[s > 0]
    typical = float(nonzero.mean()) if nonzero.numel() else 0.0
    return s <= ratio * typical


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-300))


__all__ = ["math", "reference_dead", "reference_onebit_adam", "relative"]


def reference_onebit_lamb(params, grads, *, lr, betas, eps, weight_decay, freeze_step, max_coeff=10.0,
                          min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                          factor_threshold=0.1, auto_mask=None):
    """Float64 1-bit LAMB (docs/ALGORITHMS.md 4.1) over W simulated ranks; returns (params, coeffs)."""
    W = len(grads[0])
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    v_fresh = [torch.zeros_like(x) for x in p]
    coeff_freeze = [0.0] * len(p)
    last_factor = [1.0] * len(p)
    scaling = [1.0] * len(p)
    numels = [x.numel() for x in p]
    n = sum(numels)
    N = padded_numel(n, W)
    we = [torch.zeros(N, dtype=torch.float64) for _ in range(W)]
    se = [torch.zeros(N // W, dtype=torch.float64) for _ in range(W)]
    tail = torch.zeros(N - n, dtype=torch.float64)  # the padded tail carries the last output
    b1, b2 = betas
    coeffs = []
    for t, step_grads in enumerate(grads, start=1):
        coeffs = []
        if t <= freeze_step:
            for i in range(len(p)):
                g = sum(step_grads[r][i].double() for r in range(W)) / W
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                if t == freeze_step:
                    v_fresh[i] = v[i].clone()
                upd = m[i] / (torch.sqrt(v[i]) + eps) + weight_decay * p[i]
                wn, un = float(p[i].norm()), float(upd.norm())
                c = 1.0 if wn == 0 or un == 0 else min(max(wn / un, min_coeff), max_coeff)
                if c != 1.0:
                    coeff_freeze[i] = coeff_beta * coeff_freeze[i] + (1 - coeff_beta) * c
                p[i] = p[i] - lr * c * upd
                coeffs.append(c)
            continue
        if t == freeze_step + 1:
            rms = [float(mi.norm()) / math.sqrt(max(mi.numel(), 1)) for mi in m]
            united = sum(rms) / len(rms)
            scaling = [united / r if r > 0 else 1.0 for r in rms]
            dead = [reference_dead(vi, auto_mask, freeze_step) for vi in v]
        m_last = [mi.clone() for mi in m]
        flats = []
        for r in range(W):
            local = [(b1 * m[i] + (1 - b1) * step_grads[r][i].double()) * scaling[i] for i in range(len(p))]
            flats.append(torch.cat([x.reshape(-1) for x in local] + [tail]))
        res = reference_allreduce(flats, we, se)
        we, se = res.worker_errors, res.server_errors
        tail = res.output[n:].clone()
        off = 0
        for i in range(len(p)):
            m[i] = res.output[off : off + numels[i]].view_as(p[i]) / scaling[i]
            if dead[i] is not None:
                m[i] = torch.where(dead[i], 0.0, m[i])
            off += numels[i]
            g = (m[i] - b1 * m_last[i]) / (1 - b1)
            v_fresh[i] = b2 * v_fresh[i] + (1 - b2) * g * g
            denom = torch.sqrt(v[i]) + eps
            upd_pre = m[i] / denom
            upd = upd_pre + weight_decay * p[i] if weight_decay > 0 else upd_pre
            f = float((denom / (torch.sqrt(v_fresh[i]) + eps)).max()) if p[i].numel() else 1.0
            if weight_decay > 0:
                ratio = min(1.0, float(upd_pre.norm()) / float(upd.norm()))
                f = f * ratio + (1 - ratio)
            f = min(max(f, factor_min), factor_max)
            f = min(max(f, last_factor[i] * (1 - factor_threshold)), last_factor[i] * (1 + factor_threshold))
            last_factor[i] = f
            p[i] = p[i] - lr * coeff_freeze[i] * f * upd
            coeffs.append(coeff_freeze[i] * f)
    return p, coeffs


__all__ += ["reference_onebit_lamb"]


def reference_zero_one_adam(params, grads, *, lr, betas, eps, weight_decay, var_freeze_step,
                            var_update_scaler, local_step_scaler, local_step_clipper, masks=None,
                            bucket_cap_mb=25.0):
    """Float64 0/1 Adam (docs/ALGORITHMS.md 4.2) over W simulated ranks, steps counted from 1.
    Returns the per-rank parameters after all updates (they differ between syncs)."""
    W = len(grads[0])
    P = len(params)
    p = [[x.double().clone() for x in params] for _ in range(W)]
    m = [[torch.zeros_like(x) for x in p[0]] for _ in range(W)]
    v = [torch.zeros_like(x) for x in p[0]]  # identical on all ranks
    u = [[torch.zeros_like(x) for x in p[0]] for _ in range(W)]
    masks = masks or [None] * P
    numels = [x.numel() for x in p[0]]
    buckets = plan_buckets(numels, 4, bucket_cap_mb)
    errors = [None] * len(buckets)

    def reset():
        for b, idx in enumerate(buckets):
            N = padded_numel(sum(numels[i] for i in idx), W)
            errors[b] = ([torch.zeros(N, dtype=torch.float64) for _ in range(W)],
                         [torch.zeros(N // W, dtype=torch.float64) for _ in range(W)])

    def compressed(per_rank):  # per_rank[r][i] -> the 1-bit mean per parameter
        return bucketed_mean(per_rank, buckets, numels, [x.shape for x in p[0]], errors)

    reset()
    b1, b2 = betas
    var_interval, var_counter, lsi, lsc, lrs = 1, 0, 1, 0, 0.0
    for t, step_grads in enumerate(grads, start=1):
        g_ = [[x.double() for x in step_grads[r]] for r in range(W)]
        if t <= var_freeze_step:
            var_step = t % var_interval == 0
            if var_step:
                avg = [sum(g_[r][i] for r in range(W)) / W for i in range(P)]
                for i in range(P):
                    v[i] = b2 * v[i] + (1 - b2) * avg[i] * avg[i]
            else:
                avg = compressed(g_)
                avg = [a * mk.double() if mk is not None else a for a, mk in zip(avg, masks, strict=True)]
            for r in range(W):
                for i in range(P):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * avg[i]
                    p[r][i] = p[r][i] - lr * (m[r][i] / (torch.sqrt(v[i]) + eps) + weight_decay * p[r][i])
            if var_step:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            continue
        if t == var_freeze_step + 1:
            reset()
        lrs += lr
        for r in range(W):
            for i in range(P):
                m[r][i] = b1 * m[r][i] + (1 - b1) * g_[r][i]
                upd = m[r][i] / (torch.sqrt(v[i]) + eps) + weight_decay * p[r][i]
                p[r][i] = p[r][i] - lr * upd
                u[r][i] = u[r][i] - lr * upd
        if t % lsi == 0:
            for r in range(W):
                for i in range(P):
                    p[r][i] = p[r][i] - u[r][i]
                    u[r][i] = u[r][i] * (torch.sqrt(v[i]) + eps)
            avg = compressed(u)
            avg = [a * mk.double() if mk is not None else a for a, mk in zip(avg, masks, strict=True)]
            for r in range(W):
                for i in range(P):
                    m[r][i] = -avg[i] / lrs
                    p[r][i] = p[r][i] + avg[i] / (torch.sqrt(v[i]) + eps)
                    u[r][i] = torch.zeros_like(u[r][i])
            lrs = 0.0
        lsc += 1
        if lsc == local_step_scaler:
            lsc, lsi = 0, min(local_step_clipper, lsi * 2)
    return p


__all__ += ["reference_zero_one_adam"]
