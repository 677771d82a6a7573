"""Training stays finite where coordinates have zero or tiny variance (issues 11 and 21).

A small model on generated data, W = 4 gloo ranks, a few hundred steps: a ReLU MLP whose
inputs include always-zero features and a feature with tiny, rare values, with hidden units
dead from initialisation, and an embedding table whose rows are mostly never used in
training (some of them appear in validation). The reference's maths (``compression=
"momentum", variance_floor=None, auto_mask=None``) turns the model to inf/NaN within a few
steps of compression (checked here to fail). The defaults (preconditioned compression with
the variance floor, docs/ALGORITHMS.md section 6; OnebitLamb's trust ratio from a sketch,
section 6.3) train like the uncompressed baseline and stop no coordinate; the older guard,
``auto_mask=0.5``, also trains but stops the masked coordinates for good.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS, FREEZE, LR = 240, 48, 2e-3


class Net(nn.Module):
    """Dense features (some always zero) and token ids (a few rows of a large table used)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(512, 16, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(32 + 16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 4))
        with torch.no_grad():
            self.mlp[0].bias[:16] = -50.0  # 16 units dead from the start: no gradient in or out

    def forward(self, x, ids):
        return self.mlp(torch.cat([x, self.emb(ids)], dim=1))


def make_data(n: int, seed: int, unseen: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    x[:, 24:] = 0.0  # 8 features that are always zero
    x[:, 23] *= 1e-4 * (torch.rand(n, generator=g) < 0.01)  # tiny and rare: tiny variance
    ids = torch.randint(0, 40, (n, 6), generator=g)  # rows 40..511 never used in training
    if unseen:  # validation: one id in six from rows 40..63, which training never sees
        ids[:, 5] = torch.randint(40, 64, (n,), generator=g)
    w = torch.randn(24, 4, generator=torch.Generator().manual_seed(99))
    e = torch.randn(64, 4, generator=torch.Generator().manual_seed(98))
    logits = x[:, :24] @ w + e[ids].mean(1) * 2
    return x, ids, logits.argmax(1)


def make_opt(name: str, params, kw: dict):
    from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

    if name == "adam":
        return OnebitAdam(params, lr=LR, freeze_step=math.inf)
    if name == "lamb":
        return OnebitLamb(params, lr=LR, freeze_step=math.inf)
    if name == "onebit_adam":
        return OnebitAdam(params, lr=LR, freeze_step=FREEZE, **kw)
    if name == "onebit_lamb":
        return OnebitLamb(params, lr=LR, freeze_step=FREEZE, **kw)
    return ZeroOneAdam(params, lr=LR, var_freeze_step=FREEZE, local_step_scaler=40, local_step_clipper=4,
                       **kw)


def _train(name: str, kw: dict) -> dict:
    from onebit.movement import MovementMeter

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(name, model.parameters(), kw)
    meter = MovementMeter(model.parameters())
    x, ids, y = make_data(2048, seed=1)
    xv, idsv, yv = make_data(1024, seed=2, unseen=True)
    g = torch.Generator().manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, STEPS + 1):
            i = torch.randint(0, len(y), (32,), generator=g)
            loss = F.cross_entropy(model(x[i], ids[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == FREEZE:
                meter.mark(step)
    with torch.no_grad():
        val = F.cross_entropy(model(xv, idsv), yv).item()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    mask_warnings = [str(w.message) for w in caught if "masks the compressed momentum" in str(w.message)]
    return {"val": val, "finite": finite, "stats": opt.stats(), "mask_warnings": mask_warnings, "rank": rank,
            "movement": meter.report()}


@pytest.fixture(scope="module")
def baselines(ranks):
    return {name: ranks(4).run(_train, name, {})[0] for name in ("adam", "lamb")}


# at least: 8 zero features x 48 live units, 16 dead units x (48 inputs + 1 bias + 64
# outputs), 472 unused rows x 16: their v is zero at the freeze
ZERO_VARIANCE = 8 * 48 + 16 * (48 + 1 + 64) + 472 * 16


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_defaults_train_like_the_baseline_and_stop_nothing(ranks, baselines, name):
    out = ranks(4).run(_train, name, {})
    base = baselines["lamb" if name == "onebit_lamb" else "adam"]
    for r in out:
        assert r["finite"] and math.isfinite(r["val"]), r
        assert r["stats"]["skipped_steps"] == 0, r["stats"]
        assert r["stats"]["masked_coordinates"] == 0 and not r["mask_warnings"], r["stats"]
        assert r["stats"]["floored_coordinates"] >= ZERO_VARIANCE, r["stats"]
        # every coordinate that moved before the freeze still moves (the baseline's own share
        # is the floor: a unit whose gradient stops)
        assert r["movement"]["stalled"] <= base["movement"]["stalled"], (r["movement"], base["movement"])
    assert all(r["val"] == out[0]["val"] for r in out)  # replicas identical
    assert out[0]["val"] < 1.1 * base["val"], (out[0]["val"], base["val"])


def test_default_lamb_stops_nothing(ranks, baselines):
    """OnebitLamb's default (trust ratio from a sketch, docs/ALGORITHMS.md 6.3): finite,
    identical replicas, no coordinate stops. Not yet within 10% of LAMB here (0.715 against
    0.597 on this seed, 1.294x over 3 seeds; three quarters of it the compression of a sparse
    momentum, one quarter the freeze at 20% of this short run: bench/HISTORY.md, "OnebitLamb on
    the zero-variance test model"). The bound catches a regression to the live ratio of the
    previous version (0.88)."""
    out = ranks(4).run(_train, "onebit_lamb", {})
    base = baselines["lamb"]
    for r in out:
        assert r["finite"] and math.isfinite(r["val"]) and r["stats"]["skipped_steps"] == 0, r
        assert r["stats"]["masked_coordinates"] == 0 and r["stats"]["floored_coordinates"] >= ZERO_VARIANCE
        assert r["movement"]["stalled"] <= base["movement"]["stalled"], (r["movement"], base["movement"])
    assert all(r["val"] == out[0]["val"] for r in out)
    assert out[0]["val"] < 1.4 * base["val"], (out[0]["val"], base["val"])


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_auto_mask_trains_but_stops_the_masked_coordinates(ranks, baselines, name):
    # OnebitLamb: the mask as it was its default, with momentum compression (the reference's)
    old = {"compression": "momentum", "variance_floor": None} if name == "onebit_lamb" else {}
    out = ranks(4).run(_train, name, {"auto_mask": 0.5, **old})
    base = baselines["lamb" if name == "onebit_lamb" else "adam"]
    for r in out:
        assert r["finite"] and math.isfinite(r["val"]), r
        assert r["stats"]["skipped_steps"] == 0, r["stats"]
        assert r["stats"]["masked_coordinates"] >= ZERO_VARIANCE, r["stats"]
        assert len(r["mask_warnings"]) == (1 if r["rank"] == 0 else 0), r["mask_warnings"]  # once per run
        assert r["movement"]["stalled"] > base["movement"]["stalled"], (r["movement"], base["movement"])
    assert all(r["val"] == out[0]["val"] for r in out)  # replicas identical
    assert out[0]["val"] < 1.1 * base["val"], (out[0]["val"], base["val"])


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_reference_behaviour_diverges(ranks, name):
    """The switches restore the reference's maths, which blows up on this model: the design
    above is what keeps it finite, not the model being easy."""
    out = ranks(4).run(_train, name, {"compression": "momentum", "variance_floor": None, "auto_mask": None})
    r = out[0]
    assert not (r["finite"] and r["val"] < 10.0 and r["stats"]["skipped_steps"] == 0), r
