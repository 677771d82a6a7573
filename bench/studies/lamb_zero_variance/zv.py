"""OnebitLamb vs LAMB on tests/test_zero_variance.py's model and data (4 gloo ranks).

Seed s: torch.manual_seed(s) before Net() (the init), rank r's batch generator seeded
100 + r + 1000*s; make_data's seeds are the test's (train 1, validation 2) unless
--data-offset, which adds s to both. s = 0 is exactly the test's run.

Variants are named NAME=JSON where JSON holds OnebitLamb kwargs plus study-only keys:
  "_lamb": true          the baseline, OnebitLamb(lr, freeze_step=inf)
  "_freeze": 96          freeze_step (default 48)
  "_floor": 2.0          variance_floor set after construction (bypasses the [0,1) check)
  "_exact": true         exact (full precision) all-reduce instead of compressed_allreduce
  "_trust": "exact"      trust ratio from the exact ||m*|| (diagnostic all-reduce of g/d)
            "live"       from ||u_avg|| (the decompressed buffer)
  "_livev": true         diagnostic: keep v updating with exact averaged grads after the freeze
                         and rescale u (u <- u * d_old/d_new) each step (extra all-reduce)
  "_cand": "..."         candidate fixes (see CANDIDATES below)
  "_layout": "tsort"     (needs block=B) the flat buffer is permuted once at the freeze before the
                         block-scaled compressed_allreduce (candidates.make_layout): "active" moves the
                         coordinates with frozen v == 0 to the end; "tsort" also sorts each tensor's
                         active coordinates by frozen v and starts each tensor on a block boundary;
                         "gsort" sorts all active coordinates by v across tensors
  "_edecay": 0.9         worker and server error buffers times 0.9 before each compressed all-reduce
  "_comp": {"scale": "l1", "seg": "block"}  (with block=B) the emulated all-reduce, one scale per block
Example:
  python zv.py --seeds 0 1 2 --variants lamb='{"_lamb":true}' default='{}' block8='{"block":8}'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

STEPS, FREEZE, LR = 240, 48, 2e-3
NAMES = ["emb.weight", "l0.w", "l0.b", "l1.w", "l1.b", "l2.w", "l2.b"]


def _make_cls():
    import candidates

    from onebit.optimizers import OnebitLamb

    class StudyLamb(OnebitLamb):
        """OnebitLamb with switches for the study (no library file is changed)."""

        study: dict = {}
        trace: list = []

        def _allreduce_mean(self, flat):
            dist.all_reduce(flat)
            return flat.div_(self.world_size)

        def _enter_compression(self):
            super()._enter_compression()
            s = self.study
            pairs = self.compressed_params()
            views = self.reducer().views
            if s.get("_exact"):
                red = self.reducer()

                def exact_mean_():
                    for b in red.buckets:
                        self._allreduce_mean(b.flat)

                red.compressed_mean_ = exact_mean_
            if s.get("_comp"):
                import candidates

                red = self.reducer()
                (b,) = red.buckets
                bounds = list(zip(b.offsets, b.numels, strict=False))
                red.allreduce = candidates.make_allreduce(s["_comp"]["scale"], s["_comp"]["seg"], bounds)
            if s.get("_layout"):
                import candidates

                red = self.reducer()
                (b,) = red.buckets
                assert list(b.indices) == list(range(len(pairs))) and red.block is not None
                vs = [self.state[p]["exp_avg_sq"] for p, _ in pairs]
                red.allreduce = candidates.make_layout(
                    red.allreduce, s["_layout"], vs, b.offsets, b.worker_error.numel(), red.block
                )
            if s.get("_edecay") is not None:
                import candidates

                red = self.reducer()
                red.allreduce = candidates.make_decay(red.allreduce, float(s["_edecay"]))
            self._mstar = [views[k].clone() for k in range(len(pairs))]
            self._dlive = [self.stale_denominator(k, p, g).clone() for k, (p, g) in enumerate(pairs)]

        def _exact_grads(self, pairs):
            """Diagnostic: the exact averaged gradients (an extra full-precision all-reduce)."""
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p, _ in pairs]
            )
            gbar = self._allreduce_mean(flat.clone())
            gs, off = [], 0
            for p, _ in pairs:
                gs.append(gbar[off : off + p.numel()].view_as(p))
                off += p.numel()
            return gs

        def _preconditioned_step(self, reducer, pairs):
            s = self.study
            trust = s.get("_trust", "sketch")
            views = reducer.views
            gs = None
            if s.get("_livev") or trust in ("exact", "live") or s.get("_track") or s.get("_cand"):
                gs = self._exact_grads(pairs)
            if s.get("_livev"):
                for k, (p, g) in enumerate(pairs):
                    v = self.state[p]["exp_avg_sq"]
                    b2 = g["betas"][1]
                    v.mul_(b2).addcmul_(gs[k], gs[k], value=1 - b2)
                old = [self.stale_denominator(k, p, g).clone() for k, (p, g) in enumerate(pairs)]
                self._variance_changed()
                for k, (p, g) in enumerate(pairs):
                    new = self.stale_denominator(k, p, g)
                    views[k].mul_(old[k] / new)  # keep m = u * d continuous (errors left as they are)
                    self._mstar[k].mul_(old[k] / new)
            if gs is not None:
                for k, (p, g) in enumerate(pairs):
                    d = self.stale_denominator(k, p, g)
                    self._mstar[k].mul_(g["betas"][0]).add_(gs[k] / d, alpha=1.0 - g["betas"][0])
            if trust == "sketch":
                coeffs = self._step_body(reducer, pairs)
            else:
                coeffs = []
                for k, (p, g) in enumerate(pairs):
                    b1, d = g["betas"][0], self.stale_denominator(k, p, g)
                    gd = p.grad / d if p.grad is not None else torch.zeros_like(views[k])
                    views[k].mul_(b1).add_(gd, alpha=1.0 - b1)
                reducer.compressed_mean_()
                for k, (p, g) in enumerate(pairs):
                    u = views[k]
                    est = torch.linalg.vector_norm(u if trust == "live" else self._mstar[k])
                    coeffs.append(candidates.sketched_step(self, p, u, est, g))
            self._record(pairs, self._applied(views), coeffs)
            return coeffs

        def _step_body(self, reducer, pairs):
            return super()._preconditioned_step(reducer, pairs)

        def _applied(self, views):
            return views

        def _warmup_step(self, reducer, pairs):
            coeffs = super()._warmup_step(reducer, pairs)
            self._record(pairs, reducer.views, coeffs)
            return coeffs

        def _record(self, pairs, views, coeffs):
            row = {"c": [float(c) for c in coeffs], "pn": [float(p.detach().norm()) for p, _ in pairs]}
            if not self.compressing or self.updates <= self.frozen_at:
                # warm-up: ||m / (sqrt v + eps)||
                row["un"] = [
                    float((views[k] / (self.state[p]["exp_avg_sq"].sqrt() + 1e-8)).norm())
                    for k, (p, _) in enumerate(pairs)
                ]
            else:
                row["un"] = [float(views[k].norm()) for k in range(len(pairs))]
                if (
                    self.study.get("_trust") in ("exact", "live")
                    or self.study.get("_cand")
                    or self.study.get("_track")
                ):
                    row["mn"] = [float(m.norm()) for m in self._mstar]
                    row["rel"] = [
                        float((views[k] - self._mstar[k]).norm() / self._mstar[k].norm())
                        for k in range(len(pairs))
                    ]
                b = self.reducer().buckets[0]
                row["we"] = float(b.worker_error.norm())
                row["se"] = float(b.server_error.norm())
                off, wek, rho = 0, [], []
                for k, (p, _) in enumerate(pairs):
                    e = b.worker_error[off : off + p.numel()]
                    wek.append(float(e.norm()))
                    if hasattr(self, "_mstar"):
                        z = self._mstar[k].reshape(-1)
                        rho.append(float(z.abs().sum() / (z.norm() * z.numel() ** 0.5 + 1e-30)))
                    off += p.numel()
                row["wek"], row["rho"] = wek, rho
                if hasattr(self, "_mstar"):
                    z = torch.cat([m.reshape(-1) for m in self._mstar])
                    row["rho_all"] = float(z.abs().sum() / (z.norm() * z.numel() ** 0.5))
            self.trace.append(row)

    return StudyLamb


def _train(name: str, spec: dict, seed: int, data_offset: bool, keep: str | None) -> dict:
    import candidates  # noqa: F401  (registers candidate fixes)
    from test_zero_variance import Net, make_data

    from onebit.movement import MovementMeter

    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = Net()
    init = [p.detach().clone() for p in model.parameters()]
    cls = _make_cls()
    cls = candidates.wrap(cls, spec.get("_cand"))
    kw = {k: v for k, v in spec.items() if not k.startswith("_")}
    freeze = math.inf if spec.get("_lamb") else spec.get("_freeze", FREEZE)
    opt = cls(model.parameters(), lr=LR, freeze_step=freeze, **kw)
    opt.study = spec
    opt.trace = []
    if "_floor" in spec:
        opt.variance_floor = spec["_floor"]
    meter = MovementMeter(model.parameters())
    off = seed if data_offset else 0
    x, ids, y = make_data(2048, seed=1 + off)
    xv, idsv, yv = make_data(1024, seed=2 + off, unseen=True)
    xs, idss, ys = make_data(1024, seed=2 + off, unseen=False)
    g = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    mark = FREEZE  # the test marks at 48 whatever the freeze
    curve = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            opt.zero_grad()  # (the test zeroes after the forward: the same gradients)
            i = torch.randint(0, len(y), (32,), generator=g)
            F.cross_entropy(model(x[i], ids[i]), y[i]).backward()
            opt.step()
            meter.mark(step) if step == mark else None
            if step % 24 == 0 and rank == 0:
                with torch.no_grad():
                    curve.append(round(F.cross_entropy(model(xv, idsv), yv).item(), 4))
    with torch.no_grad():
        val = F.cross_entropy(model(xv, idsv), yv).item()
        val_seen = F.cross_entropy(model(xs, idss), ys).item()
        emb = model.emb.weight
        saved = emb[40:].clone()
        emb[40:] = init[0][40:]
        val_reset = F.cross_entropy(model(xv, idsv), yv).item()
        emb[40:] = saved
        unseen_drift = float((emb[40:] - init[0][40:]).norm())
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    identical = all(bool(torch.equal(t, gathered[0])) for t in gathered)
    st = opt.stats()
    out = {
        "name": name,
        "seed": seed,
        "val": val,
        "val_seen": val_seen,
        "val_reset_unseen": val_reset,
        "unseen_drift": unseen_drift,
        "finite": finite,
        "identical": identical,
        "movement": meter.report(),
        "curve": curve,
        "stats": {
            k: st.get(k)
            for k in ("skipped_steps", "masked_coordinates", "floored_coordinates", "frozen_at", "updates")
        },
    }
    if rank == 0 and keep:
        torch.save(
            {
                "params": [p.detach().clone() for p in model.parameters()],
                "init": init,
                "trace": opt.trace,
                "out": out,
            },
            keep,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", required=True, help="NAME=JSON")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--data-offset", action="store_true")
    ap.add_argument("--keep", default=None, help="folder: save rank 0's params and trace per run")
    ap.add_argument("--jsonl", default="results.jsonl")
    args = ap.parse_args()
    import zv
    from dist_pool import RankPool

    pool = RankPool(4, timeout=900)
    try:
        for item in args.variants:
            name, _, js = item.partition("=")
            spec = json.loads(js) if js else {}
            vals = []
            for s in args.seeds:
                t0 = time.time()
                keep = os.path.join(args.keep, f"{name}-s{s}.pt") if args.keep else None
                if keep:
                    os.makedirs(args.keep, exist_ok=True)
                outs = pool.run(zv._train, name, spec, s, args.data_offset, keep)
                r = outs[0]
                same = all(o["val"] == r["val"] for o in outs) and all(o["identical"] for o in outs)
                r["replicas_identical"] = same
                r["spec"] = spec
                r["seconds"] = round(time.time() - t0, 1)
                vals.append(r["val"])
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(
                    f"{name} seed {s}: val {r['val']:.4f} (seen-only {r['val_seen']:.4f}, unseen rows reset "
                    f"{r['val_reset_unseen']:.4f}, unseen drift {r['unseen_drift']:.3f}) stalled "
                    f"{r['movement']['stalled']} finite {r['finite']} identical {same} stats {r['stats']} "
                    f"[{r['seconds']}s]",
                    flush=True,
                )
            print(f"== {name}: mean {sum(vals) / len(vals):.4f} over seeds {args.seeds}", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
