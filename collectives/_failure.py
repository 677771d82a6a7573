"""CollectiveError: what a rank sees when a peer dies or hangs in the middle of a collective.

torch.distributed reports a lost peer (gloo: "Connection closed by peer") or a peer silent
for longer than the process group's timeout ("Timed out waiting ...") as a bare
RuntimeError from deep inside the transport. onebit re-raises it as CollectiveError, naming
the operation, this rank, the group size and what to do. The bound on the wait is the
process group's timeout: ``init_process_group(..., timeout=timedelta(seconds=...))`` or
``new_group(..., timeout=...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["CollectiveError", "guard"]


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank exited or did not answer within the group's timeout.

    The process group cannot be used any more. Every surviving rank sees this error (at the
    latest after the timeout); exit and restart all ranks from the last checkpoint.
    """


def _describe(group) -> str:
    try:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # the group itself may be gone
        return "a process group"
    return f"group rank {rank} of {size} ({backend})"


@contextmanager
def guard(operation: str, group) -> Iterator[None]:
    """Re-raise a transport failure inside the block as CollectiveError (chained)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError and gloo's plain errors
        raise CollectiveError(
            f"{operation}: the collective failed on {_describe(group)}: a peer rank exited or "
            f"did not answer within the process group's timeout (init_process_group(timeout=...)). "
            f"The group is unusable: exit and restart every rank from the last checkpoint. "
            f"Cause: {exc}"
        ) from exc
