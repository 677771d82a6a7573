"""Hook states whose hook never ran: said once at interpreter exit (a framework may have dropped
the hook without a word)."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref

import torch.distributed as dist


def rank_of(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def say_never_called() -> None:
    """At interpreter exit: if hook states are still alive whose hook never ran, say so once, on
    their group's rank 0 (a framework may have dropped the hook without a word: Lightning's
    ``DDPStrategy(ddp_comm_hook=...)`` registers nothing on CPU)."""
    unused = [s for s in list(LIVE) if s.iter == 0 and not s._warned_unused]
    for state in unused:
        state._warned_unused = True
    ranks = [s._rank if s._rank is not None else int(os.environ.get("RANK", "0")) for s in unused]
    if unused and 0 in ranks:
        warnings.warn(
            f"onebit: {len(unused)} OnebitCompressHookState(s) were built but onebit_compress_hook never "
            "ran with them, so no gradient was compressed: register the state with "
            "model.register_comm_hook(state, onebit_compress_hook) on the DistributedDataParallel model "
            "(Lightning registers DDPStrategy(ddp_comm_hook=...) on CUDA only: use onebit.integrations."
            "lightning.OnebitCallback; the Hugging Face Trainer: onebit.integrations.transformers.attach)",
            RuntimeWarning, stacklevel=1)
