"""Per-rank checkpoints written atomically: a temporary file, fsync, then rename.

A reader never sees a half-written file under the final name, so a checkpoint interrupted
mid-write is never loaded. Files hold tensors, numbers and strings only:
``torch.load(..., weights_only=True)`` reads them and runs no code.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch


def checkpoint_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank:05d}.pt")


def save_atomic(obj: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load(path: str) -> dict[str, Any]:
    with open(path, "rb") as fh:
        return torch.load(fh, weights_only=True, map_location="cpu")


def fingerprint(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal fingerprints mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
