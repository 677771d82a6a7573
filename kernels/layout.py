"""Padding and the byte layout of the messages that carry sign bits and scales.

A message is ``W`` segments of ``segment_bytes`` bytes. Segment ``j`` holds the packed sign
bits of chunk ``j`` (``C/8`` bytes, element ``8k+i`` of the chunk in bit ``7-i`` of byte ``k``),
zero padding up to a multiple of 4 bytes, then one float32 scale. Keeping the scale inside the
segment lets one all-to-all and one all-gather move bits and scales together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_int


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest ``N >= numel`` with ``N % (8 * world_size) == 0`` (onebit's default padding)."""
    check_int("numel", numel, low=0)
    check_int("world_size", world_size, low=1)
    unit = 8 * world_size
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class Layout:
    """Sizes derived from the padded length ``N`` and the world size ``W``."""

    N: int
    W: int

    def __post_init__(self) -> None:
        if self.W < 1 or self.N < 0 or self.N % (8 * self.W):
            raise ValueError(f"N: expected a multiple of 8 * W = {8 * self.W}, got {self.N}")

    @property
    def C(self) -> int:
        """Chunk length in elements."""
        return self.N // self.W

    @property
    def chunk_bytes(self) -> int:
        return self.C // 8

    @property
    def scale_offset(self) -> int:
        """Byte offset of the float32 scale inside a segment (4-byte aligned)."""
        return -(-self.chunk_bytes // 4) * 4

    @property
    def segment_bytes(self) -> int:
        return self.scale_offset + 4

    @property
    def message_bytes(self) -> int:
        return self.W * self.segment_bytes


def empty_message(layout: Layout, segments: int, device: torch.device) -> torch.Tensor:
    """A message buffer of ``segments`` segments; the padding bytes are zero (never read)."""
    buf = torch.empty(segments * layout.segment_bytes, dtype=torch.uint8, device=device)
    if layout.scale_offset != layout.chunk_bytes:
        seg = buf.view(segments, layout.segment_bytes)
        seg[:, layout.chunk_bytes : layout.scale_offset].zero_()
    return buf


def message_bits(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """View ``[segments, C/8]`` (uint8) of the packed bits in a message buffer."""
    return buf.view(-1, layout.segment_bytes)[:, : layout.chunk_bytes]


def message_scales(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """View ``[segments]`` (float32) of the scales in a message buffer."""
    words = buf.view(torch.float32).view(-1, layout.segment_bytes // 4)
    return words[:, layout.scale_offset // 4]
