import os, sys, math, torch, torch.distributed as dist, torch.multiprocessing as mp

def body(rank, W, mode, start_iter, steps, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + (7 if mode == "rescale" else 0) + start_iter))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W)
    from torch.nn.parallel import DistributedDataParallel as DDP
    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    from onebit.collectives import ddp_hook
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 128))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = OnebitCompressHookState(optimizer=opt, start_iter=start_iter, error_dtype=torch.float32)
    model.register_comm_hook(state, onebit_compress_hook)
    if mode == "rescale":
        real = ddp_hook._optimizer_terms
        prev = {}
        def patched(st, bucket, read_adam=True):
            d, c = real(st, bucket, read_adam)
            idx = bucket.index()
            if d is not None and idx in st.errors:
                we, se = st.errors[idx]
                N = we.numel(); n = d.numel(); Ws = N // se.numel(); C = se.numel()
                dn = torch.ones(N); dn[:n] = d
                if idx in prev:
                    ratio = prev[idx] / dn
                    we.mul_(ratio)
                    r = dist.get_rank()
                    se.mul_(ratio[r * C:(r + 1) * C])
                prev[idx] = dn
            return d, c
        ddp_hook._optimizer_terms = patched
    g = torch.Generator().manual_seed(1 + rank)
    Wt = torch.randn(128, 128, generator=torch.Generator().manual_seed(5)) / 11
    rows = []
    for t in range(steps):
        x = torch.randn(4, 128, generator=g)
        y = x @ Wt + 0.1 * torch.randn(4, 128, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        gn = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        opt.step(); opt.zero_grad()
        l = torch.tensor([float(loss)]); dist.all_reduce(l); 
        rows.append((t, gn, float(l) / W))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()

if __name__ == "__main__":
    mode, start_iter, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=body, args=(r, 2, mode, start_iter, steps, q)) for r in range(2)]
    [p.start() for p in ps]
    rows = q.get(); [p.join() for p in ps]
    for t, gn, l in rows:
        if t < 25 or t % 10 == 0:
            print(f"{mode} si={start_iter} step {t:4d} handed-norm {gn:11.4g} loss {l:.4f}")
