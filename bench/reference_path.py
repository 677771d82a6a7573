"""The reference implementation's local compute, as the literal chain of torch operations.

DeepSpeed 0.19.6's ``NcclBackend.compressed_allreduce`` (removed from DeepSpeed in 2026) needs
CuPy for ``packbits``/``unpackbits``; this module replays its sequence of float32 torch
operations with torch equivalents of those two (a multiply-and-sum pack, a shift-and-mask
unpack), allocating what it allocated, for the baseline column of bench/bench_kernels.py.
The collectives are simulated like the benchmark simulates them for onebit: this rank's
server step is fed W received chunks (here: W copies of its own chunk 0) and the final
unpack W gathered server chunks. tests/test_reference_path.py checks that the chain computes
docs/ALGORITHMS.md section 2, so the comparison is between equal maths.
"""

from __future__ import annotations

import math

import torch

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)
_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """cupy.packbits of a flat bool tensor (length a multiple of 8), most significant bit first."""
    return (bits.view(-1, 8).to(torch.uint8) * _WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpackbits(packed: torch.Tensor) -> torch.Tensor:
    """cupy.unpackbits: uint8 [n] -> uint8 [8n] of 0/1."""
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).flatten()


def reference_local(buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, W: int):
    """One rank's compute in the reference's order; returns the (unpadded) result."""
    original_size = buffer_m.numel()
    worker_error_size = worker_error.numel()
    buffer_m = buffer_m.flatten().float()
    if original_size != worker_error_size:
        empty_tensor = torch.zeros(worker_error_size - original_size, device=buffer_m.device)
        buffer_m = torch.cat([buffer_m, empty_tensor])
    buffer_m.add_(worker_error)
    worker_scale = torch.linalg.norm(buffer_m) / math.sqrt(buffer_m.numel())
    worker_error.set_(buffer_m - worker_scale * buffer_m.sign().add_(1).bool().float().add_(-0.5).mul_(2.0))
    sign_list_packed = packbits(buffer_m.sign_().add_(1).bool()).chunk(W)  # compress_by_chunk
    # all_to_all of the sign chunks and all_gather of the worker scales, simulated
    recvbuf_sign = torch.zeros([W, sign_list_packed[0].numel()], dtype=torch.uint8, device=buffer_m.device)
    recvbuf_sign.copy_(sign_list_packed[0].expand(W, -1))
    recvbuf_scale = worker_scale.expand(W).clone()
    unpacked_sign = unpackbits(recvbuf_sign.flatten()).reshape(W, -1).float()
    unpacked_sign = unpacked_sign.add_(-0.5).mul_(2.0)
    worker_scale = recvbuf_scale.mul_(1 / W).view(W, 1)
    compensated_server_m = unpacked_sign.mul_(worker_scale).sum(0)
    compensated_server_m.add_(server_error)
    server_scale = torch.linalg.norm(compensated_server_m) / math.sqrt(compensated_server_m.numel())
    server_error.set_(
        compensated_server_m
        - server_scale * compensated_server_m.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
    )
    server_sign_packed = packbits(compensated_server_m.sign_().add_(1).bool())
    # all_gather of the server signs and scales, simulated
    device = buffer_m.device
    recvbuf_sign_server = torch.zeros([W, server_sign_packed.numel()], dtype=torch.uint8, device=device)
    recvbuf_sign_server.copy_(server_sign_packed.expand(W, -1))
    recvbuf_scale_server = server_scale.expand(W).clone().view(W, 1)
    buffer_m.data.copy_(
        unpackbits(recvbuf_sign_server.flatten()).reshape(W, -1).float().add_(-0.5).mul_(2.0)
        .mul_(recvbuf_scale_server).flatten().data
    )
    return buffer_m[:original_size]
