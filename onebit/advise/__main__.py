"""``torchrun --nproc-per-node W -m onebit.advise [--params P]``: should this cluster compress?

Measures float32 and bf16 ``all_reduce`` and onebit's ``compressed_allreduce`` on the links of
this run (a sweep of message sizes up to ``--params``), fits the model of docs/speedup.md to
them, and ends with a one-line verdict and its reason. Start it exactly as your training
(same nodes, ranks per node, backend): the tensors live on CUDA when a GPU is visible (NCCL),
else on the CPU (gloo). ``--per-node L`` measures the links inside a node and between nodes
separately as well (a 2-D mesh of nodes x L ranks; torchrun's LOCAL_WORLD_SIZE by default on
several nodes).

Exit status: 0 it ran (with ``--exit-code``: 0 "compress", 1 "do not compress"); 2 bad
arguments; 3 not started by torchrun with at least 2 ranks, or the process group failed to
start; 4 a measurement failed (a collective raised or timed out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

EXIT_OK, EXIT_DO_NOT, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_MEASUREMENT = 0, 1, 2, 3, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m onebit.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=None, metavar="P",
                   help="the model's parameter count (the gradient all-reduced each step); the sweep "
                   "runs up to it and the verdict is for it (default: a sweep to 2^24, verdict at 2^24)")
    p.add_argument("--per-node", type=int, default=None, metavar="L",
                   help="ranks per node: also measure inside a node and between nodes, and predict the "
                   "hierarchical all-reduce (default: torchrun's LOCAL_WORLD_SIZE when it is below the "
                   "world size)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--step-ms", type=float, default=None,
                      help="compute of one training step in ms (forward, backward, optimizer), without "
                      "communication")
    step.add_argument("--measure-step", default=None, metavar="FILE",
                      help="a Python file defining step(): one forward, backward and optimizer step of "
                      "your model on this rank, without communication; timed here")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction (0..1) of the dense all-reduce your DDP already hides behind backward "
                   "(default 0)")
    p.add_argument("--block", default="64",
                   help="elements per scale of the 1-bit call (default 64, the hooks' wire format; "
                   "'none': one scale per chunk, the 1-bit optimizers' default)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per size and collective (default 5)")
    p.add_argument("--max-seconds", type=float, default=2.0,
                   help="skip a size whose call would take longer (extrapolated); the model covers it "
                   "(default 2)")
    p.add_argument("--min-elements", type=int, default=1 << 10, help="smallest size of the sweep")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--exit-code", action="store_true",
                   help="exit 1 when the verdict is 'do not compress' (for scripts)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    problems = []
    if args.params is not None and args.params < 1:
        problems.append(f"--params: expected a positive count, got {args.params}")
    if args.per_node is not None and args.per_node < 1:
        problems.append(f"--per-node: expected a positive count, got {args.per_node}")
    if not 0.0 <= args.overlap <= 1.0:
        problems.append(f"--overlap: expected a fraction in [0, 1], got {args.overlap}")
    if args.step_ms is not None and not (args.step_ms >= 0 and math.isfinite(args.step_ms)):
        problems.append(f"--step-ms: expected a finite number >= 0, got {args.step_ms}")
    if args.repeats < 1:
        problems.append(f"--repeats: expected at least 1, got {args.repeats}")
    if not args.max_seconds > 0:
        problems.append(f"--max-seconds: expected a positive number, got {args.max_seconds}")
    if args.min_elements < 1:
        problems.append(f"--min-elements: expected a positive count, got {args.min_elements}")
    if args.block.lower() == "none":
        args.block = None
    else:
        try:
            args.block = int(args.block)
        except ValueError:
            args.block = -1
        if args.block <= 0 or args.block % 8:
            problems.append("--block: expected a positive multiple of 8 or 'none'")
    if args.measure_step is not None and not os.path.isfile(args.measure_step):
        problems.append(f"--measure-step: no such file {args.measure_step}")
    if problems:
        p.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if "RANK" not in os.environ or world < 2:
        print("onebit.advise: start it with torchrun on at least 2 ranks, as your training, e.g.\n"
              "  torchrun --nproc-per-node 4 -m onebit.advise --params 125000000", file=sys.stderr)
        return EXIT_ENVIRONMENT
    per_node = args.per_node
    if per_node is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        per_node = local if 1 < local < world else None
    if per_node is not None and (world % per_node or per_node in (1, world)):
        if args.per_node is not None:
            print(f"onebit.advise: --per-node {per_node} must divide the world size {world} and lie "
                  "strictly between 1 and it", file=sys.stderr)
            return EXIT_USAGE
        per_node = None

    import torch
    import torch.distributed as dist

    from .run import advise

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as e:  # noqa: BLE001 - reported with the exit status that says so
        print(f"onebit.advise: the process group did not start: {e}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    rank0 = dist.get_rank() == 0
    try:
        report, text = advise(args, device, per_node, progress=None if args.quiet or not rank0 else _progress)
    except Exception as e:  # noqa: BLE001 - a failed measurement: say what and exit 4
        print(f"onebit.advise: rank {dist.get_rank()}: a measurement failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return EXIT_MEASUREMENT
    if rank0:
        print(json.dumps(report) if args.json else text, flush=True)
    dist.barrier()  # every rank done with its collectives before teardown
    dist.destroy_process_group()
    if args.exit_code and report["verdict"] != "compress":
        return EXIT_DO_NOT
    return EXIT_OK


def _progress(message: str) -> None:
    print(f"onebit.advise: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
