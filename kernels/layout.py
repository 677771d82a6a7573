"""Padding and the byte layout of the messages that carry sign bits and scales.

A message is ``W`` segments of ``segment_bytes`` bytes. Segment ``j`` holds the packed sign
bits of chunk ``j`` (``C/8`` bytes, element ``8k+i`` of the chunk in bit ``7-i`` of byte ``k``),
zero padding up to a multiple of 4 bytes, then the float32 scales: one for the whole chunk
(``block=None``, the reference's format), or one per ``block`` consecutive elements of the
chunk (``C / block`` scales; block scales, docs/ALGORITHMS.md section 7). Keeping the scales
inside the segment lets one all-to-all and one all-gather move bits and scales together.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from functools import cached_property

import torch

from ._checks import check_int


def check_block(block: object) -> int | None:
    """None (one scale per chunk) or a positive multiple of 8 (elements per scale)."""
    if block is None:
        return None
    return check_int("block", block, low=8, multiple_of=8)


@functools.lru_cache(maxsize=64)
def inverse_world(world_size: int) -> float:
    """``1 / world_size`` rounded to float32 (as ``torch.tensor(1 / W, dtype=torch.float32)``; the server
    kernels' factor), without making a tensor and reading it back for every call."""
    return struct.unpack("f", struct.pack("f", 1.0 / world_size))[0]


def pad_unit(world_size: int, block: int | None = None) -> int:
    """What N must be a multiple of: ``8 * W``, or ``block * W`` with block scales."""
    return (8 if block is None else block) * world_size


def padded_numel(numel: int, world_size: int, block: int | None = None) -> int:
    """Smallest ``N >= numel`` with ``N % (8 * world_size) == 0`` (onebit's default padding);
    with ``block``, ``N % (block * world_size) == 0`` (every chunk holds whole blocks)."""
    check_int("numel", numel, low=0)
    check_int("world_size", world_size, low=1)
    unit = pad_unit(world_size, check_block(block))
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class Layout:
    """Sizes derived from the padded length ``N``, the world size ``W`` and ``block`` (each computed
    once: the passes read them several times per bucket and step)."""

    N: int
    W: int
    block: int | None = None

    def __post_init__(self) -> None:
        unit = pad_unit(self.W, self.block)
        if self.W < 1 or self.N < 0 or self.N % unit:
            what = "8 * W" if self.block is None else "block * W"
            raise ValueError(f"N: expected a multiple of {what} = {unit}, got {self.N}")

    @cached_property
    def C(self) -> int:
        """Chunk length in elements."""
        return self.N // self.W

    @cached_property
    def blocks(self) -> int:
        """Scales per chunk (1 without block scales)."""
        return 1 if self.block is None else self.C // self.block

    @cached_property
    def block_len(self) -> int:
        """Elements per scale."""
        return self.C if self.block is None else self.block

    @cached_property
    def chunk_bytes(self) -> int:
        return self.C // 8

    @cached_property
    def scale_offset(self) -> int:
        """Byte offset of the float32 scale inside a segment (4-byte aligned)."""
        return -(-self.chunk_bytes // 4) * 4

    @cached_property
    def segment_bytes(self) -> int:
        return self.scale_offset + 4 * self.blocks

    @cached_property
    def message_bytes(self) -> int:
        return self.W * self.segment_bytes


@functools.lru_cache(maxsize=1024)
def layout_of(N: int, W: int, block: int | None = None) -> Layout:
    """``Layout(N, W, block)``, made once per (N, W, block) and shared (it is immutable): its sizes are
    computed on first use and kept, where the hot paths need one per bucket and call."""
    return Layout(N, W, block)


def empty_message(layout: Layout, segments: int, device: torch.device) -> torch.Tensor:
    """A message buffer of ``segments`` segments; the padding bytes are zero (never read)."""
    buf = torch.empty(segments * layout.segment_bytes, dtype=torch.uint8, device=device)
    if layout.scale_offset != layout.chunk_bytes:
        seg = buf.view(segments, layout.segment_bytes)
        seg[:, layout.chunk_bytes : layout.scale_offset].zero_()
    return buf


def message_bits(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """View ``[segments, C/8]`` (uint8) of the packed bits in a message buffer."""
    if layout.segment_bytes == 0:  # N == 0 with block scales: no bits, no scales
        return buf.view(0, 0)
    S = layout.segment_bytes
    if buf.dim() != 1 or not buf.is_contiguous() or buf.numel() % S:
        raise ValueError(f"message_bits: expected a contiguous 1-D message of whole {S}-byte segments, "
                         f"got shape {tuple(buf.shape)}")
    # one op where view and slice take two (the hot paths call this per bucket and pass)
    return buf.as_strided((buf.numel() // S, layout.chunk_bytes), (S, 1))


def message_scales(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """View ``[segments]`` (float32) of the scales in a message buffer; with block scales
    ``[segments, C / block]``."""
    if layout.segment_bytes == 0:
        return buf.view(torch.float32).view(0, 0)
    S = layout.segment_bytes
    if buf.dim() != 1 or not buf.is_contiguous() or buf.numel() % S:
        raise ValueError(f"message_scales: expected a contiguous 1-D message of whole {S}-byte segments, "
                         f"got shape {tuple(buf.shape)}")
    words = buf.view(torch.float32)
    first = words.storage_offset() + layout.scale_offset // 4
    if layout.block is None:
        return words.as_strided((buf.numel() // S,), (S // 4,), first)
    return words.as_strided((buf.numel() // S, layout.blocks), (S // 4, 1), first)
