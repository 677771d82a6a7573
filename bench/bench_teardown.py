"""How often a finished 4-rank gloo script dies at exit, by how it ends (issue 39).

One torchrun script that uses each onebit feature that holds a group, a thread, a hook or an
atexit handler: compressed_allreduce (plain and async_op), a 2 x 2 mesh (subgroups), DDP with
OnebitAdam (register_ddp_hook), DDP with AdamW behind onebit_compress_hook, FSDP2 with
register_fsdp_hooks, and an OnebitLamb that never compressed (its end-of-run message is an
atexit handler). It ends one of three ways:

  finish   onebit.finish()                                  (what the docs use)
  bare     dist.destroy_process_group()                     (what torch's examples do)
  none     nothing (the interpreter's exit does it all)

and is run --runs times per ending; a run counts as aborted when torchrun fails (any rank's
non-zero exit; the SIGABRT message is counted separately). Prints one line per ending.

  python bench/bench_teardown.py --runs 30 --endings finish bare
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SCRIPT = r'''
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import onebit
from onebit.collectives import (OnebitCompressHookState, compressed_allreduce, error_buffers, node_mesh,
                                onebit_compress_hook, register_fsdp_hooks)
from onebit.optimizers import OnebitAdam, OnebitLamb, register_ddp_hook

dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(rank)
t = torch.randn(10_000, generator=g)
we, se = error_buffers(t.numel())
compressed_allreduce(t, we, se)
compressed_allreduce(t, we, se, async_op=True).wait()
mesh = node_mesh(per_node=2)
mwe, mse = error_buffers(t.numel(), mesh)
compressed_allreduce(t, mwe, mse, mesh)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def train(model, opt, steps=12):
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(8 * step + rank))
        torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
        opt.step()
        opt.zero_grad()


ddp = DDP(net())
adam = OnebitAdam(ddp.parameters(), lr=1e-3, freeze_step=4)
register_ddp_hook(ddp, adam)
train(ddp, adam)
hooked = DDP(net())
adamw = torch.optim.AdamW(hooked.parameters(), lr=1e-3)
state = OnebitCompressHookState(optimizer=adamw, freeze_step=4)
hooked.register_comm_hook(state, onebit_compress_hook)
train(hooked, adamw)
fmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
sharded = net()
for layer in sharded:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=fmesh)
fully_shard(sharded, mesh=fmesh)
hooks = register_fsdp_hooks(sharded)
train(sharded, torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9))
lamb_model = net()
lamb = OnebitLamb(lamb_model.parameters(), lr=1e-3, freeze_step=1000)  # never compresses: atexit message
train(lamb_model, lamb, steps=2)
sys.stdout.write(f"done {rank}\n")  # one write: lines of several ranks do not interleave
sys.stdout.flush()
ending = sys.argv[1]
if ending == "finish":
    onebit.finish()
elif ending == "bare":
    dist.destroy_process_group()
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--endings", nargs="+", default=["finish", "bare"], choices=["finish", "bare", "none"])
    p.add_argument("--ranks", type=int, default=4)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="onebit-teardown-")
    script = os.path.join(tmp, "script.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    for ending in args.endings:
        failed = aborted = 0
        start = time.time()
        for _ in range(args.runs):
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", str(args.ranks), script, ending],
                                 capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
            done = run.stdout.count("done ")
            if run.returncode != 0 or done != args.ranks:
                failed += 1
                with open(os.path.join(tmp, f"failed-{ending}-{failed}.log"), "w") as f:
                    f.write(f"rc {run.returncode}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}")
                aborted += "terminate called" in run.stderr or "SIGABRT" in run.stderr
                tail = run.stderr.strip().splitlines()[-3:]
                print(f"  {ending}: rc {run.returncode}, {done} ranks done; {' | '.join(tail)[:300]} "
                      f"(whole output: {tmp}/failed-{ending}-{failed}.log)", file=sys.stderr)
        print(f"ending={ending} runs={args.runs} ranks={args.ranks} failed={failed} sigabrt={aborted} "
              f"seconds={time.time() - start:.0f}", flush=True)


if __name__ == "__main__":
    main()
