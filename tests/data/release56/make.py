"""Checkpoints saved by onebit as released before issue 56 (tests/test_release_checkpoints.py loads them).

The files here were made by the code of commit 3cbcb4a (``0f85f8a^``: the parent of issue 56's first
commit, float32 error buffers and no ``error_dtype`` argument) on 2 gloo ranks, from the repository
root::

    git worktree add /tmp/release56 0f85f8a^
    mkdir -p /tmp/release56-pkg/onebit && cd /tmp/release56-pkg/onebit \\
        && ln -s /tmp/release56/onebit/* . && ln -s /tmp/release56/kernels /tmp/release56/collectives \\
           /tmp/release56/optimizers . && cd -
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/release56-pkg .venv/bin/python tests/data/release56/make.py
    git worktree remove --force /tmp/release56

(the folder of links is the package layout pyproject.toml's package-dir makes of the old tree, so that
``import onebit`` is the old code; this script prints where it imported it from and refuses code that
has ``error_dtype``). For each case of :data:`CASES`: the model of :func:`make_model`, trained
:data:`SAVED_AT` steps on :func:`batch` (past the freeze at step :data:`FREEZE`: compression / phase 2),
then saved per rank to ``<case>-rank<r>.pt``: ``{"model": state_dict, "optimizer": state_dict,
"hook": the DDP hook state's __getstate__() or None}``; then :data:`CONTINUE` more steps, saved to
``<case>-continue-rank<r>.pt``: ``{"x": [step, batch, 12], "y": [step, batch], "params": [step, 378]
(:func:`flat` after each step), "identical": [the optimizer's replicas_identical after each step]}``.

Made twice, the files differ only in the optimizers' telemetry seconds (``optimizer["onebit"]["traffic"]``).
The test imports the model, :func:`build`, :func:`train_step`, :func:`flat` and the constants from here,
so they describe the files; :func:`build` passes ``extra`` (the current code's ``error_dtype``) on.
"""

from __future__ import annotations

import datetime
import inspect
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
CASES = ("onebit_adam", "onebit_lamb", "zero_one_adam", "adamw_hook")
WORLD = 2
FREEZE = 4  # freeze_step / var_freeze_step
SAVED_AT = 8  # steps before the checkpoint
CONTINUE = 4  # steps after it, recorded
BUCKET_CAP_MB = 0.001  # 262 floats per bucket: OnebitAdam's and ZeroOneAdam's buckets [264], [22, 88, 4]


def make_model() -> torch.nn.Module:
    """378 parameters (small files); the first weight (264 elements) is over OnebitLamb's 256-float
    sketch, so its trust ratio is sketched."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 22), torch.nn.ReLU(), torch.nn.Linear(22, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g) + 0.5 * rank
    return x, (x[:, :4] * (1 + rank)).argmax(1)


def build(case: str, model: torch.nn.Module, **extra):
    """``(optimizer, hook state or None)`` for ``case``; ``model`` is DDP-wrapped for "adamw_hook"
    (the hook is registered on it), plain otherwise (the 1-bit optimizers average the warm-up's
    gradients themselves)."""
    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

    params = model.parameters()
    if case == "onebit_adam":
        return OnebitAdam(params, lr=1e-2, freeze_step=FREEZE, bucket_cap_mb=BUCKET_CAP_MB, **extra), None
    if case == "onebit_lamb":
        return OnebitLamb(params, lr=1e-2, freeze_step=FREEZE, **extra), None
    if case == "zero_one_adam":
        # local_step_scaler=2: the local-step interval doubles every 2 steps of phase 2 (1, 1, 2, 2,
        # 4, ...), so the continuation has steps where the replicas differ (9-11) and a sync (12)
        return ZeroOneAdam(params, lr=1e-2, var_freeze_step=FREEZE, local_step_scaler=2, local_step_clipper=4,
                           bucket_cap_mb=BUCKET_CAP_MB, **extra), None
    if case == "adamw_hook":
        opt = torch.optim.AdamW(params, lr=1e-2)
        state = OnebitCompressHookState(optimizer=opt, freeze_step=FREEZE, **extra)
        model.register_comm_hook(state, onebit_compress_hook)
        return opt, state
    raise ValueError(case)


def train_step(model, opt, x, y) -> None:
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def flat(module: torch.nn.Module) -> torch.Tensor:
    """The parameters in one float32 vector (one record in the file instead of one per tensor)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def identical(opt) -> bool:
    return bool(getattr(opt, "replicas_identical", True))  # AdamW behind DDP: always


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for case in CASES:
            module = make_model()
            model = torch.nn.parallel.DistributedDataParallel(module) if case == "adamw_hook" else module
            opt, hook = build(case, model)
            for t in range(SAVED_AT):
                train_step(model, opt, *batch(rank, t))
            saved = {"model": module.state_dict(), "optimizer": opt.state_dict(),
                     "hook": None if hook is None else hook.__getstate__()}
            torch.save(saved, HERE / f"{case}-rank{rank}.pt")
            xs, ys, params, same = [], [], [], []
            for t in range(SAVED_AT, SAVED_AT + CONTINUE):
                x, y = batch(rank, t)
                train_step(model, opt, x, y)
                xs.append(x)
                ys.append(y)
                params.append(flat(module))
                same.append(identical(opt))
            torch.save({"x": torch.stack(xs), "y": torch.stack(ys), "params": torch.stack(params),
                        "identical": same}, HERE / f"{case}-continue-rank{rank}.pt")
            if rank == 0:
                info = hook.stats() if hook is not None else opt.stats()
                print(case, {k: v for k, v in info.items() if isinstance(v, (int, str, bool))}, same)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    import onebit
    from onebit.optimizers import OnebitAdam

    print("onebit from", os.path.dirname(onebit.__file__), file=sys.stderr)
    if "error_dtype" in inspect.signature(OnebitAdam).parameters:
        sys.exit("make.py: this onebit has error_dtype (issue 56's code); run it on commit 0f85f8a^ "
                 "(see the command at the top)")
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)


if __name__ == "__main__":
    main()
