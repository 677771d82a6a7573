"""onebit.integrations.torchtitan: torchtitan 0.3.0's optimizer container with OnebitAdam or the
AdamW hooks, built from torchtitan's own config and override functions, on a 2 x 2 HSDP mesh of 4
gloo ranks (torchtitan's trainer itself needs CUDA: test_torchtitan_trains_end_to_end)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_hsdp import _all_equal, _full, _loss, _mesh, _model

pytest.importorskip("torchtitan")


def _container(model, mode: str, freeze: int, **options):
    from torchtitan.components.optimizer import default_adamw

    import onebit.integrations.torchtitan as tt

    cfg = default_adamw(lr=1e-2)  # torchtitan's own: AdamW, betas (0.9, 0.95), weight decay 0.1
    cfg.implementation = "for-loop"
    made = getattr(tt, mode)(cfg, freeze_step=freeze, **options)
    return made.build(model_parts=[model])


def _steps(model, opts, start, end):
    for step in range(start, end):
        opts.zero_grad()
        _loss(model, step).backward()
        opts.step()


def _body_train_and_resume(mode: str, directory: str):
    import torch.distributed.checkpoint as dcp

    freeze, cut, steps = 3, 5, 9
    mesh = _mesh()
    model = _model(mesh)
    opts = _container(model, mode, freeze, max_norm=1.0)
    before = _full(model)
    opts.state_dict()  # torchtitan's init_optim_state step: no onebit update
    untouched = torch.equal(before, _full(model))
    inner = opts.optimizers[0]
    counted = getattr(inner, "updates", None)
    first = _loss(model, 0).item()
    _steps(model, opts, 0, steps)
    straight, last = _full(model), _loss(model, 0).item()
    stats = inner.stats() if mode == "onebit_adam" else opts.hooks[0].stats()

    model = _model(mesh)
    opts = _container(model, mode, freeze, max_norm=1.0)
    opts.state_dict()  # as above (torch's AdamW counts that step; OnebitAdam does not)
    _steps(model, opts, 0, cut)
    dcp.save({"model": model.state_dict(), "optimizer": opts}, checkpoint_id=directory)
    model = _model(mesh, seed=1)
    opts = _container(model, mode, freeze, max_norm=1.0)
    state = {"model": model.state_dict(), "optimizer": opts}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    _steps(model, opts, cut, steps)
    return {"untouched": untouched, "counted": counted, "type": type(inner).__name__,
            "identical": _all_equal(straight), "learned": last < first, "stats": stats,
            "resumed": torch.equal(straight, _full(model))}


@pytest.mark.parametrize("mode", ["onebit_adam", "adamw_hooks"])
def test_torchtitan_container_trains_and_resumes_from_dcp(ranks, tmp_path, mode):
    for out in ranks(4).run(_body_train_and_resume, mode, str(tmp_path)):
        assert out["untouched"] and out["identical"] and out["learned"] and out["resumed"], out
        assert out["type"] == ("OnebitAdam" if mode == "onebit_adam" else "AdamW")
        if mode == "onebit_adam":
            assert out["counted"] == 0  # the init step made no update
        assert out["stats"]["bytes_compressed"] > 0


def test_torchtitan_override_arguments():
    from torchtitan.components.optimizer import default_adamw

    import onebit.integrations.torchtitan as tt

    with pytest.raises(ValueError, match=r"^max_norm"):
        tt.onebit_adam(default_adamw(), max_norm=float("inf"))
    made = tt.onebit_adam(default_adamw(lr=3e-4), freeze_step=7)
    assert isinstance(made, tt.OnebitOptimizersContainer.Config) and made.freeze_step == 7
    assert made.param_groups[0].optimizer_kwargs["lr"] == 3e-4


@pytest.mark.cuda
def test_torchtitan_trains_end_to_end():
    """torchtitan's own trainer (llama3 debug model, 4 GPUs: 2 replicas x 2 shards) with the
    override on the command line; needs a torchtitan checkout for its test assets
    (TORCHTITAN_REPO) and its full dependencies (pip install torchtitan==0.3.0)."""
    repo = os.environ.get("TORCHTITAN_REPO")
    if torch.cuda.device_count() < 4 or not repo:
        pytest.skip("needs 4 GPUs and TORCHTITAN_REPO (a torchtitan 0.3.0 checkout)")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
               "--parallelism.data_parallel_replicate_degree", "2",
               "--parallelism.data_parallel_shard_degree", "2", "--training.steps", "40",
               "--training.max_norm", "inf", "--override.imports",
               'onebit.integrations.torchtitan.onebit_adam={"freeze_step": 10, "max_norm": 1.0}']
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "OnebitAdam" in done.stdout + done.stderr
