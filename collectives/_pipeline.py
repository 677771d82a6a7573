"""compressed_allreduce with block scales on CPU (gloo), in slices whose compute overlaps the wire.

Unsliced, each rank compresses, then waits on the all-to-all, reduces its chunk, then waits on
the all-gather, then decompresses: on a slow link the CPU idles while the bytes move and the
link idles while the CPU works. Here the chunk of every rank is cut into ``K`` slices of ``c``
elements (slice ``k`` of chunk ``j``: elements ``j*C + k*c`` to ``j*C + (k+1)*c``), and:

1. for each slice: compress its W pieces into one message (segment ``j`` for server ``j``, as
   ``Layout(W*c, W, block)`` lays it out) and start its all-to-all; the next slice is compressed
   while this one is on the wire;
2. once every all-to-all is in: for each slice, the server's reduction of its ``c`` elements
   (``server_error[k*c:(k+1)*c]``), then its all-gather starts; the previous slice decompresses
   while this one is on the wire.

With block scales every scale covers ``block`` elements inside one piece, so each element gets
bitwise the values of the unsliced call, and each error buffer element stays where the unsliced
call keeps it (server ``j`` serves elements ``j*C`` to ``(j+1)*C`` in both): slicing is an
order of work, not another format (tests/test_pipeline.py). Without block scales the worker's
scale covers the whole tensor and the server's its whole chunk, so the call is not sliced.

Non-finite input: every rank's non-finite input shows as non-finite scales in its messages, all
of which every server holds after step 1; then every server sends NaN scales for every slice,
no error buffer changes and the result is NaN on every rank, as unsliced. (A server whose own
sum overflows a float32 in one slice, with every input finite, NaNs that slice alone.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..kernels.api import implementation, own_bfloat16
from ..kernels.layout import Layout, empty_message, message_scales
from ._failure import guard
from ._group import all_gather_single
from .telemetry import CallTimer

MIN_PIECE = 1 << 18  # elements of one rank's chunk per slice, at least (smaller: not sliced)
MAX_SLICES = 2  # slices per call, at most (2 to 8 measured: bench/RESULTS.md, "compressed_allreduce")


def slices(layout: Layout) -> int:
    """How many slices a call of ``layout`` takes (1: not sliced): block scales only, pieces of
    whole blocks and whole 4-byte words of bits, each at least MIN_PIECE elements."""
    if layout.block is None or layout.W < 2:
        return 1
    unit = math.lcm(layout.block, 32)
    return max(1, min(MAX_SLICES, layout.C // max(unit, MIN_PIECE)))


def piece_length(layout: Layout, K: int) -> int:
    """``c``: the elements of each rank's chunk in one slice (the last slice may hold fewer)."""
    unit = math.lcm(layout.block, 32)
    return -(-layout.C // K // unit) * unit


def takes(worker_error: torch.Tensor, server_error: torch.Tensor, layout: Layout) -> bool:
    """Whether the sliced call takes these error buffers as they are: float32, or bfloat16 where the
    codec reads and stores it itself (the native C, blocks of at most 4096: each slice's rounding keyed
    by its elements' places in the whole buffers, so the bits are the unsliced call's)."""
    if worker_error.dtype == server_error.dtype == torch.float32:
        return True
    impl = implementation(worker_error.device, layout.block, layout)
    return own_bfloat16(impl, layout)


def allreduce(flat: torch.Tensor, worker_error: torch.Tensor,
              server_error: torch.Tensor, group, layout: Layout, K: int) -> torch.Tensor:
    """The sliced call on validated arguments (``flat``: the contiguous values, written back to
    ``tensor`` by the caller); returns every server scale (a copy, slice by slice)."""
    W, C, n, block = layout.W, layout.C, flat.numel(), layout.block
    c = piece_length(layout, K)
    spans = [(k * c, min(C, (k + 1) * c)) for k in range(K) if k * c < C]
    subs = [Layout(W * (hi - lo), W, block) for lo, hi in spans]  # slice k's message layout
    impl = implementation(flat.device, block, layout)
    # a bfloat16 error's rounding reads each slice's place in its buffer (the native codec's offset)
    narrow_w, narrow_s = (e.dtype != torch.float32 for e in (worker_error, server_error))
    timer = CallTimer(flat.device)
    msgs, recvs, a2a = [], [], []
    for (lo, hi), sub in zip(spans, subs, strict=True):  # 1. compress; all-to-all while the next compresses
        with timer.stage("codec"):
            msg = empty_message(sub, W, flat.device)
            segs = msg.view(W, sub.segment_bytes)
            one = Layout(hi - lo, 1, block)
            for j in range(W):
                a, b = j * C + lo, j * C + hi
                impl.worker_compress(flat[min(a, n):min(b, n)], worker_error[a:b], one, segs[j], False)
            scales = message_scales(msg, sub)
            if not bool(torch.isfinite(scales).all()):  # as unsliced: one non-finite block, every scale
                scales.fill_(float("nan"))
            recv = torch.empty_like(msg)
        with guard("compressed_allreduce (all_to_all)", group):
            a2a.append(dist.all_to_all_single(recv, msg, group=group, async_op=True))
        msgs.append(msg)
        recvs.append(recv)
    with timer.stage("comm"), guard("compressed_allreduce (all_to_all)", group):
        for work in a2a:
            work.wait()
    finite = all(bool(torch.isfinite(message_scales(r, sub)).all())
                 for r, sub in zip(recvs, subs, strict=True))
    gathered, ag = [], []

    def finish(k: int) -> None:  # wait for slice k's all-gather, then decompress its W pieces
        with timer.stage("comm"), guard("compressed_allreduce (all_gather)", group):
            ag[k].wait()
        with timer.stage("codec"):
            lo, hi = spans[k]
            one = Layout(hi - lo, 1, block)
            segs, mine = gathered[k].view(W, -1), msgs[k].view(W, -1)
            for j in range(W):
                a, b = j * C + lo, j * C + hi
                at = {"offset": a} if narrow_w else {}
                impl.decompress(segs[j], one, flat[min(a, n):min(b, n)], worker_error[a:b], mine[j], **at)

    for k, ((lo, hi), sub) in enumerate(zip(spans, subs, strict=True)):  # 2. serve; all-gather while the
        with timer.stage("codec"):                                            # previous slice decompresses
            seg = empty_message(sub, 1, flat.device)
            if finite:
                at = {"offset": lo} if narrow_s else {}
                impl.server_reduce(recvs[k], server_error[lo:hi], sub, seg, **at)
            else:  # some rank's input was not finite: NaN for every slice, no error changes
                message_scales(seg, sub).fill_(float("nan"))
            out = torch.empty_like(msgs[k])
        with guard("compressed_allreduce (all_gather)", group):
            ag.append(all_gather_single(out, seg, group, async_op=True))
        gathered.append(out)
        if k:
            finish(k - 1)
    finish(len(spans) - 1)
    return torch.cat([message_scales(g, sub).reshape(-1) for g, sub in zip(gathered, subs, strict=True)])
