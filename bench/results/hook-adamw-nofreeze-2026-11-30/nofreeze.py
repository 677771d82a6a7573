"""AdamW behind onebit_compress_hook without freeze_step: the handed gradient's norm per step (session 36).

  python nofreeze.py base 2 40       # the library as it is (errors kept in u = g / d units)
  python nofreeze.py rescale 2 40    # errors converted by d_{t-1} / d_t (patched here, not in the library)

2 gloo ranks, an MLP 128-1024-128 on a noisy linear map, batch 4, AdamW 1e-3, float32 errors,
start_iter as given.
"""

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _patch_rescale(ddp_hook):
    real, prev = ddp_hook._optimizer_terms, {}

    def patched(st, bucket, read_adam=True):
        d, c = real(st, bucket, read_adam)
        idx = bucket.index()
        if d is not None and idx in st.errors:
            we, se = st.errors[idx]
            C = se.numel()
            dn = torch.ones(we.numel())
            dn[: d.numel()] = d
            if idx in prev:
                ratio = prev[idx] / dn
                we.mul_(ratio)
                r = dist.get_rank()
                se.mul_(ratio[r * C : (r + 1) * C])
            prev[idx] = dn
        return d, c

    ddp_hook._optimizer_terms = patched


def body(rank, world, mode, start_iter, steps, q):
    port = 29500 + (7 if mode == "rescale" else 0) + start_iter
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.collectives import OnebitCompressHookState, ddp_hook, onebit_compress_hook

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 128))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = OnebitCompressHookState(optimizer=opt, start_iter=start_iter, error_dtype=torch.float32)
    model.register_comm_hook(state, onebit_compress_hook)
    if mode == "rescale":
        _patch_rescale(ddp_hook)
    g = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(128, 128, generator=torch.Generator().manual_seed(5)) / 11
    rows = []
    for t in range(steps):
        x = torch.randn(4, 128, generator=g)
        y = x @ target + 0.1 * torch.randn(4, 128, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        mean = torch.tensor([loss.item()])
        dist.all_reduce(mean)
        rows.append((t, norm, float(mean) / world))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, start_iter, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=body, args=(r, 2, mode, start_iter, steps, q)) for r in range(2)]
    for p in ps:
        p.start()
    rows = q.get()
    for p in ps:
        p.join()
    for t, norm, loss in rows:
        if t < 25 or t % 10 == 0:
            print(f"{mode} si={start_iter} step {t:4d} handed-norm {norm:11.4g} loss {loss:.4f}")
