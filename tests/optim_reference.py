"""Float64 reference of the 1-bit optimizers (ALGORITHMS.md sections 3-4), W simulated ranks."""

from __future__ import annotations

import math

import torch

from onebit.collectives.bucket import plan_buckets
from onebit.kernels.layout import padded_numel
from onebit.kernels.reference import reference_allreduce


def reference_onebit_adam(params, grads, *, lr, betas, eps, weight_decay, freeze_step, masks=None,
                          bucket_cap_mb=25.0, bias_correction=False):
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
            for b, idx in enumerate(buckets):
                flats = [torch.cat([local[r][i].reshape(-1) for i in idx]) for r in range(W)]
                res = reference_allreduce(flats, *errors[b])
                errors[b] = (res.worker_errors, res.server_errors)
                off = 0
                for i in idx:
                    m[i] = res.output[off : off + numels[i]].view_as(p[i]).clone()
                    off += numels[i]
            if masks is not None:
                m = [mi * mk.double() if mk is not None else mi for mi, mk in zip(m, masks, strict=True)]
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2 ** min(t, freeze_step) if bias_correction else 1.0
        for i in range(len(p)):
            update = (m[i] / bc1) / (torch.sqrt(v[i] / bc2) + eps) + weight_decay * p[i]
            p[i] = p[i] - lr * update
    return p


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-300))


__all__ = ["math", "reference_onebit_adam", "relative"]
