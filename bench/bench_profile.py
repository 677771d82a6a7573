"""Where an optimizer step's time goes: wall time against device kernel time and launches.

The parameter set of bench_optimizer.py (8 blocks of d_model 1024, about 101M parameters,
fixed random gradients), each optimizer's collective replaced by the full local compute at
W = 1 (wire excluded). For each path of bench/TRAFFIC.md's table it runs --warmup steps, then
--steps timed steps (the median step's wall milliseconds, the device synchronised at both
ends), then --steps steps under ``torch.profiler``: the summed device time of the kernels
(CUDA) and the number of kernel launches (CUDA) or aten ops (CPU) per step. It also prints
the bytes the traffic model counts divided by the wall time. Wall time far above kernel time
means the step is bound by the host (launches, Python, synchronisations), not by memory.

Paths: fused AdamW; OnebitAdam warm-up; its compression stage with ``nonfinite="skip"`` (one
host synchronisation per step) and with ``nonfinite=None``; ZeroOneAdam's phase-1 compressed
steps and its phase-2 local steps (interval 16: fifteen local steps and one sync per cycle).

  python bench/bench_profile.py                      # CUDA if present, else CPU
  python bench/bench_profile.py --per-tensor         # GPU: one op per tensor, as before _multi
  python bench/bench_profile.py --unfused            # GPU: multi-tensor ops, no fused passes
  python bench/bench_profile.py --device cpu --blocks 1 --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from onebit.kernels.backends import use_backend
from onebit.optimizers import OnebitAdam, ZeroOneAdam, _multi

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, provenance, wall_ms, write_csv  # noqa: E402
from bench_optimizer import forced_single_rank, make_params  # noqa: E402

# bytes per element per step, float32, W = 1 local compute (bench/TRAFFIC.md, traffic_model.py)
MODEL_BYTES = {"adamw_fused": 28, "onebit_warmup": 100, "onebit_compress": 101, "onebit_compress_nosync": 97,
               "zoa_phase1_compressed": None, "zoa_phase2_local": None}
# OnebitAdam's compression stage in its fused GPU passes (TRAFFIC.md section 3d): 56.9 B and the
# non-finite check's 4; its warm-up's update in one launch per bucket (TRAFFIC.md section 2): the copy
# into the averaging buffer 8, the update 28, the non-finite check's 4
FUSED_BYTES = {"onebit_compress": 61, "onebit_compress_nosync": 57, "onebit_warmup": 40}


def build(name: str, params, bucket_cap_mb: float = 25.0):
    kw = dict(lr=1e-4, weight_decay=0.01)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **kw), 2
    kw["bucket_cap_mb"] = bucket_cap_mb
    if name == "onebit_warmup":
        return OnebitAdam(params, freeze_step=10**6, **kw), 2
    if name.startswith("onebit_compress"):
        opt = OnebitAdam(params, freeze_step=1, nonfinite=None if name.endswith("nosync") else "skip", **kw)
        opt.reducer().allreduce = forced_single_rank
        return opt, 3
    if name == "zoa_phase1_compressed":
        # variance steps at t % interval == 0; after 16 of them the interval doubles, so from step
        # 17 on the steps alternate; the profiled window is mostly compressed steps
        opt = ZeroOneAdam(params, var_freeze_step=10**6, var_update_scaler=1, **kw)
        opt.reducer().allreduce = forced_single_rank
        return opt, 12
    if name == "zoa_phase2_local":
        opt = ZeroOneAdam(params, var_freeze_step=2, local_step_scaler=1, local_step_clipper=16, **kw)
        opt.reducer().allreduce = forced_single_rank
        return opt, 40
    raise ValueError(name)


def run(name: str, args, device) -> dict:
    params = make_params(args.blocks, args.d_model, device)
    n = sum(q.numel() for q in params)
    opt, warm = build(name, params, args.bucket_cap_mb)
    for _ in range(max(warm, args.warmup)):
        opt.step()
    cuda = device.type == "cuda"
    wall = statistics.median(wall_ms(opt.step, device) for _ in range(args.steps))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            opt.step()
        if cuda:
            torch.cuda.synchronize()
    # device events, less the optimizer's own annotation (a span over the whole step)
    events = [e for e in prof.events() if not e.name.startswith("Optimizer.")]
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        device_ms = sum(e.device_time_total for e in kernels) / 1e3 / args.steps
        launches = len(kernels) / args.steps
    else:
        kernels = [e for e in events if e.name.startswith("aten::")
                   and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        device_ms, launches = float("nan"), len(kernels) / args.steps
    if name in args.top:
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(f"{name}: the top ops over {args.steps} steps", file=sys.stderr)
        table = prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60)
        print(table, file=sys.stderr)
    fused = cuda and not (args.unfused or args.per_tensor) and name in FUSED_BYTES
    b = FUSED_BYTES[name] if fused else MODEL_BYTES[name]
    label = name + ("_per_tensor" if args.per_tensor else "")
    if args.unfused and cuda and name in FUSED_BYTES:
        label += "_unfused"
    if args.bucket_cap_mb != 25.0 and name != "adamw_fused":
        label += f"_bucket{args.bucket_cap_mb:g}mb"
    row = {"path": label, "parameters": n, "steps": args.steps, "wall_ms": f"{wall:.3f}",
           "kernel_ms": f"{device_ms:.3f}", "launches_per_step": f"{launches:.0f}",
           "model_B_per_elem": b or "", "model_GB_per_s": f"{b * n / wall / 1e6:.0f}" if b else ""}
    del opt, params
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--paths", nargs="+", default=list(MODEL_BYTES))
    p.add_argument("--per-tensor", action="store_true",
                   help="per-tensor ops on GPU too (no multi-tensor forms, no fused passes): the baseline")
    p.add_argument("--unfused", action="store_true",
                   help="GPU: OnebitAdam's compression stage without its fused passes (use_backend('plain', "
                        "steps=the fused steps))")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="the 1-bit optimizers' bucket size")
    p.add_argument("--top", nargs="*", default=[], help="paths whose top ops to print")
    p.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "out", "profile.csv"))
    args = p.parse_args()
    device = torch.device(args.device)
    if args.per_tensor:
        _multi.applies = lambda tensors: False
    if args.unfused or args.per_tensor:
        use_backend("plain", steps=("adam", "zoa", "local", "warmup")).__enter__()  # for the whole process
    rows = []
    for name in args.paths:
        rows.append(run(name, args, device))
        print(rows[-1], file=sys.stderr, flush=True)
    cols = ["path", "wall_ms", "kernel_ms", "launches_per_step", "model_B_per_elem", "model_GB_per_s"]
    print(markdown_table(cols, [[r[c] for c in cols] for r in rows]))
    meta = provenance(device)
    print(write_csv(args.csv, [{**meta, **r} for r in rows], append=True))


if __name__ == "__main__":
    main()
