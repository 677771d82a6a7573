"""Deprecated public names (0.2.0 renamed them; they go in 0.3.0). CHANGELOG.md lists them.

``onebit_hook`` and ``onebit_comm_hook`` differed by one word and did different jobs: the
first compresses a DDP model's gradients for any optimizer, the second lets a 1-bit
optimizer's warm-up averaging run through DDP. Each old name still works and says, once per
process group, what it is called now.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.

import torch
import torch.distributed as dist

from ._group import warn_renamed
from .ddp_hook import OnebitCompressHookState, onebit_compress_hook


class OnebitHookState(OnebitCompressHookState):
    """Deprecated name of :class:`OnebitCompressHookState` (renamed in 0.2.0)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        warn_renamed("OnebitHookState", "onebit.collectives.OnebitCompressHookState", self.process_group)


def onebit_hook(state: OnebitCompressHookState,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Deprecated name of :func:`onebit_compress_hook` (renamed in 0.2.0)."""
    warn_renamed("onebit_hook", "onebit.collectives.onebit_compress_hook", state.process_group)
    return onebit_compress_hook(state, bucket)
