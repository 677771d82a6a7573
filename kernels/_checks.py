"""Argument checks shared by the public functions: each error names the argument."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).removeprefix('torch.')}")


def check_buffer(
    name: str, t: object, device: torch.device, dtype: torch.dtype, what: str, ok: bool | None = None
) -> None:
    """A flat, contiguous, in-place buffer of ``dtype`` on ``device``; ``ok`` is the length test."""
    check_tensor(name, t, (dtype,))
    assert isinstance(t, torch.Tensor)
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (like tensor), got {t.device}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if ok is not None and not ok:
        raise ValueError(f"{name}: expected {what}, got length {t.numel()}")


def check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    return world_size
