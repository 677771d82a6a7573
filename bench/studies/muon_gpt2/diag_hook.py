"""What Muon's own 1-bit gradient costs on docs/hf-trainer.md's GPT-2 (issue 59; bench/RESULTS.md "The DDP
hook with Muon", session 32): the page's script run with a diagnostic DDP comm hook in place of onebit's.
The hook (torch ops, float32 errors) compresses the gradients of Muon's matrices with worker and server
error feedback, sign times the mean magnitude of each block, and averages everything else exactly;
variants by ``--diag`` (comma-separated):

  server        the server's second compression (without it: the workers' messages averaged exactly)
  block=B       elements per scale (64: 1.5 bits per element; 16: 2.5)
  decay=G       both errors multiplied by G before each use
  scale         each matrix's gradient divided by a running RMS of its shared averages (beta=0.99)
  pred=L        the gradient minus L times the shared momentum compressed (the momentum added back)
  fact=B        each matrix's gradient divided elementwise by sqrt of a factored second moment (Adafactor's
                row and column means of the shared averages' squares, EMA with beta B) before compression,
                multiplied back after: the errors and the block scales in that normalised space
  elem=B        the same with each element's own second moment (an EMA of the shared averages' squares)
  floor=F       fact/elem: the root raised to at least F times its mean over the matrix (default 0.1)
  start=N       the first compressed iteration (default 2: the hook's start_iter)
  proj=R        each matrix's gradient split along the top R right singular vectors V of the shared momentum
                (the matrix laid with its shorter side as rows): the coefficients G V^T averaged exactly
                (R floats per row of the shorter side), the rest 1-bit with error feedback
  rot=K         each matrix compressed in the shared momentum's singular bases (U^T G V; its rows the left
                singular directions, so a block's scale follows the spectrum), the errors held in those bases,
                the bases made anew every K iterations
  rank=R        rot: the bases' top R directions the momentum's, the rest completed by QR against the unit
                vectors (what R Householder reflections give: R columns stored, not the whole bases)
  order=O       rot: the blocks taken in the order of the elements' expected size, prod (s_k s_l, the
                momentum's singular values) or sum (k + l), instead of row by row
  wrk=S         rot: the workers' errors at a new basis, as srv (default exact)
  bnorm=B       rot: each element of U^T G V divided by the root of a factored second moment in the bases
                (row and column means of the decoded averages' squares there, EMA with beta B; floored by
                floor) before its block's sign and scale, multiplied back after; the errors unnormalised
  snorm=F       rot: each element (k, l) of U^T G V divided by s_k + s_l (the momentum's singular values when
                the bases were made, 0 past its rank; floored at F times their mean) before its block's sign
                and scale, multiplied back after: the error weighted as Newton-Schulz reads it (its output
                turns by (E_kl - E_lk) / (s_k + s_l)); the errors unnormalised
  spow=P        snorm: (s_k + s_l) ** P instead (default 1)
  pair=L        rot: the square block of U^T G V sent as pairs' antisymmetric parts (X_kl - X_lk) / sqrt 2
                above the diagonal and symmetric parts (X_kl + X_lk) / sqrt 2 below it (orthogonal, the errors
                held there); with snorm the symmetric parts and the diagonal weighted L times more (their
                errors only move the singular values, which Newton-Schulz discards)
  pdiag=D       pair: the diagonal weighted D times more instead of L
  iter=1        rot: new bases (after the first SVD) by one step of orthogonal iteration from the old ones,
                U' = Q of [M V, I] (its first a columns), V' = Q of [M^T U', I]: matmuls and QRs, no SVD
  side=left     rot: the left (rows') basis alone, the columns as they are
  srv=S         rot: the server's errors at a new basis: exact (turned into it), keep (left as they are:
                what a server that holds a chunk of each matrix can do), reset (zeroed) or flush (added
                to the workers' errors before they are turned, and zeroed: the library's, section 8.4)
  subset=K      no compression: Muon's matrices averaged exactly over the first K ranks' batches only (plain
                DDP with W / K times less data for them; with comp: the share a smaller batch's step holds)
  comp=C        an oracle of Muon's step along plain DDP's: the exact averages too (a second all-reduce,
                diagnostic only), each matrix's Nesterov update made from the exact and from the decoded
                averages and orthogonalised (O_exact, O_dec), and Muon's step of that matrix multiplied by
                1 / s, s = <O_dec, O_exact> / <O_exact, O_exact> (the share of plain DDP's step in the
                hook's), clamped to [1, C]

  torchrun --nproc-per-node 4 bench/studies/muon_gpt2/diag_hook.py --muon-lr 0.05 --diag server
  torchrun --nproc-per-node 4 bench/studies/muon_gpt2/diag_hook.py --muon-lr 0.05 --diag ""   # plain DDP

Prints ``eval_loss L``. The page's script is read from docs/hf-trainer.md and run with its
``attach(trainer)`` line replaced by this hook (``--diag ""``: plain DDP, ``--optimizer muon-plain``).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[3]
MOMENTUM = 0.95  # torch.optim.Muon's default, as the page's script makes it


def block_sign(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's sign times its mean magnitude (the padded rest counts as zeros)."""
    n = x.numel()
    y = torch.cat([x, x.new_zeros((-n) % block)]).view(-1, block)
    s = y.abs().mean(1, keepdim=True)
    return torch.where(y >= 0, s, -s).reshape(-1)[:n]


class DiagHook:
    """A DDP comm hook: Muon's matrices (``ids``) 1-bit from ``start``, everything else exact."""

    def __init__(self, ids: set[int], opts: dict[str, str], start: int = 2) -> None:
        self.ids, self.opts, self.start, self.it = ids, opts, start, 0
        self.block = int(opts.get("block", 64))
        self.decay = float(opts["decay"]) if "decay" in opts else None
        self.pred = float(opts["pred"]) if "pred" in opts else None
        self.fact = float(opts["fact"]) if "fact" in opts else None
        self.elem = float(opts["elem"]) if "elem" in opts else None
        self.floor = float(opts.get("floor", 0.1))
        self.vs: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor] = {}
        self.cols: dict[int, torch.Tensor] = {}
        self.ew: dict[int, torch.Tensor] = {}
        self.es: dict[int, torch.Tensor] = {}
        self.rms: dict[int, torch.Tensor] = {}
        self.m: dict[int, torch.Tensor] = {}
        self.bases: dict[int, tuple] = {}
        self.perm: dict[int, torch.Tensor] = {}
        self.bnorm = float(opts["bnorm"]) if "bnorm" in opts else None
        self.snorm = float(opts["snorm"]) if "snorm" in opts else None
        self.sw: dict[int, torch.Tensor] = {}
        self.brows: dict[int, torch.Tensor] = {}
        self.bcols: dict[int, torch.Tensor] = {}
        self.comp = float(opts["comp"]) if "comp" in opts else None
        self.exact_m: dict[int, torch.Tensor] = {}
        self.scales: dict[int, float] = {}
        self.ratios: list[float] = []
        self.cosines: list[float] = []  # (the updates' before orthogonalisation)

    def _exact(self, grads: list[torch.Tensor], W: int) -> None:
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(W)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def _factored(self, k: int, shape) -> torch.Tensor | None:
        """sqrt of the factored second moment R_i C_j / mean(R) of parameter ``k`` (flat), from the
        shared averages (alike on every rank); None before any."""
        if self.elem is not None:
            v = self.vs.get(k)
        else:
            r, c = self.rows.get(k), self.cols.get(k)
            v = None if r is None or len(shape) != 2 else torch.outer(r, c) / r.mean().clamp_min(1e-30)
        if v is None:
            return None
        root = v.sqrt().reshape(-1)
        return torch.maximum(root, self.floor * root.mean()).clamp_min(1e-20)

    def _basis(self, k: int, shape) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared momentum's full singular bases (U, V^T) of parameter ``k`` (alike on every rank), made
        anew every ``rot`` iterations; the errors held in the old bases turned into the new ones (the
        server's by ``srv``: exact, keep (left as they are) or reset). None before any momentum."""
        m = self.m.get(k)
        if m is None or len(shape) != 2:
            return None
        got, every = self.bases.get(k), int(self.opts["rot"])
        if got is None or self.it - got[2] >= every:
            if "iter" in self.opts and got is not None:  # one step of orthogonal iteration, warm
                mm = m.view(shape).double()
                a, b = shape
                eye_a, eye_b = torch.eye(a, dtype=mm.dtype), torch.eye(b, dtype=mm.dtype)
                u = torch.linalg.qr(torch.cat([mm @ got[1].double().T[:, :a], eye_a], 1)).Q
                vh = torch.linalg.qr(torch.cat([mm.T @ u[:, :b], eye_b], 1)).Q.T
                sv = torch.linalg.svdvals(mm)
            else:
                u, sv, vh = torch.linalg.svd(m.view(shape).double(), full_matrices=True)
            if "order" in self.opts:  # the elements of U^T G V laid out in the order of their expected size
                a, b = shape
                ka = torch.zeros(a, dtype=torch.float64)
                kb = torch.zeros(b, dtype=torch.float64)
                ka[: len(sv)], kb[: len(sv)] = sv, sv
                if self.opts["order"] == "prod":
                    key = -(ka[:, None] * kb[None, :])
                else:  # "sum": by k + l
                    key = (torch.arange(a)[:, None] + torch.arange(b)[None, :]).double()
                self.perm[k] = torch.argsort(key.reshape(-1), stable=True)
            if "rank" in self.opts:  # the top R directions, completed by QR against the unit vectors
                r = int(self.opts["rank"])
                u = torch.linalg.qr(torch.cat([u[:, :r], torch.eye(shape[0], dtype=u.dtype)], 1)).Q
                vh = torch.linalg.qr(torch.cat([vh[:r].T, torch.eye(shape[1], dtype=u.dtype)], 1)).Q.T
            if self.opts.get("side") == "left":  # the rows' side alone
                vh = torch.eye(shape[1], dtype=u.dtype)
            if self.snorm is not None:
                a, b = shape
                ka, kb = torch.zeros(a, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
                ka[: len(sv)], kb[: len(sv)] = sv, sv
                w = (ka[:, None] + kb[None, :]).reshape(-1).float() ** float(self.opts.get("spow", 1))
                self.sw[k] = torch.maximum(w, self.snorm * w.mean()).clamp_min(1e-20)
                if "pair" in self.opts:  # the symmetric parts and the diagonal: L times the weight
                    r = min(a, b)
                    low = torch.zeros(a, b, dtype=torch.bool)
                    low[:r, :r] = torch.ones(r, r, dtype=torch.bool).tril()
                    lam, on = float(self.opts["pair"]), torch.eye(a, b, dtype=torch.bool).reshape(-1)
                    self.sw[k] = torch.where(low.reshape(-1), self.sw[k] * lam, self.sw[k])
                    if "pdiag" in self.opts:  # the diagonal's own factor instead
                        self.sw[k] = torch.where(on, self.sw[k] / lam * float(self.opts["pdiag"]), self.sw[k])
            u, vh = u.float(), vh.float()
            old_u = torch.eye(shape[0]) if got is None else got[0]
            old_vh = torch.eye(shape[1]) if got is None else got[1]
            turn = (u.T @ old_u, old_vh @ vh.T)  # old coordinates -> new: U'^T U E V^T V'
            if self.opts.get("srv") == "flush" and k in self.es and k in self.ew:  # (pair: alike coordinates)
                self.ew[k].add_(self.es[k])  # the server's debt into the workers' (each rank: the mean)
                self.es[k].zero_()
            hows = (self.opts.get("wrk", "exact"), self.opts.get("srv", "exact"))
            for table, how in zip((self.ew, self.es), hows, strict=True):
                e = table.get(k)
                if e is None or how in ("keep", "flush"):
                    continue
                if how != "exact":
                    e.zero_()
                    continue
                old = _unpair(e.view(shape)) if "pair" in self.opts else e.view(shape)
                new = turn[0] @ old @ turn[1]
                e.copy_((_pair(new) if "pair" in self.opts else new).reshape(-1))
            got = (u, vh, self.it)
            self.bases[k] = got
        return got[0], got[1]

    def _bdiv(self, k: int) -> torch.Tensor | None:
        """bnorm: the root of the factored second moment of parameter ``k`` in its bases (flat), floored."""
        r, c = self.brows.get(k), self.bcols.get(k)
        if r is None:
            return None
        root = (torch.outer(r, c) / r.mean().clamp_min(1e-30)).sqrt().reshape(-1)
        return torch.maximum(root, self.floor * root.mean()).clamp_min(1e-20)

    def _sign(self, k: int, z: torch.Tensor) -> torch.Tensor:
        """block_sign of ``z``, its blocks taken in the order ``perm`` (where set) instead of row-major;
        bnorm: of ``z`` divided elementwise by :meth:`_bdiv`, multiplied back."""
        dn = self._bdiv(k) if self.bnorm is not None else None
        if self.snorm is not None:
            dn = self.sw.get(k)
        if dn is not None:
            return self._sign_plain(k, z / dn) * dn
        return self._sign_plain(k, z)

    def _sign_plain(self, k: int, z: torch.Tensor) -> torch.Tensor:
        perm = self.perm.get(k) if "rot" in self.opts else None
        if perm is None:
            return block_sign(z, self.block)
        out = torch.empty_like(z)
        out[perm] = block_sign(z[perm], self.block)
        return out

    def _error(self, table: dict, k: int, like: torch.Tensor) -> torch.Tensor:
        e = table.setdefault(k, torch.zeros_like(like))
        if self.decay is not None:
            e.mul_(self.decay)
        return e

    def __call__(self, _, bucket):
        W, it = dist.get_world_size(), self.it
        if bucket.is_last():
            self.it += 1
        params, grads = bucket.parameters(), bucket.gradients()
        ours = [i for i, p in enumerate(params) if id(p) in self.ids and it >= self.start]
        self._exact([g for i, g in enumerate(grads) if i not in ours], W)
        exact = None
        if self.comp is not None and ours:  # the oracle's exact averages of Muon's matrices
            exact = torch.cat([grads[i].reshape(-1).float() for i in ours])
            dist.all_reduce(exact)
            exact = exact.div_(W).split([grads[i].numel() for i in ours])
        if "subset" in self.opts and ours:  # plain DDP's averages over the first K ranks' batches only
            K = int(self.opts["subset"])
            flat = torch.cat([grads[i].reshape(-1).float() for i in ours])
            flat.mul_(1.0 / K if dist.get_rank() < K else 0.0)
            dist.all_reduce(flat)
            for i, part in zip(ours, flat.split([grads[i].numel() for i in ours]), strict=True):
                grads[i].copy_(part.view_as(grads[i]))
            ours_sent = []
        else:
            ours_sent = ours
        sent, scales, bases = [], [], {}
        if "proj" in self.opts and ours:
            coeffs = []
            for i in ours:
                k, shape = id(params[i]), params[i].shape
                m = self.m.get(k)
                if m is None or len(shape) != 2:
                    continue
                wide = shape[0] <= shape[1]
                m2 = m.view(shape) if wide else m.view(shape).T
                v = torch.linalg.svd(m2, full_matrices=False).Vh[: int(self.opts["proj"])]
                g2 = grads[i].float() if wide else grads[i].float().T
                c = g2 @ v.T
                bases[i] = (v, wide, c)
                coeffs.append(c.reshape(-1))
            if coeffs:
                flat_c = torch.cat(coeffs)
                dist.all_reduce(flat_c)
                flat_c.div_(W)
                sizes = [b[2].numel() for b in bases.values()]
                for i, part in zip(list(bases), flat_c.split(sizes), strict=True):
                    bases[i] = (*bases[i], part.view_as(bases[i][2]))
        for i in ours_sent:
            k, x = id(params[i]), grads[i].reshape(-1).float()
            if i in bases:  # the part outside the shared subspace
                v, wide, c, _ = bases[i]
                rest = c @ v
                x = x - (rest if wide else rest.T).reshape(-1)
            if self.pred is not None:
                x = x - self.pred * self.m.get(k, torch.zeros_like(x))
            d = self.rms.get(k) if "scale" in self.opts else None
            if self.fact is not None or self.elem is not None:
                d = self._factored(k, params[i].shape)
            if d is not None:
                x = x / d
            rot = self._basis(k, params[i].shape) if "rot" in self.opts else None
            if rot is not None:  # compressed in the shared momentum's singular bases, errors there too
                u, vh = rot
                x = u.T @ x.view(params[i].shape) @ vh.T
                x = (_pair(x) if "pair" in self.opts else x).reshape(-1)
            e = self._error(self.ew, k, x)
            z = x + e
            c = self._sign(k, z)
            e.copy_(z - c)
            sent.append(c)
            scales.append(d)
        if sent:
            flat = torch.cat(sent)
            dist.all_reduce(flat)
            flat.div_(W)
            for i, y, d in zip(ours, flat.split([grads[i].numel() for i in ours]), scales, strict=True):
                k = id(params[i])
                if "server" in self.opts:
                    es = self._error(self.es, k, y)
                    z = y + es
                    y = self._sign(k, z)
                    es.copy_(z - y)
                rot = self.bases.get(k) if "rot" in self.opts else None
                if rot is not None and self.bnorm is not None:  # the shared second moment in the bases
                    sq = y.view(params[i].shape).pow(2)
                    rm, cm = sq.mean(1), sq.mean(0)
                    r, c = self.brows.get(k), self.bcols.get(k)
                    b = self.bnorm
                    self.brows[k] = rm if r is None else r.mul_(b).add_(rm, alpha=1 - b)
                    self.bcols[k] = cm if c is None else c.mul_(b).add_(cm, alpha=1 - b)
                if rot is not None:  # back from the bases
                    yv = _unpair(y.view(params[i].shape)) if "pair" in self.opts else y.view(params[i].shape)
                    y = (rot[0] @ yv @ rot[1]).reshape(-1)
                if d is not None:
                    y = y * d
                if self.pred is not None:
                    y = y + self.pred * self.m.get(k, torch.zeros_like(y))
                if i in bases:  # the shared subspace's part, averaged exactly
                    v, wide, _, mean_c = bases[i]
                    part = mean_c @ v
                    y = y + (part if wide else part.T).reshape(-1)
                grads[i].copy_(y.view_as(grads[i]))
        if exact is not None:
            for i, x in zip(ours, exact, strict=True):
                k, y = id(params[i]), grads[i].reshape(-1).float()
                old_e, old_d = self.exact_m.get(k), self.m.get(k)
                me = (1 - MOMENTUM) * x if old_e is None else old_e * MOMENTUM + (1 - MOMENTUM) * x
                md = (1 - MOMENTUM) * y if old_d is None else old_d * MOMENTUM + (1 - MOMENTUM) * y
                self.exact_m[k] = me
                shape = params[i].shape
                ue, ud = x.lerp(me, MOMENTUM), y.lerp(md, MOMENTUM)  # (Muon's Nesterov updates)
                self.cosines.append(float((ue @ ud) / (ue.norm() * ud.norm()).clamp_min(1e-30)))
                oe, od = (_ns(u.view(shape)).float() for u in (ue, ud))
                share = float((od * oe).sum() / (oe * oe).sum().clamp_min(1e-30))
                self.ratios.append(share)
                self.scales[k] = min(max(1.0 / max(share, 1e-6), 1.0), self.comp)
        for i, p in enumerate(params):  # shared quantities, from the averages every rank holds
            if id(p) in self.ids:
                y = grads[i].reshape(-1).float()
                old = self.m.get(id(p))
                self.m[id(p)] = ((1 - MOMENTUM) * y if old is None
                                 else old.mul_(MOMENTUM).add_(y, alpha=1 - MOMENTUM))
                if self.comp is not None and i not in ours:  # (averaged exactly: the exact momentum too)
                    self.exact_m[id(p)] = self.m[id(p)].clone()
                if self.fact is not None and p.ndim == 2:
                    sq = y.view(p.shape).pow(2)
                    rm, cm = sq.mean(1), sq.mean(0)
                    r, c = self.rows.get(id(p)), self.cols.get(id(p))
                    self.rows[id(p)] = rm if r is None else r.mul_(self.fact).add_(rm, alpha=1 - self.fact)
                    self.cols[id(p)] = cm if c is None else c.mul_(self.fact).add_(cm, alpha=1 - self.fact)
                if self.elem is not None:
                    old_v = self.vs.get(id(p))
                    self.vs[id(p)] = (y * y if old_v is None
                                      else old_v.mul_(self.elem).addcmul_(y, y, value=1 - self.elem))
                ms = y.pow(2).mean()
                r = self.rms.get(id(p))
                self.rms[id(p)] = (ms if r is None else 0.99 * r.pow(2) + 0.01 * ms).sqrt().clamp_min(1e-12)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


def _pair(x: torch.Tensor) -> torch.Tensor:
    """The square block's pairs: (X_kl - X_lk) / sqrt 2 at (k, l) above the diagonal, (X_kl + X_lk) / sqrt 2
    at (l, k) below it; the diagonal and the rest as they are (an orthogonal map)."""
    r = min(x.shape)
    sq = x[:r, :r]
    up, lo = sq.triu(1), sq.tril(-1).T
    out = x.clone()
    out[:r, :r] = (up - lo) * 0.5**0.5 + ((up + lo) * 0.5**0.5).T + torch.diag(torch.diagonal(sq))
    return out


def _unpair(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pair`."""
    r = min(y.shape)
    sq = y[:r, :r]
    anti, sym = sq.triu(1), sq.tril(-1).T
    out = y.clone()
    out[:r, :r] = (anti + sym) * 0.5**0.5 + ((sym - anti) * 0.5**0.5).T + torch.diag(torch.diagonal(sq))
    return out


def _call(state: DiagHook, bucket):
    return state(None, bucket)


def _ns(u: torch.Tensor) -> torch.Tensor:
    """torch's Muon's orthogonalisation with its defaults."""
    from torch.optim import _muon

    abc = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    return _REAL_NS[0](u, abc, _muon.DEFAULT_NS_STEPS, _muon.EPS)


_REAL_NS: list = []


def _scale_muons_steps(hook: DiagHook, order: list[int]) -> None:
    """torch's Muon steps its matrices in group order, each through ``_zeropower_via_newtonschulz``: its
    output for the matrix ``order[i % len]`` multiplied by the hook's scale for it (``comp``)."""
    from torch.optim import _muon

    real, calls = _muon._zeropower_via_newtonschulz, [0]
    _REAL_NS.append(real)

    def scaled(update, *args, **kwargs):
        k = order[calls[0] % len(order)]
        calls[0] += 1
        return real(update, *args, **kwargs) * hook.scales.get(k, 1.0)

    _muon._zeropower_via_newtonschulz = scaled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diag", default="server")
    p.add_argument("--optimizer", default="muon", choices=["muon", "muon-plain"])
    known, rest = p.parse_known_args()
    text = (ROOT / "docs" / "hf-trainer.md").read_text()
    script = re.findall(r"```python\n(.*?)```", text, flags=re.S)[-1]
    line = "    callback = attach(trainer)  # the one onebit line\n"
    if line not in script:
        raise SystemExit("docs/hf-trainer.md's script changed: its attach line is not where this expects it")
    optimizer = "muon-plain" if not known.diag else known.optimizer
    script = script.replace(line, "    trainer.add_callback(_DIAG)\n")
    script = script.replace('if args.optimizer == "onebit-adam":\n    sent =', 'if False:\n    sent =')
    script = script.replace("callback.session.hook_state.stats()[\"bytes_compressed\"] if", "0 if")
    opts = dict(kv.split("=") if "=" in kv else (kv, "1") for kv in known.diag.split(",") if kv)
    from transformers import TrainerCallback

    class Register(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trainer = scope["trainer"]
            ids = {id(q) for q in scope["hidden"]}
            hook = DiagHook(ids, opts, int(opts.get("start", 2)))
            trainer.model_wrapped.register_comm_hook(hook, _call)
            self.hook = hook
            if hook.comp is not None:
                _scale_muons_steps(hook, [id(q) for q in scope["hidden"]])

        def on_train_end(self, args, state, control, **kwargs):
            hook = getattr(self, "hook", None)
            if hook is not None and hook.ratios and dist.get_rank() == 0:
                r = sorted(hook.ratios)
                print(f"diag share of plain's step: median {r[len(r) // 2]:.3f} p10 {r[len(r) // 10]:.3f} "
                      f"p90 {r[9 * len(r) // 10]:.3f}", flush=True)
                c = sorted(hook.cosines)
                print(f"diag cosine of the updates before Newton-Schulz: median {c[len(c) // 2]:.3f} "
                      f"p10 {c[len(c) // 10]:.3f} p90 {c[9 * len(c) // 10]:.3f}", flush=True)

    scope = {"__name__": "__main__", "_DIAG": Register()}
    sys.argv = [sys.argv[0], "--optimizer", optimizer, *rest]
    if not opts:  # plain DDP: the page's own muon-plain run
        scope["_DIAG"] = TrainerCallback()
    exec(compile(script, "hf-trainer.md", "exec"), scope)  # noqa: S102 - the docs page's own script


if __name__ == "__main__":
    main()
