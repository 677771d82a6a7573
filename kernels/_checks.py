"""Every argument check of the library, one helper per kind; each error names the argument.

The lowest layer (kernels) owns this module; collectives, optimizers and checkpoint import
it. Messages read ``"<name>: expected <what>, got <value>"`` and every check runs before
any buffer is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(
    name: str, value: object, low: int = 0, high: int | None = None, *, multiple_of: int = 1,
) -> int:
    """An int (not a bool) with ``low <= value`` (and ``value < high`` when given) that is a
    multiple of ``multiple_of``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and value % multiple_of == 0
    if ok and high is not None:
        ok = value < high
    if not ok:
        span = f">= {low}" if high is None else f"in [{low}, {high:_})"
        if multiple_of != 1:
            span += f" with N % {multiple_of} == 0"
        raise ValueError(f"{name}: expected an int {span}, got {value!r}")
    return value  # type: ignore[return-value]


def check_instance(name: str, value: object, cls: type | tuple[type, ...], what: str) -> object:
    """``isinstance(value, cls)``; ``what`` words the expected type (TypeError otherwise)."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def check_half_or_float(name: str, value: object) -> torch.dtype:
    """``value`` if it is torch.float32 or torch.bfloat16 (a buffer's storage format; else an error
    naming ``name``)."""
    check_instance(name, value, torch.dtype, "a torch.dtype")
    if value not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: expected torch.float32 or torch.bfloat16, got {value}")
    return value


def check_number(name: str, value: object, low: float = 0.0, high: float | None = None, *,
                 low_open: bool = False, optional: bool = False) -> float | None:
    """A real number (int or float, not a bool, not NaN) with ``low <= value < high``
    (``low < value`` with ``low_open``; no upper bound when ``high`` is None); None passes
    with ``optional``."""
    if optional and value is None:
        return None
    ok = _is_number(value) and (value > low if low_open else value >= low)  # NaN fails both
    if ok and high is not None:
        ok = value < high
    if not ok:
        if high is None:
            span = f"{'>' if low_open else '>='} {low:g}"
        else:
            span = f"in {'(' if low_open else '['}{low:g}, {high:g})"
        prefix = "None or " if optional else ""
        raise ValueError(f"{name}: expected {prefix}a number {span}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_fraction(name: str, value: object, *, optional: bool = False) -> float | None:
    """A number in [0, 1): decay rates (betas-like), ratios and relative bounds."""
    return check_number(name, value, 0.0, 1.0, optional=optional)


def check_betas(name: str, value: object) -> tuple[float, float]:
    """Two numbers in [0, 1) (Adam's betas)."""
    ok = isinstance(value, tuple | list) and len(value) == 2 and all(
        _is_number(b) and 0.0 <= b < 1.0 for b in value
    )
    if not ok:
        raise ValueError(f"{name}: expected two numbers in [0, 1), got {value!r}")
    return float(value[0]), float(value[1])  # type: ignore[index]


def check_choice(name: str, value: object, choices: Sequence[object]) -> object:
    """One of ``choices`` (compared with ==)."""
    if value not in choices:
        names = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}: expected one of {names}, got {value!r}")
    return value


def check_order(low_name: str, low: float, high_name: str, high: float) -> None:
    """Two bounds in order: ``low <= high``."""
    if low > high:
        raise ValueError(f"{low_name}: expected <= {high_name} ({high}), got {low}")


def check_tensor(
    name: str, t: object, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES, *, contiguous: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A dense (strided) torch.Tensor of one of ``dtypes``; contiguous and on ``device``
    when asked."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).removeprefix('torch.')}")
    if (contiguous and not t.is_contiguous()) or (device is not None and t.device != device):
        where = "" if device is None else f" on {device}"
        raise ValueError(f"{name}: expected a contiguous tensor{where}")
    return t


def check_buffer(
    name: str, t: object, device: torch.device, dtype: torch.dtype | tuple[torch.dtype, ...], *,
    length: int | None = None, at_least: int = 0, multiple_of: int = 1, what: str | None = None,
) -> torch.Tensor:
    """A flat, contiguous, in-place buffer of ``dtype`` (or one of a tuple) on ``device`` whose length is
    ``length`` (when given), else ``>= at_least`` and a multiple of ``multiple_of``. The
    length is tested after the type, so any object may be passed. ``what`` words the
    expected length in the message."""
    check_tensor(name, t, dtype if isinstance(dtype, tuple) else (dtype,))
    assert isinstance(t, torch.Tensor)
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (like tensor), got {t.device}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    n = t.numel()
    ok = n == length if length is not None else n >= at_least and n % multiple_of == 0
    if not ok:
        if what is None:
            what = f"length {length}" if length is not None else (
                f"length N >= {at_least} with N % {multiple_of} == 0")
        raise ValueError(f"{name}: expected {what}, got length {n}")
    return t


def check_world_size(world_size: object) -> int:
    return check_int("world_size", world_size, low=1)


def check_group(group: object) -> int:
    """A ProcessGroup this rank belongs to, or None (the default group); returns its size,
    1 when torch.distributed is not initialised and no group is given."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group: given, but torch.distributed is not initialised")
        return 1
    # new_group() hands non-members a sentinel (an int in torch 2.13), not a ProcessGroup
    if group is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0
    ):
        raise ValueError("group: this rank is not a member of the group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group)
