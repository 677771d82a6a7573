"""The bugs that the Hugging Face Trainer and Lightning ran into, fixed where they live (issue 35):
a 1-bit optimizer's state round trip before its first step (Accelerate's prepare), empty and
several parameter groups; a hook state built before init_process_group; the guard against
compressing twice seen through a framework's optimizer wrapper; a hook state that never ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from helpers import make_grads, make_optimizer, set_grads
from zygote import launch

from onebit.collectives import OnebitCompressHookState
from onebit.optimizers import OnebitAdam

KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, freeze_step=3)
SHAPES = [(7, 5), (5,), (33,)]


def _body_round_trip(name, round_trip_at):
    """Two groups (decay / no decay, as the Trainer builds them) and an empty one; the state goes
    through ``load_state_dict(state_dict())`` at the steps in ``round_trip_at`` (-1: before
    the first step, where Accelerate's prepare does it)."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0},
              {"params": [], "weight_decay": 0.0}]
    opt = make_optimizer(name, groups, dict(KW))
    if -1 in round_trip_at:
        opt.load_state_dict(opt.state_dict())
    for t in range(8):
        set_grads(params, make_grads(t, r, SHAPES))
        opt.step()
        if t in round_trip_at:
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in params], opt.stats()["bytes_compressed"]


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_state_round_trip_before_and_during_training_changes_nothing(ranks, name):
    # Accelerate's AcceleratedOptimizer runs load_state_dict(state_dict()) at prepare time: the
    # reducer that state_dict() built kept buckets nobody read (KeyError: 'exp_avg_sq', or a
    # momentum detached from its buckets)
    plain = ranks(2).run(_body_round_trip, name, ())
    for trips in ((-1,), (-1, 2, 5)):
        got = ranks(2).run(_body_round_trip, name, trips)
        for r in range(2):
            assert got[r][1] == plain[r][1] > 0
            for x, y in zip(got[r][0], plain[r][0], strict=True):
                assert torch.equal(x, y), f"rank {r}, round trips at {trips}: parameters differ"


def test_guard_sees_through_framework_wrappers():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState
    from pytorch_lightning.core.optimizer import LightningOptimizer

    accelerate.Accelerator(cpu=True)
    try:
        _check_wrappers(AcceleratedOptimizer, LightningOptimizer)
    finally:
        AcceleratorState._reset_state(True)


def _check_wrappers(AcceleratedOptimizer, LightningOptimizer):
    model = torch.nn.Linear(4, 2)
    onebit = AcceleratedOptimizer(OnebitAdam(model.parameters(), freeze_step=2))
    with pytest.raises(TypeError, match="compresses its own momentum"):
        OnebitCompressHookState(optimizer=onebit)
    with pytest.raises(TypeError, match="compresses its own momentum"):
        OnebitCompressHookState(optimizer=LightningOptimizer(OnebitAdam(model.parameters(), freeze_step=2)))
    adamw = torch.optim.AdamW(model.parameters())
    state = OnebitCompressHookState(optimizer=AcceleratedOptimizer(adamw))
    assert state.optimizer is adamw  # the hook reads the real optimizer's state
    state.optimizer = LightningOptimizer(adamw)  # set later, as in configure_optimizers
    assert state.optimizer is adamw
    with pytest.raises(TypeError, match="compresses its own momentum"):
        state.optimizer = onebit
    with pytest.raises(TypeError, match="optimizer"):
        state.optimizer = model


def _torchrun(tmp_path, code: str, nproc: int = 2):
    """``code`` on ``nproc`` ranks started as torchrun starts them (tests/zygote.py)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return launch(script, nproc=nproc, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)


def test_hook_state_built_before_the_process_group_averages(tmp_path):
    # Lightning's order: DDPStrategy(ddp_comm_state=OnebitCompressHookState()) before fit makes
    # the group. The state used to fix W = 1 and hand each rank its local gradient back.
    run = _torchrun(tmp_path, """
        import gc
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
        state = OnebitCompressHookState(start_iter=2)
        dist.init_process_group("gloo")
        r = dist.get_rank()
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
        model.register_comm_hook(state, onebit_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for t in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + r)) + r
            model(x).square().mean().backward()
            opt.step(); opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(every, flat)
        assert torch.equal(every[0], every[1]), "replicas drifted apart"
        s = state.stats()
        assert state.world_size == 2 and s["bytes_compressed"] > 0 and s["bytes_full"] > 0, s
        print("ok", r)
        del model, opt, state; gc.collect()  # first what holds the group: torch 2.13's gloo can abort at exit
        dist.barrier()
        dist.destroy_process_group()
    """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("ok") == 2


def test_a_hook_state_that_never_ran_says_so_once_at_exit(tmp_path):
    code = """
        import torch
        from onebit.collectives import OnebitCompressHookState
        unused = OnebitCompressHookState()
        also_unused = OnebitCompressHookState()
    """
    script = tmp_path / "unused.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("onebit_compress_hook never ran") == 1, run.stderr
    assert "OnebitCallback" in run.stderr
