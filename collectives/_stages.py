"""The stages of one compressed_allreduce, written once.

Whatever schedules a call, it runs :meth:`Stages.encode` (this rank's message), the all-to-all,
:meth:`Stages.serve` (the segment of the chunk this rank serves, from the W messages it received), the
all-gather and :meth:`Stages.decode` (the gathered segments into the tensor, with the deferred worker
error), in this order; the schedules differ only in how the messages move and who waits: the
synchronous call (:func:`onebit.collectives.allreduce._compressed_allreduce`, over torch.distributed
or a caller's transport), the asynchronous one (:func:`onebit.collectives._async.start`: callbacks
on the transport's threads) and every rank in one process
(:func:`onebit.collectives.local.local_compressed_allreduce`). The sliced schedule
(:mod:`onebit.collectives._pipeline`) runs the same three stages per slice of every chunk, on the
kernels' pieces. A fused client's ``passes`` replace encode's and decode's compute with its own
(``passes.worker``, ``passes.finish``: :func:`onebit.collectives.allreduce.compressed_allreduce_passes`).

A bfloat16 worker error is widened to float32 once for the call (encode reads it, decode updates it)
and stored back after decode, rounded stochastically with the worker's scales
(:mod:`onebit.kernels.rounding`), except where the native codec takes it (one scale per chunk or
blocks of at most 4096) and for fused passes that say ``BFLOAT16_ERRORS``: they read and store it run
by run, bitwise the same; the server's, inside ``server_reduce``.
"""

from __future__ import annotations

import torch

from ..kernels import decompress, server_reduce, worker_compress
from ..kernels.api import own_bfloat16, takes_bfloat16_worker_error
from ..kernels.layout import Layout, empty_message, message_scales
from ..kernels.rounding import WORKER, narrow_, widen


def flat_target(tensor: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor whose final contents must end up in ``tensor``."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.contiguous().view(-1)


class Stages:
    """One call's stages on validated arguments (``layout``: its N, W and block). ``passes``: a fused
    client's worker and finish; ``backend``: the kernels' (None: the default); ``flat``: the flat
    contiguous values (default: ``tensor``'s, a copy where it is not contiguous)."""

    def __init__(self, tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                 layout: Layout, passes=None, backend: str | None = None, flat: torch.Tensor | None = None):
        self.tensor, self.server_error = tensor, server_error
        self.stored = worker_error  # the caller's buffer; self.worker_error: it in float32 for the call
        # (as it is where the fused passes read and store bfloat16 themselves)
        if worker_error.dtype == torch.float32:
            own = True
        elif passes is not None:
            own = own_bfloat16(passes)
        else:  # the native codec's passes read and store it run by run
            own = takes_bfloat16_worker_error(tensor.device, backend, layout)
        self.worker_error = worker_error if own else widen(worker_error)
        self.layout, self.passes, self.backend = layout, passes, backend
        self.flat = flat_target(tensor) if flat is None else flat
        self.msg: torch.Tensor | None = None

    def encode(self) -> torch.Tensor:
        """This rank's message: ``worker_compress(update_error=False)``, or the fused passes' (the
        message they built before the call where they have one: ``passes.ready(layout)``)."""
        layout, passes = self.layout, self.passes
        if passes is None:
            self.msg = worker_compress(self.flat, self.worker_error, layout.W, update_error=False,
                                       backend=self.backend, block=layout.block)
        elif getattr(passes, "ready", None) is not None:
            self.msg = passes.ready(layout)
        else:
            self.msg = empty_message(layout, layout.W, self.flat.device)
            passes.worker(self.flat, self.worker_error, layout, self.msg)
        return self.msg

    def serve(self, received: torch.Tensor) -> torch.Tensor:
        """The served chunk's segment from the W messages' parts this rank received."""
        return server_reduce(received, self.server_error, self.layout.W, backend=self.backend,
                             block=self.layout.block)

    def decode(self, gathered: torch.Tensor) -> None:
        """``decompress`` into the values (or the fused passes' finish), with the deferred worker error
        of :meth:`encode`'s message; then ``tensor`` from them where it is not contiguous."""
        layout, passes = self.layout, self.passes
        if passes is None:
            decompress(gathered, self.flat, layout.W, worker_error=self.worker_error, worker_message=self.msg,
                       backend=self.backend, block=layout.block)
        else:
            passes.finish(gathered, layout, self.flat, self.worker_error, self.msg)
        if self.stored is not self.worker_error:
            scales = message_scales(self.msg, layout)
            narrow_(self.stored, self.worker_error, scales, layout.block_len, WORKER)
        if not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view(self.tensor.shape))
