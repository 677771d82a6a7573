"""Run every Triton kernel (under TRITON_INTERPRET=1) on buffers that end at an unmapped page.

The interpreter loads and stores at raw addresses, so a load or store past the end of a
buffer (or before its start) reads an unmapped guard page and the process dies with SIGSEGV,
as the kernel would fault on a GPU. tests/test_guard_pages.py runs this file in a child
process; each case is printed before it runs, so a crash names the case that caused it.

Found this way first on an H100: the block kernels' error pass read the block scale of bytes
past the end of the message in the last program when W did not divide the tile count.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import fast_interpreter  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from onebit.kernels import Layout, decompress, padded_numel, server_reduce, worker_compress  # noqa: E402
from onebit.kernels.layout import empty_message  # noqa: E402

fast_interpreter.install()  # (the interpreter's own patching skipped where it repeats itself)

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_KEEP: list[object] = []  # the mappings stay alive as long as their tensors


def guarded(src: torch.Tensor) -> torch.Tensor:
    """A copy of ``src`` whose last byte is followed (and whose first byte is preceded, a page
    away at most) by an unmapped page."""
    nbytes = src.numel() * src.element_size()
    pages = max(1, -(-nbytes // PAGE))
    mm = mmap.mmap(-1, (pages + 2) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for addr in (base, base + (pages + 1) * PAGE):
        if _libc.mprotect(addr, PAGE, 0) != 0:  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect failed")
    offset = (pages + 1) * PAGE - nbytes
    raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset))
    out = raw.view(src.dtype).view(src.shape)
    out.copy_(src)
    _KEEP.append(mm)
    return out


def run_case(n: int, W: int, block: int | None, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    x = guarded(torch.randn(n, generator=g).to(dtype))
    e = guarded(torch.randn(N, generator=g) * 0.1)
    msg = guarded(empty_message(layout, W, torch.device("cpu")).zero_())
    kw = dict(backend="triton", block=block)
    worker_compress(x, e, W, update_error=True, out=msg, **kw)
    worker_compress(x, e, W, update_error=False, out=msg, **kw)
    # the server: W received segments (here W copies of this rank's message) and its chunk's error
    received = guarded(msg.clone())
    se = guarded(torch.randn(N // W, generator=g) * 0.1)
    seg = guarded(empty_message(layout, 1, torch.device("cpu")).zero_())
    server_reduce(received, se, W, out=seg, **kw)
    # decompress: W gathered segments, with and without the deferred worker error update
    gathered = guarded(torch.cat([seg] * W))
    out = guarded(x.clone())
    decompress(gathered, out, W, **kw)
    decompress(gathered, out, W, worker_error=e, worker_message=msg, **kw)
    assert torch.isfinite(out.float()).all() and torch.isfinite(e).all() and torch.isfinite(se).all()


def run_fused_case(n: int, W: int, seed: int) -> None:
    """OnebitAdam's fused passes (kernels/fused/adam.py): every parameter's gradient,
    variance and data in a fenced buffer of its own, read through the address table."""
    from onebit.kernels.fused import adam
    from onebit.kernels.fused.table import Tiles, tiles

    g = torch.Generator().manual_seed(seed)
    N = padded_numel(n, W)
    layout = Layout(N, W)
    sizes = [s for s in (n // 3, 1, n - n // 3 - 1) if s > 0]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    grads = [guarded(torch.randn(s, generator=g)) for s in sizes]
    if len(grads) > 1:
        grads[1] = None  # a missing gradient: its address is 0 and must never be read
    variances = [guarded(torch.rand(s, generator=g)) for s in sizes]
    params = [guarded(torch.randn(s, generator=g)) for s in sizes]
    table = adam.table(offsets, sizes, "cpu")
    table.fill({"grad": grads, "var": variances, "param": params},
               [(0.9, 0.1, 0.999, -1e-3, 1.0, 0.05, 1.25, 1e-8)] * len(sizes))
    made = tiles(table, N)
    table.tiles = Tiles(guarded(made.lo), guarded(made.hi), *made.key)
    table.start, table.count = guarded(table.start), guarded(table.count)
    table.addr, table.scal = guarded(table.addr), guarded(table.scal)
    u = guarded(torch.randn(n, generator=g))
    e = guarded(torch.randn(N, generator=g) * 0.1)
    msg = guarded(empty_message(layout, W, torch.device("cpu")).zero_())
    adam.fold_worker(u, e, layout, msg, table)
    received = guarded(msg.clone())
    se = guarded(torch.randn(N // W, generator=g) * 0.1)
    seg = guarded(empty_message(layout, 1, torch.device("cpu")).zero_())
    server_reduce(received, se, W, out=seg, backend="triton")
    adam.decompress_update(guarded(torch.cat([seg] * W)), layout, u, e, msg, table, 1.0)
    assert torch.isfinite(u).all() and torch.isfinite(e).all()
    assert all(torch.isfinite(p).all() for p in params)


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]] or [1, 1000, 20001]
    worlds, blocks = (1, 3, 5, 7), (None, 8, 64, 4096)
    dtypes = (torch.float32, torch.bfloat16)
    for seed, (n, W, block, dtype) in enumerate(itertools.product(sizes, worlds, blocks, dtypes)):
        print(f"case n={n} W={W} block={block} dtype={dtype}", flush=True)
        run_case(n, W, block, dtype, seed)
    for seed, (n, W) in enumerate(itertools.product(sizes, worlds)):
        print(f"fused n={n} W={W}", flush=True)
        run_fused_case(n, W, seed)
    print("all cases ran", flush=True)


if __name__ == "__main__":
    main()
