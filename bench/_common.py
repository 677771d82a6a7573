"""What every benchmark needs once: provenance, a timer, CSV output, Markdown tables, the
matplotlib import. Benchmarks use only public onebit names; this module holds no onebit
code.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def git_commit() -> str:
    """The commit of the onebit code a benchmark runs, with ``+dirty`` when its files differ: this
    checkout's, or, where ``onebit`` is imported from elsewhere (another checkout's editable install, an
    installed wheel), ``<that checkout's commit> (onebit at <path>)`` or ``onebit <version> at <path>``,
    so that a row never names a commit whose code did not run; '' where nothing is known."""
    where = _onebit_root()
    commit = _commit_of(where or ROOT)
    if where is None or os.path.realpath(where) == os.path.realpath(ROOT):
        return commit
    if commit:
        return f"{commit} (onebit at {where})"
    from importlib import metadata

    try:
        return f"onebit {metadata.version('onebit')} at {where}"
    except metadata.PackageNotFoundError:
        return f"onebit at {where}"


def _onebit_root() -> str | None:
    """The folder the imported ``onebit.collectives`` lives in, one up (a checkout's root, or the
    installed package's folder); None where onebit does not import."""
    try:
        import onebit.collectives as collectives
    except ImportError:
        return None
    return os.path.dirname(os.path.dirname(os.path.abspath(collectives.__file__)))


def _commit_of(folder: str) -> str:
    """The commit (with ``+dirty``) of the git checkout whose root ``folder`` is, or '' (not a checkout's
    root: an installed package inside some checkout is not that checkout's code)."""
    try:
        top = subprocess.run(["git", "-C", folder, "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if os.path.realpath(top) != os.path.realpath(folder):
            return ""
        head = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def device_name(device=None) -> str:
    """The GPU's name for a CUDA device, else the CPU: architecture, cores, torch threads."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def provenance(device=None, **extra) -> dict:
    """Device, versions, date and commit: the columns every results row starts with."""
    import torch

    meta = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "commit": git_commit()}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return {**meta, **extra}


def timer(device, repeats: int) -> Callable[[Callable[[], object]], tuple[float, float, float]]:
    """Returns ``time(fn) -> (median, p20, p80)`` in milliseconds: triton's do_bench on
    CUDA (L2 flushed between calls), else wall-clock over ``repeats`` calls after one warm-up."""
    import torch

    if torch.device(device).type == "cuda":
        import triton.testing

        def cuda_time(fn):
            q = triton.testing.do_bench(fn, warmup=25, rep=max(repeats, 50), quantiles=[0.5, 0.2, 0.8])
            return tuple(q)

        return cuda_time

    def cpu_time(fn):
        fn()
        times = sorted(wall_ms(fn) for _ in range(repeats))
        return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]

    return cpu_time


def wall_ms(fn: Callable[[], object], device=None) -> float:
    """One call's wall-clock milliseconds (synchronising a CUDA device before and after)."""
    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def slowest_rank_times(fn: Callable[[], object], repeats: int, warmup: bool = True) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (a collective every rank makes) after one warm-up
    (none with ``warmup=False``), each the slowest rank's (a barrier before, a MAX all-reduce
    after): the same on every rank."""
    import torch
    import torch.distributed as dist

    times = []
    for rep in range(int(not warmup), repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rep:
            times.append(float(elapsed))
    return times


def write_csv(
    path: str, rows: Sequence[dict], *, append: bool = False, fields: Sequence[str] | None = None,
) -> str:
    """Write (or append) dict rows; the header comes from ``fields`` or the rows' keys in order
    of first appearance, and is written when the file is new. Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if fields is None:
        fields = list(dict.fromkeys(k for r in rows for k in r))
    new = not (append and os.path.exists(path))
    if not new:
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), [])
        if header != list(fields):
            raise ValueError(f"{path}: its columns differ from these rows'; write to another file")
    with open(path, "a" if append else "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields))
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (what bench/RESULTS.md pastes)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (with a hint) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plots", file=sys.stderr)
        return None
    return plt


def save_png(fig, path: str, dpi: int = 110) -> None:
    """Save a figure as a 64-colour palette PNG: line plots look the same and the committed
    plots stay a few kB each (matplotlib's RGBA PNGs are 3-4x larger)."""
    fig.savefig(path, dpi=dpi)
    try:
        from PIL import Image
    except ImportError:  # matplotlib brings Pillow; keep the RGBA file without it
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def child_arguments(parser) -> None:
    """The hidden ``--child`` and ``--out`` arguments of a benchmark that starts its own ranks."""
    import argparse

    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)


def ranks_json(script: str, ranks: int, extra: Sequence[str], timeout: float = 1800) -> object:
    """Run ``script`` on ``ranks`` local ranks (torchrun, one thread each) with ``--child --out FILE``
    and ``extra``; return the JSON its rank 0 wrote to FILE."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               os.path.abspath(script), "--child", "--out", out, *extra]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout)
        with open(out) as fh:
            return json.load(fh)


def rank0_result(path: str, result: object) -> None:
    """In a rank: rank 0 writes ``result`` to ``path`` as JSON; then every rank leaves the group."""
    import json

    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(path, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


def run_child(args, child: Callable[[object], object]) -> None:
    """In a rank (``--child``): run ``child(args)``, flush, and exit without interpreter
    finalisation, where gloo aborts now and then (docs/failures.md); otherwise return."""
    if not args.child:
        return
    child(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def muon_split(model) -> tuple[list, list]:
    """(hidden, rest): the matrices Muon steps (every 2-D parameter but the embeddings, ``tok``/``pos`` in
    the name, and the last one, the head) and what its AdamW partner steps (the rest)."""
    last = [n for n, p in model.named_parameters() if p.ndim == 2][-1]
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n != last and "tok" not in n
              and "pos" not in n]
    return hidden, [p for p in model.parameters() if all(p is not q for q in hidden)]
