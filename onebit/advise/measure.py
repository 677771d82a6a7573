"""The advisor's measurements, run on every rank of a process group (collectives: every rank
of the group must call the same functions with the same arguments).

Per message size: ``torch.distributed.all_reduce`` in float32 and bf16, ``compressed_allreduce``
end to end with its collectives' share (telemetry), and its compute stages (encode, server
reduce, decode) timed locally without communication. Every timing is the median over
repeats of the slowest rank's time (a MAX all-reduce per repeat), so all ranks see the same
numbers and take the same decisions; a size whose call would take longer than the budget
(extrapolated from the previous size) is not run and is left to the model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..collectives import compressed_allreduce, padded_numel, traffic
from ..collectives.wire import compressed_bytes
from ..kernels import decompress, server_reduce, worker_compress

__all__ = ["Row", "measure_hierarchical", "measure_link", "measure_step", "sweep_sizes"]


@dataclass
class Row:
    """One message size on one link: seconds per call (None: not run, over the budget)."""

    n: int
    wire: int  # bytes one rank sends in a compressed call
    float32: float | None = None
    bf16: float | None = None
    onebit: float | None = None
    comm: float | None = None  # the compressed call's all-to-all + all-gather
    encode: float = 0.0
    server: float = 0.0
    decode: float = 0.0
    skipped: list[str] = field(default_factory=list)

    @property
    def codec(self) -> float:
        return self.encode + self.server + self.decode


def sweep_sizes(params: int | None, low: int = 1 << 10, high: int = 1 << 24) -> list[int]:
    """Powers of 4 from ``low`` up to ``params`` (or ``high``), and ``params`` itself."""
    top = high if params is None else params
    sizes = []
    n = low
    while n < top:
        sizes.append(n)
        n *= 4
    sizes.append(top)
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(values: list[float], group, device: torch.device) -> list[float]:
    """Each value's maximum over the group's ranks (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _timed(fn: Callable[[], object], group, device: torch.device, repeats: int,
           extra: Callable[[], float] | None = None) -> tuple[float, float | None]:
    """Median over ``repeats`` (after one warm-up call) of the slowest rank's seconds per call;
    with ``extra``, also the median of the slowest rank's ``extra()`` delta over each call."""
    fn()
    _sync(device)
    times, extras = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        before = extra() if extra else 0.0
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if extra:
            extras.append(extra() - before)
    slow = _slowest(times + extras, group, device)
    med = statistics.median(slow[:repeats])
    return med, (statistics.median(slow[repeats:]) if extra else None)


def _local(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _comm_seconds() -> float:
    traffic.resolve()
    return traffic.comm_seconds


def measure_link(group, sizes: list[int], *, device: torch.device, repeats: int, budget: float,
                 block: int | None, progress: Callable[[str], None] | None = None) -> list[Row]:
    """Measure every size on ``group`` (see the module docstring); ``budget``: the most seconds
    one call may be expected to take."""
    last: dict[str, tuple[int, float]] = {}  # op -> (n, seconds) of its last measured size
    rows = []
    for k, n in enumerate(sizes):
        row = _measure_size(group, n, device, repeats, budget, block, last)
        if progress:
            times = ", ".join(f"{op} {_ms(getattr(row, op))}" for op in ("float32", "bf16", "onebit"))
            progress(f"[{k + 1}/{len(sizes)}] {n:,} elements: {times}")
        rows.append(row)
    return rows


def _ms(seconds: float | None) -> str:
    return "not run (over the budget)" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _measure_size(group, n: int, device: torch.device, repeats: int, budget: float, block: int | None,
                  last: dict[str, tuple[int, float]]) -> Row:
    W = dist.get_world_size(group)
    N = padded_numel(n, W, block)
    row = Row(n=n, wire=compressed_bytes(N, W, block))
    x = torch.randn(n, generator=torch.Generator().manual_seed(1234 + dist.get_rank(group))).to(device)
    x16 = x.to(torch.bfloat16)
    we, se = torch.zeros(N, device=device), torch.zeros(N // W, device=device)
    ops = {
        "float32": (lambda: dist.all_reduce(x.clone(), group=group), None),
        "bf16": (lambda: dist.all_reduce(x16.clone(), group=group), None),
        "onebit": (lambda: compressed_allreduce(x.clone(), we, se, group, block=block), _comm_seconds),
    }
    for op, (fn, extra) in ops.items():
        if op in last:  # seconds grow at most linearly with n beyond the latency
            m, t = last[op]
            if t * n / m > budget:
                row.skipped.append(op)
                continue
        seconds, share = _timed(fn, group, device, repeats, extra)
        setattr(row, op, seconds)
        if op == "onebit":
            row.comm = share
        last[op] = (n, seconds)
    # the compute of one compressed call, without communication (this rank's own)
    msg = worker_compress(x, we, W, update_error=False, block=block)
    out = x.clone()
    stages = [
        _local(lambda: worker_compress(x, we, W, update_error=False, block=block), device, repeats),
        _local(lambda: server_reduce(msg, se.clone(), W, block=block), device, repeats),
        _local(lambda: decompress(msg, out, W, worker_error=we.clone(), worker_message=msg, block=block),
               device, repeats),
    ]
    row.encode, row.server, row.decode = _slowest(stages, group, device)
    return row


def measure_hierarchical(mesh, n: int, *, device: torch.device, repeats: int, block: int | None) -> float:
    """Seconds of one hierarchical compressed_allreduce of n elements on the 2-D ``mesh``
    (median of the slowest rank, as the other timings)."""
    from ..collectives import error_buffers

    rank = dist.get_rank()
    x = torch.randn(n, generator=torch.Generator().manual_seed(1234 + rank)).to(device)
    we, se = error_buffers(n, mesh, block=block, device=device)
    seconds, _ = _timed(lambda: compressed_allreduce(x.clone(), we, se, mesh, block=block), dist.group.WORLD,
                        device, repeats)
    return seconds


def measure_step(path: str, group, device: torch.device, repeats: int = 5) -> float:
    """Seconds of one call of ``step()`` defined in the Python file ``path`` (the user's
    forward, backward and optimizer step on this rank, without communication): median of
    ``repeats`` after two warm-up calls, slowest rank."""
    import runpy

    namespace = runpy.run_path(path)
    step = namespace.get("step")
    if not callable(step):
        raise ValueError(f"--measure-step: expected {path} to define a function step(), found none")
    for _ in range(2):
        step()
    seconds, _ = _timed(step, group, device, repeats)
    return seconds
