"""Compile every Triton kernel variant ahead of time for real GPUs (sm_80, sm_90); no GPU needed.

The variants are the launches onebit's launchers make (``onebit.kernels.triton_kernels``:
``worker_compress_launches``, ``server_reduce_launches``, ``decompress_launches``) built from
mock tensors (data pointer 0: 16-byte aligned like CUDA allocations) for every input dtype,
with ``n`` a multiple of 16 and not, and specialised by Triton's own binder exactly as a real
launch is (i32/i64, divisibility by 16, constexprs). Each distinct variant is compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``; ptxas is re-run on
its PTX to read registers, spills and stack. One line per variant and target: registers,
spills, shared memory, and the widths of its global loads and stores (``v4.b32x16``: sixteen
128-bit loads). Where ``n`` is not a multiple of 16 each kernel is also compiled with one
block path alone: "full-block path" (what every block but the last runs) and "masked path"
(what every block ran before full blocks went unmasked). Exits 1 if any variant fails to
compile.

  python scripts/compile_check.py                  # sm_80 and sm_90
  python scripts/compile_check.py --archs 90 --dump out/   # also write ttir/ttgir/llir/ptx
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
_CACHE = tempfile.mkdtemp(prefix="onebit-compile-check-")
os.environ["TRITON_CACHE_DIR"] = _CACHE  # private cache: every run really compiles
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, set to silence a warning
os.environ.pop("TRITON_INTERPRET", None)  # the check compiles; the interpreter would not

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from onebit.kernels import triton_blocks as tb  # noqa: E402
from onebit.kernels import triton_kernels as tk  # noqa: E402
from onebit.kernels.layout import Layout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def launches(N: int = 2**26, W: int = 4):
    """(label, Launch) for every launch the launchers make, over dtypes and alignments of n;
    where n (or the server's chunk) is not a multiple of 16, also each block path alone."""
    T, f32, f64, u8, i32 = MockTensor, torch.float32, torch.float64, torch.uint8, torch.int32
    layout = Layout(N, W)
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):
        for dname, d in DTYPES.items():
            tag = f"x {dname}{align}"
            out, words = T(d), T(f32)  # no worker error: the kernel gets `out` in its place
            made = [*tk.worker_compress_launches(T(d), T(f32), T(u8), T(f32), T(f64), T(i32), n, layout,
                                                 True),
                    *tk.decompress_launches(T(u8), T(f32), T(d), T(f32), T(f32), n, layout, True),
                    *tk.decompress_launches(T(u8), words, out, out, words, n, layout, False)]
            for launch in made:
                yield from _with_paths(tag, launch, split=bool(align))
    for size, align in ((N, ""), (N + 8 * W, "chunk % 16 != 0")):
        for launch in tk.server_reduce_launches(T(u8), T(f32), T(f32), T(u8), T(f32), T(f64), T(i32),
                                                Layout(size, W)):
            yield from _with_paths(align, launch, split=bool(align))
    yield from block_launches(N, W)


def block_launches(N: int, W: int):
    """The block-scale kernels (onebit.kernels.triton_blocks) at the hooks' default block (64)
    and at the smallest and largest block they take, n a multiple of the tile and not."""
    T, f32, u8, i32 = MockTensor, torch.float32, torch.uint8, torch.int32
    for block in (64, 8, 4096):
        layout = Layout(N, W, block)
        for n, align in ((N, ""), (N - 8 * 3, ", n % 4096 != 0")):
            dtypes = DTYPES.items() if block == 64 else [("fp32", f32)]
            for dname, d in dtypes:
                tag = f"block {block}, x {dname}{align}"
                out, words = T(d), T(f32)
                made = [*tb.worker_compress_launches(T(d), T(f32), T(u8), T(f32), T(i32), T(i32), n, layout,
                                                     True),
                        *tb.decompress_launches(T(u8), T(f32), T(d), T(f32), T(f32), n, layout, True),
                        *tb.decompress_launches(T(u8), words, out, out, words, n, layout, False)]
                for launch in made:  # the error-update kernel has one (masked) path only
                    yield from _with_paths(tag, launch, split=bool(align) and "PATHS" in launch.constexprs)
        for launch in tb.server_reduce_launches(T(u8), T(f32), T(f32), T(u8), T(f32), T(i32), T(i32), layout):
            yield f"block {block}", launch


def _with_paths(tag: str, launch, split: bool):
    """The launch as made (both block paths); with ``split``, each path compiled alone too:
    the masked path is what every block ran before full blocks went unmasked."""
    yield tag, launch
    if split:
        for path, label in ((tk.FULL_PATH, "full-block path"), (tk.MASKED_PATH, "masked path")):
            alone = dataclasses.replace(launch, constexprs={**launch.constexprs, "PATHS": path})
            yield ", ".join(t for t in (tag, label) if t), alone


def specialise(launch, backend):
    """What JITFunction.run does before compiling: bind, specialise, pack (Triton 3.x)."""
    fn = launch.kernel
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, spec, opts)


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers, spills and stack from the ptxas Triton uses, run with its flags and -v."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", path, "-o", os.path.join(d, "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"regs": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spills": f"{spills.group(1)}/{spills.group(2)}B" if spills else "0/0B",
            "stack": int(stack.group(1)) if stack else 0}


_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9]+)*?(?:\.(v[248]))?\.([bsuf](?:8|16|32|64))\b")


def vector_widths(ptx: str) -> str:
    """Global loads and stores by width, e.g. ``ld v4.b32x16 v1.b32x32 st v1.b8x4``."""
    counts: dict[str, dict[str, int]] = {"ld": {}, "st": {}}
    for op, vec, kind in _ACCESS.findall(ptx):
        key = f"{vec or 'v1'}.{kind}"
        counts[op][key] = counts[op].get(key, 0) + 1
    return " ".join(f"{op} " + (" ".join(f"{k}x{v}" for k, v in sorted(c.items())) or "-")
                    for op, c in counts.items())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="80,90", help="compute capabilities, comma-separated")
    p.add_argument("--dump", default=None, help="write each variant's ttir/ttgir/llir/ptx here")
    args = p.parse_args(argv)
    from triton.backends.nvidia.compiler import get_ptxas

    archs = [int(a) for a in args.archs.split(",")]
    print(f"triton {triton.__version__}, torch {torch.__version__}; N = 2**26, W = 4; ptxas "
          + ", ".join(f"sm_{a} {get_ptxas(a).version.strip().splitlines()[-1]}" for a in archs), flush=True)
    failures, compiled, t0 = 0, 0, time.time()
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        seen = set()
        for tag, launch in launches():
            options, signature, constexprs, attrs = specialise(launch, backend)
            key = (launch.name, str(signature), str(constexprs), str(attrs))
            if key in seen:
                continue
            seen.add(key)
            name = f"{launch.name} ({tag})" if tag else launch.name
            try:
                kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
                use = ptxas_usage(kernel.asm["ptx"], arch)
            except Exception as exc:  # noqa: BLE001 - report every variant, then fail
                failures += 1
                first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
                print(f"sm_{arch} {name:44} FAILED: {first[0][:300]}", flush=True)
                continue
            compiled += 1
            print(f"sm_{arch} {name:44} regs {use['regs']:3d}  spills {use['spills']:6} "
                  f"stack {use['stack']}B  "
                  f"shared {kernel.metadata.shared}B  warps {kernel.metadata.num_warps}  "
                  f"{vector_widths(kernel.asm['ptx'])}", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                base = os.path.join(args.dump, f"sm_{arch}-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", name))
                for ext in ("ttir", "ttgir", "llir", "ptx"):
                    with open(f"{base}.{ext}", "w") as fh:
                        fh.write(kernel.asm[ext])
    print(f"{compiled} variants compiled, {failures} failed, {time.time() - t0:.0f} s", flush=True)
    return 1 if failures or not compiled else 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    finally:
        shutil.rmtree(_CACHE, ignore_errors=True)
    sys.exit(code)
