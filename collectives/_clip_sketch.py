"""The hooks' clip norm in compressed iterations (docs/ALGORITHMS.md 8.2): count sketches of each rank's own
gradient, taken by the hook before any pass writes a compressed bucket, whose all-reduce estimates the
norm of the ranks' mean gradient (what plain DDP clips by). Used by the DDP hook state and the FSDP hooks;
:func:`onebit.collectives._frozen_adam.clip_agreed` reads it."""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.sketch import SketchHash, add_sums_

# a power of two near numel / 256 (the sketch's bytes about 1.6% of the elements', 4% of a 1.5-bit step's
# wire), within [CLIP_SKETCH_MIN, CLIP_SKETCH]; the squared norm's relative standard deviation is at most
# sqrt(2 / size): 2.2% at 4096, 8.8% at 256 (the norm's about half that)
CLIP_SKETCH = 4096
CLIP_SKETCH_MIN = 256


def clip_sketch_size(numel: int) -> int:
    """The clip sketch's size for a model of ``numel`` elements (see ``CLIP_SKETCH``)."""
    size = 1 << max(0, (numel // 256).bit_length() - 1)
    return min(CLIP_SKETCH, max(CLIP_SKETCH_MIN, size))


def _ints(x):
    """The ints of ``x`` (an int or tuples of them), depth first."""
    if isinstance(x, int):
        yield x
    else:
        for y in x:
            yield from _ints(y)


class ClipSketch:
    """One iteration's sketch: off until the clip is first asked for (:meth:`start`); then each compressed
    parameter's gradient is sketched with its own hash, drawn from ``rounds`` (the iterations begun since
    the clip was first asked for) and its name, alike on every rank and after a resume; the parameters'
    signed buckets' sums (``2 * size`` float32 each, kept until the clip) are added in the order of their
    names (:meth:`sums`), so that neither the hash nor the rounding depends on how the parameters fall into
    buckets (a fresh DDP's first buckets after a resume are not the run's). ``covered`` holds the ids of
    the parameters sketched, whose gradients the hook handed over compressed."""

    def __init__(self) -> None:
        self.clips = False
        self.size = CLIP_SKETCH
        self.rounds = 0
        self.parts: dict = {}  # name -> its signed buckets' sums, this iteration
        self.covered: set[int] = set()

    def start(self, numel: int) -> None:
        """The clip was asked for: sketch from the next compressed bucket on, ``numel`` the model's size."""
        if not self.clips:
            self.clips, self.size = True, clip_sketch_size(numel)

    def begin(self) -> None:
        """A new iteration: nothing sketched yet."""
        self.parts, self.covered = {}, set()
        if self.clips:
            self.rounds += 1

    def sums(self) -> torch.Tensor | None:
        """This iteration's signed buckets' sums over every parameter sketched, added in the order of
        their names; None where none was."""
        if not self.parts:
            return None
        return torch.stack([self.parts[name] for name in sorted(self.parts)]).sum(0)

    def add(self, buffer: torch.Tensor, pieces, params=()) -> None:
        """Sketch ``pieces`` of ``buffer`` (``(name, lo, n)``: a parameter's ``n`` elements from ``lo``,
        ``name`` ints nested in tuples) before any pass writes it; ``params``: those parameters (covered)."""
        if not self.clips:
            return
        for name, lo, n in pieces:
            seed = self.rounds
            for v in _ints(name):  # FNV-1a over the words
                seed = ((seed ^ (v & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
            sums = torch.zeros(2 * self.size, dtype=torch.float32, device=buffer.device)
            self.parts[tuple(_ints(name))] = add_sums_(sums, buffer.detach()[lo:lo + n],
                                                       SketchHash(n, self.size, seed), "clip")
        self.covered.update(id(p) for p in params)

    def state(self) -> dict[str, Any]:
        return {"clips": self.clips, "size": self.size, "rounds": self.rounds}

    def load(self, state: dict[str, Any] | None) -> None:
        """A saved :meth:`state` (None: one from before the sketch: off)."""
        state = state or {}
        self.clips = bool(state.get("clips", False))
        self.size = int(state.get("size", CLIP_SKETCH))
        self.rounds = int(state.get("rounds", 0))
        self.parts, self.covered = {}, set()
