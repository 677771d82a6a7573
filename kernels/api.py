"""Public kernel functions: check arguments, allocate outputs, pick the implementation.

The backend comes from :func:`onebit.kernels.backends.select` (the ``codec`` step): CUDA tensors go
to the Triton kernels; CPU tensors to the native C codec (:mod:`onebit.kernels.native.codec`) at any
size where its library builds, else to the plain-torch path; ``use_backend`` and ``ONEBIT_BACKEND``
force one. ``backend`` overrides the choice for one call: "torch" (the
plain path, the reference), "native" (CPU tensors only; "compiled" is its former name,
deprecated), "triton" (on CPU tensors it needs ``TRITON_INTERPRET=1`` set before the first import
of :mod:`onebit.kernels.triton_kernels`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import backends, torch_kernels
from ._checks import check_buffer, check_choice, check_int, check_tensor, check_world_size
from ._warn import warn_user
from .layout import Layout, check_block, empty_message, layout_of, message_scales, pad_unit, padded_numel
from .native import codec as native
from .rounding import ERROR_DTYPES, SERVER, WORKER, narrow_, widen

_BACKENDS = (None, "torch", "native", "compiled", "triton")


def _backend(device: torch.device, backend: str | None, block: int | None = None,
             layout: Layout | None = None) -> ModuleType:
    """The codec module for a call: ``backend`` where given, else :func:`backends.select`'s choice
    for the ``codec`` step."""
    check_choice("backend", backend, _BACKENDS)
    if backend == "compiled":
        warn_user("onebit: backend='compiled' is now backend='native' (the C codec; the torch.compile "
                  "codec is gone); 'compiled' will be removed in the next release", FutureWarning)
        backend = "native"
    explicit = backend is not None
    if not explicit:
        chosen = backends.select(device, "codec").name
        backend = "torch" if chosen == "plain" else chosen
    if backend == "native":
        if device.type != "cpu":
            raise ValueError(f"backend: 'native' is the CPU codec, got tensors on {device}; "
                             "expected CPU tensors, or backend None/'triton'")
        return native if native.usable() else torch_kernels
    if backend == "torch":
        return torch_kernels
    if block is not None:
        from . import triton_blocks  # imported on first use: CPU-only users never need triton

        if triton_blocks.supported(block):
            return triton_blocks
        if explicit:
            raise ValueError(f"backend: the Triton kernels take block sizes that are powers of two from 8 "
                             f"to 4096, got block={block}; expected None or 'torch'")
        return torch_kernels  # any other multiple of 8: plain torch, on CUDA tensors too
    from . import triton_kernels

    return triton_kernels


def implementation(device: torch.device, block: int | None, layout: Layout) -> ModuleType:
    """The module the default choice runs a call of ``layout`` on (its ``worker_compress``,
    ``server_reduce`` and ``decompress`` take validated arguments and a Layout), for callers that
    split one call into pieces (onebit.collectives._pipeline) but want the whole call's choice."""
    return _backend(device, None, block, layout)


def _message_out(name: str, out: torch.Tensor | None, layout: Layout, segments: int, device):
    if out is None:
        return empty_message(layout, segments, device)
    size = segments * layout.segment_bytes
    check_buffer(name, out, device, torch.uint8, length=size, what=f"{size} bytes")
    return out


def _check_x(x: object) -> torch.Tensor:
    return check_tensor("x", x, contiguous=True)


def worker_compress(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    world_size: int = 1,
    *,
    update_error: bool = True,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Error-compensated 1-bit compression of ``x`` (worker side).

    ``z = pad(x, N) + worker_error``; ``scale = ||z|| / sqrt(N)``; the packed bits of
    ``sgn(z)`` (most significant bit first, bit 1 for +1) and ``scale`` go into a message of
    ``world_size`` segments (see :mod:`onebit.kernels.layout`), one per chunk of ``N/W``.
    With ``update_error``, ``worker_error <- z - scale*sgn(z)`` (skipped if ``scale`` is not
    finite). Returns the message (uint8, ``Layout(N, W).message_bytes``).

    Shapes: ``x`` float32/bfloat16/float16, contiguous, any shape, ``n`` elements;
    ``worker_error`` float32 or bfloat16 ``[N]``, ``N >= n``, ``N % (8*W) == 0`` (bfloat16: updated in
    float32 and stored with stochastic rounding, :mod:`onebit.kernels.rounding`).

    Example (16 elements, W = 1): ``x = [4, -4, 2, -2, 2, 0, -0., 2, -2, 2, -2, 2, 0, 0, -0., 0]``,
    zero error: scale 2.0, bytes ``[0xAF, 0x5F]``, new error
    ``[2, -2, 0, 0, 0, -2, -2, 0, 0, 0, 0, 0, -2, -2, -2, -2]``.

    ``block``: one scale per ``block`` elements of each chunk (``N % (block * W) == 0``); the
    message then carries ``C / block`` scales per segment (see :mod:`onebit.kernels.layout`).
    Same example with ``block=8``: the same bytes, scales ``[sqrt(6), sqrt(2)]`` (one per 8
    elements), new error ``z - scale_of_its_block * sgn(z)``.
    """
    x = _check_x(x)
    W = check_world_size(world_size)
    block = check_block(block)
    n = x.numel()
    check_buffer("worker_error", worker_error, x.device, ERROR_DTYPES, at_least=n,
                 multiple_of=pad_unit(W, block))
    layout = layout_of(worker_error.numel(), W, block)
    impl = _backend(x.device, backend, block, layout)
    msg = _message_out("out", out, layout, W, x.device)
    if layout.N:
        # the native codec reads a bfloat16 error as it is (it stores none here: update_error off)
        e = worker_error if not update_error and own_bfloat16(impl, layout) else widen(worker_error)
        impl.worker_compress(x.view(-1), e, layout, msg, update_error)
        if update_error:
            narrow_(worker_error, e, message_scales(msg, layout), layout.block_len, WORKER)
    return msg


def own_bfloat16(impl, layout: Layout | None = None) -> bool:
    """Whether ``impl`` reads and stores bfloat16 errors itself (run by run, bitwise the widened
    buffers' call), where the ``errors_in_pass`` route is on (:func:`onebit.kernels.backends.route`):
    fused passes (``layout`` None) by their ``BFLOAT16_ERRORS``, a codec module by its
    ``bfloat16_errors(layout)``."""
    if not backends.route("errors_in_pass"):
        return False
    if layout is None:
        return bool(getattr(impl, "BFLOAT16_ERRORS", False))
    own = getattr(impl, "bfloat16_errors", None)
    return own is not None and own(layout)


def takes_bfloat16_worker_error(device: torch.device, backend: str | None, layout: Layout) -> bool:
    """Whether a collective's encode (``update_error`` off) and decompress take a bfloat16 worker error
    as it is on ``device`` with ``backend`` (the native codec, blocks of at most 4096): else the caller
    widens it for the call (:mod:`onebit.collectives._stages`)."""
    return own_bfloat16(_backend(device, backend, layout.block, layout), layout)


def server_reduce(
    received: torch.Tensor,
    server_error: torch.Tensor,
    world_size: int,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Server side for one chunk: ``received`` holds W segments (one per rank, bits and scale).

    ``m = sum_r sgn_r * (s_r * (1/W)) + server_error``; ``s = ||m|| / sqrt(C)``; returns one
    segment with the packed ``sgn(m)`` and ``s``; ``server_error <- m - s*sgn(m)``. If any
    received scale or ``m`` is not finite, ``s`` is NaN and ``server_error`` is unchanged.
    ``server_error``: float32 or bfloat16 ``[C]``, ``C % 8 == 0`` (``C % block == 0`` with ``block``:
    then every block of the chunk has its own scale).
    """
    W = check_world_size(world_size)
    block = check_block(block)
    check_tensor("received", received, (torch.uint8,))
    device = received.device
    unit = 8 if block is None else block
    check_buffer("server_error", server_error, device, ERROR_DTYPES, multiple_of=unit,
                 what=f"a multiple of {unit}")
    layout = layout_of(server_error.numel() * W, W, block)
    size = layout.message_bytes
    check_buffer("received", received, device, torch.uint8, length=size, what=f"{size} bytes")
    seg = _message_out("out", out, layout, 1, device)
    if layout.N:
        impl = _backend(device, backend, block, layout)
        e = server_error if own_bfloat16(impl, layout) else widen(server_error)
        impl.server_reduce(received, e, layout, seg)
        if e is not server_error:
            narrow_(server_error, e, message_scales(seg, layout), layout.block_len, SERVER)
    return seg


def decompress(
    gathered: torch.Tensor,
    out: torch.Tensor,
    world_size: int,
    *,
    padded: int | None = None,
    worker_error: torch.Tensor | None = None,
    worker_message: torch.Tensor | None = None,
    backend: str | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Write ``s_j * sgn`` from ``gathered`` (W segments) into ``out`` (unpadded, its own dtype).

    ``padded`` is N (default ``padded_numel(out.numel(), W)``, or ``worker_error``'s length).
    With ``worker_error`` and ``worker_message`` (the message :func:`worker_compress` made with
    ``update_error=False`` from ``x`` = the current contents of ``out``), the deferred worker
    error update is applied first, and only when every scale in ``gathered`` is finite, so a
    non-finite value on any rank leaves every rank's error unchanged. ``block``: as for
    :func:`worker_compress`. Returns ``out``.
    """
    W = check_world_size(world_size)
    block = check_block(block)
    unit = pad_unit(W, block)
    check_tensor("gathered", gathered, (torch.uint8,))
    check_tensor("out", out, contiguous=True, device=gathered.device)
    n = out.numel()
    if worker_error is not None:
        check_buffer("worker_error", worker_error, out.device, ERROR_DTYPES, at_least=n, multiple_of=unit)
        padded = worker_error.numel()
    N = padded_numel(n, W, block) if padded is None else check_int("padded", padded, low=n, multiple_of=unit)
    layout = layout_of(N, W, block)
    size = layout.message_bytes
    check_buffer("gathered", gathered, out.device, torch.uint8, length=size, what=f"{size} bytes")
    if worker_error is not None:
        check_buffer("worker_message", worker_message, out.device, torch.uint8, length=size,
                     what=f"{size} bytes")
    if N:
        impl = _backend(out.device, backend, block, layout)
        own = worker_error is None or own_bfloat16(impl, layout)  # (stored rounded run by run)
        e = worker_error if own else widen(worker_error)
        impl.decompress(gathered, layout, out.view(-1), e, worker_message)
        if e is not worker_error:
            narrow_(worker_error, e, message_scales(worker_message, layout), layout.block_len, WORKER)
    return out
