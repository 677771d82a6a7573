import time, statistics, torch, torch.distributed as dist
from onebit import ZeroOneAdam
dist.init_process_group("gloo")
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(2500, 1000)) for _ in range(8)]
opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=3, var_update_scaler=1)
g = torch.Generator().manual_seed(dist.get_rank())
grads = [torch.randn(2500, 1000, generator=g) for _ in range(8)]
wake, step = [], []
for s in range(14):
    for p, gr in zip(params, grads): p.grad = gr
    dist.barrier(); t = time.perf_counter(); opt._wake(); t1 = time.perf_counter(); opt.step(); t2 = time.perf_counter()
    if s >= 6: wake.append(t1 - t); step.append(t2 - t1)
if dist.get_rank() == 0:
    print(f"wake {statistics.median(wake)*1e3:.1f} ms, rest of step {statistics.median(step)*1e3:.1f} ms")
