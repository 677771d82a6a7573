"""ZeroOneAdam phase 2 (sync every step) on 2 gloo ranks: step time with the state at rest (KEEP_MESSAGE True,
the default) against held (False), interleaved; 20M params in 8 tensors."""
import time, statistics, torch, torch.distributed as dist
from onebit import ZeroOneAdam
dist.init_process_group("gloo")
torch.manual_seed(0)
def make():
    params = [torch.nn.Parameter(torch.randn(2500, 1000)) for _ in range(8)]
    opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=3, var_update_scaler=1)
    return params, opt
runs = {True: make(), False: make()}
g = torch.Generator().manual_seed(dist.get_rank())
grads = [torch.randn(2500, 1000, generator=g) for _ in range(8)]
times = {True: [], False: []}
for step in range(14):
    for keep in (True, False):
        params, opt = runs[keep]
        ZeroOneAdam.KEEP_MESSAGE = keep
        for p, gr in zip(params, grads): p.grad = gr
        dist.barrier(); t = time.perf_counter(); opt.step(); dt = time.perf_counter() - t
        if step >= 6: times[keep].append(dt)
if dist.get_rank() == 0:
    from onebit.memory import bytes_per_parameter
    for keep in (True, False):
        print(f"keep={keep}: phase {runs[keep][1].phase}, median step {statistics.median(times[keep])*1e3:.1f} ms, "
              f"bytes/param {bytes_per_parameter(runs[keep][1]):.2f}")
