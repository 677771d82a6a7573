"""The reference maths stays reachable, bitwise: ``compression="momentum", variance_floor=None,
auto_mask=None`` replays the trajectories saved before those switches existed
(tests/reference_trajectories.py wrote them at commit 273e339 with ``auto_mask=None``)."""

from __future__ import annotations

import pytest
import torch
from reference_trajectories import CASES, DATA, body

REFERENCE = dict(compression="momentum", variance_floor=None, auto_mask=None)


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_mode_replays_saved_trajectories_bitwise(ranks, name, W):
    saved = torch.load(DATA, weights_only=True)["runs"][f"{name}/W{W}"]  # [W, steps, numel]
    got = torch.stack(ranks(W).run(body, name, REFERENCE))
    assert got.shape == saved.shape
    for r in range(W):
        for t in range(saved.shape[1]):
            if not torch.equal(got[r, t], saved[r, t]):
                d = (got[r, t] - saved[r, t]).abs()
                raise AssertionError(
                    f"{name} W={W}: rank {r} differs from the saved reference after step {t + 1}: "
                    f"{int((d != 0).sum())} of {d.numel()} coordinates, largest by {float(d.max()):.3g}"
                )


@pytest.mark.parametrize("name", list(CASES))
def test_preconditioned_mode_leaves_the_reference(ranks, name):
    """Sanity of the test above: preconditioned compression (the default of OnebitAdam and
    ZeroOneAdam) takes another path, so the replay could fail."""
    saved = torch.load(DATA, weights_only=True)["runs"][f"{name}/W2"]
    mode = {"compression": "preconditioned", "variance_floor": 0.1, "auto_mask": None}
    got = torch.stack(ranks(2).run(body, name, mode))
    assert not torch.equal(got[:, -1], saved[:, -1])
