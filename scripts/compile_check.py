"""Compile every Triton kernel variant ahead of time for real GPUs (NVIDIA sm_80, sm_90; AMD
gfx942 = MI300, gfx90a = MI200); no GPU needed.

The variants are the launches onebit's launchers make (``onebit.kernels.triton_kernels``:
``worker_compress_launches``, ``server_reduce_launches``, ``decompress_launches``) built from
mock tensors (data pointer 0: 16-byte aligned like CUDA allocations) for every input dtype,
with ``n`` a multiple of 16 and not, and specialised by Triton's own binder exactly as a real
launch is (i32/i64, divisibility by 16, constexprs, the launchers' ``enable_fp_fusion``). Each
distinct variant is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
arch, 32))`` or ``GPUTarget("hip", arch, 64)`` (wavefront 64). One line per variant and target:
NVIDIA: registers, spills and stack (the log of ptxas -v as Triton runs it), shared memory, and the widths of
its global loads and stores (``v4.b32x16``: sixteen 128-bit loads); AMD: VGPRs, SGPRs, spills,
LDS and scratch (the code object's metadata) and its global/buffer load and store instructions
(``buffer.dwordx4*2``: two 128-bit loads). Every line ends with ``fma N``: the fused
floating-point multiply-adds in the generated code that come from the kernels' own arithmetic
(PTX ``fma.rn.*``; AMD ``v_fma*``, ``v_fmac*``, ``v_pk_fma*``), which must be 0 since the
launchers turn contraction off (``triton_kernels.FP_FUSION``; the comment there says why), except
in a variant that writes its one multiply-add with ``tl.fma`` (``FMA=True``: ZeroOneAdam's fold,
docs/ALGORITHMS.md 6.4), whose twin with the same arithmetic unfused (``FMA=False``) must show 0;
"(+M exact)": those AMD's correctly rounded division and square root (float32 and float64) and its
64-bit integer division are made of, and conversions folded into an add as ``x * 1.0 + y`` (``fma_count``).
With ``--paths``, where ``n`` is not a multiple of 16 each kernel is also compiled with one block
path alone: "full-block path" (what every block but the last runs) and "masked path", to read
each path's access widths. The launchers never launch these (the kernel they launch holds both
paths, the stricter test of registers and spills), so CI leaves them out: they were 58 of the
132 variants per target. The targets compile
in parallel (one process each, as many as there are cores). Also OnebitAdam's fused passes
(``onebit.kernels.fused.adam``: ``fold_worker_launches``, ``decompress_update_launches``) and the
DDP hook's GPU pre- and post-pass (``onebit.kernels.fused.hook``) and ZeroOneAdam's fused phase-1
passes (``onebit.kernels.fused.zero_one``); these fused passes must not spill.
Exits 1 if any variant fails to compile or has an FMA it should not have, or if a fused-pass
variant spills registers.

  python scripts/compile_check.py                               # sm_80, sm_90, gfx942, gfx90a
  python scripts/compile_check.py --archs 90,gfx942 --dump out/  # also write the IRs and asm
  python scripts/compile_check.py --archs 80 --paths              # and each block path alone
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

sys.dont_write_bytecode = True
_CACHE = tempfile.mkdtemp(prefix="onebit-compile-check-")
os.environ["TRITON_CACHE_DIR"] = _CACHE  # private cache: every run really compiles
os.environ.pop("TRITON_INTERPRET", None)  # the check compiles; the interpreter would not

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from onebit.kernels import sketch as ks  # noqa: E402
from onebit.kernels import triton_blocks as tb  # noqa: E402
from onebit.kernels import triton_kernels as tk  # noqa: E402
from onebit.kernels.fused import adam, stage, warmup  # noqa: E402
from onebit.kernels.fused import hook as th  # noqa: E402
from onebit.kernels.fused import zero_one as tz  # noqa: E402
from onebit.kernels.fused.table import Tiles  # noqa: E402
from onebit.kernels.layout import Layout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def launches(N: int = 2**26, W: int = 4, paths: bool = False):
    """(label, Launch) for every launch the launchers make, over dtypes and alignments of n;
    with ``paths``, where n (or the server's chunk) is not a multiple of 16, also each block
    path alone."""
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
                yield from _with_paths(tag, launch, split=paths and bool(align))
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):  # bfloat16 errors (read widened, stored rounded)
        bf = torch.bfloat16
        made = [*tk.worker_compress_launches(T(f32), T(bf), T(u8), T(f32), T(f64), T(i32), n, layout, True),
                *tk.decompress_launches(T(u8), T(f32), T(f32), T(bf), T(f32), n, layout, True)]
        for launch in made:
            yield f"x fp32, bf16 errors{align}", launch
    for size, align in ((N, ""), (N + 8 * W, "chunk % 16 != 0")):
        for e in (f32, torch.bfloat16):
            for launch in tk.server_reduce_launches(T(u8), T(f32), T(e), T(u8), T(f32), T(f64), T(i32),
                                                    Layout(size, W)):
                tag = align + (", bf16 errors" if e == torch.bfloat16 else "")
                yield from _with_paths(tag, launch, split=paths and bool(align) and e == f32)
    yield from block_launches(N, W, paths)
    yield from fused_launches(N, W)
    yield from hook_launches(N)
    yield from zoa_launches(N, W)
    yield from stage_launches(W)
    yield from sketch_launches(N)


def sketch_launches(N: int):
    """The hooks' clip sketch (onebit.kernels.sketch): float32, n a multiple of 16 and not, a key below
    and above 2^31 (an i32 or i64 argument)."""
    T, f32 = MockTensor, torch.float32
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):
        for key in (0x12345678, 0xDEADBEEF):
            yield f"sketch{align}", ks.sketch_launches(T(f32), n, key, T(f32), 4096)[0]


def mock_table(columns: int, N: int, per: int = 1024) -> SimpleNamespace:
    """A fused step's table (onebit.kernels.fused.table) of 17 tensors (a number that is not 1:
    Triton would make a 1 a constant) in mock tensors, its tiles made for N elements."""
    T, i32, i64 = MockTensor, torch.int32, torch.int64
    return SimpleNamespace(start=T(i64), count=T(i64), addr=T(i64, shape=[columns, 17]), K=17,
                           scal=T(torch.float32, shape=[17, 5]), tiles=Tiles(T(i32), T(i32), N, per))


def fused_launches(N: int, W: int):
    """OnebitAdam's fused passes (onebit.kernels.fused.adam): float32 only, n a multiple of 16
    and not."""
    T, f32, f64, u8 = MockTensor, torch.float32, torch.float64, torch.uint8
    layout, table = Layout(N, W), mock_table(3, N)
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):
        tag = f"fused{align}"
        for poison in (None, T(f32)):  # the step's agreement on the device (issue 57): poison and gate
            agreed = "" if poison is None else ", agreed on the device"
            for launch in adam.fold_worker_launches(T(f32), T(f32), T(u8), T(f32), T(f64), T(torch.int32),
                                                    table, n, layout, poison):
                yield tag + agreed, launch
            for launch in adam.decompress_update_launches(T(u8), T(f32), T(f32), T(f32), T(f32), table, n,
                                                          layout, 1.0, gate=poison is not None):
                yield tag + agreed, launch


def stage_launches(W: int):
    """OnebitAdam's and ZeroOneAdam's fused passes over every bucket of a stage (onebit.kernels.fused.stage;
    sizes in its bucket table): float32 and bfloat16 errors, with and without the agreement on the device,
    the synchronisation, and the kept messages' copy (gated, and not)."""
    T, f32, i32, i64 = MockTensor, torch.float32, torch.int32, torch.int64
    st = SimpleNamespace(table=T(i64, shape=[3, len(stage.FIELDS)]), map=T(i32), server_map=T(i32), lo=T(i32),
                         hi=T(i32), partials=T(torch.float64), tickets=T(i32), W=W, P=17, Q=5, B=3,
                         layouts=[Layout(2**20, W)])
    table = mock_table(3, 2**20)
    for ebf16 in (False, True):
        for poison in (None, T(f32)):
            tag = f"stage, {'bf16' if ebf16 else 'fp32'} errors"
            tag += "" if poison is None else ", agreed on the device"
            for launches in adam.stage_launches(st, table, 1.0, ebf16, poison).values():
                for launch in launches:
                    yield tag, launch
        for sync in (False, True):
            for fma in (True, False):
                made = tz.stage_launches(st, mock_table(4, 2**20), 1.0, ebf16, sync, fma)
                for launch in made["worker"] + made["finish"]:
                    yield f"zoa stage, {'bf16' if ebf16 else 'fp32'} errors", launch
        # phase 1's agreement on the device: the poison and the gate (the fold's FMA as the step runs it)
        made = tz.stage_launches(st, mock_table(4, 2**20), 1.0, ebf16, poison=T(f32), flag=T(torch.uint8))
        for launch in made["worker"] + made["finish"]:
            yield f"zoa stage, {'bf16' if ebf16 else 'fp32'} errors, agreed on the device", launch
    for launch in tz.wake_launches(st, mock_table(4, 2**20)):
        yield "zoa stage", launch
    for flag in (T(torch.uint8), None):
        for launch in stage.keep_launches(st, flag):
            yield "stage", launch


def zoa_launches(N: int, W: int):
    """ZeroOneAdam's fused passes (onebit.kernels.fused.zero_one), as fused_launches."""
    T, f32, f64, u8 = MockTensor, torch.float32, torch.float64, torch.uint8
    layout, table = Layout(N, W), mock_table(4, N)
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):
        made = []
        for sync in (False, True):
            made += [*tz.worker_launches(T(f32), T(u8), T(f32), T(f64), T(torch.int32), table, n, layout,
                                         sync),
                     *tz.step_launches(T(u8), T(f32), T(f32), T(f32), table, n, layout, 1.0, sync),
                     *tz.step_launches(T(u8), T(f32), T(f32), T(f32), table, n, layout, 1.0, sync, fma=False)]
        for agreed in (None, T(f32)):  # (the agreement on the device: its gate)
            made += tz.local_launches(mock_table(4, -(-n // 8) * 8, tz.LOCAL_BLOCK), n, 1.0, agreed)
            made += tz.moments_launches(mock_table(3, -(-n // 8) * 8, tz.LOCAL_BLOCK), n, agreed)
        for launch in made:
            yield f"zoa{align}", launch
        for gate in (None, T(f32)):  # OnebitAdam's warm-up update (its agreement on the device: the gate)
            made_w = warmup.launches(T(f32), T(f32), n, mock_table(2, -(-n // 8) * 8, warmup.BLOCK), gate)
            for launch in made_w:
                yield f"warmup{align}", launch
        agreed = [*tz.worker_launches(T(f32), T(u8), T(f32), T(f64), T(torch.int32), table, n, layout,
                                      poison=T(f32)),
                  *tz.step_launches(T(u8), T(f32), T(f32), T(f32), table, n, layout, 1.0, flag=T(u8))]
        for launch in agreed:
            yield f"zoa{align}, agreed on the device", launch


def hook_launches(N: int):
    """The hooks' Triton pre- and post-pass (onebit.kernels.fused.hook): float32, n a multiple of
    16 and not, a table of 17 momenta."""
    T, f32, f64 = MockTensor, torch.float32, torch.float64
    for n, align in ((N, ""), (N - 3, ", n % 16 != 0")):
        t = mock_table(2, -(-n // 8) * 8, th.BLOCK)
        made = [*th.pre_launches(T(f32), T(f64), t, n), *th.post_launches(T(f32), t, n)]
        for launch in made:
            yield f"hook{align}", launch


def block_launches(N: int, W: int, paths: bool = False):
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
                    yield from _with_paths(tag, launch, split=paths and bool(align)
                                           and "PATHS" in launch.constexprs)
        for launch in tb.server_reduce_launches(T(u8), T(f32), T(f32), T(u8), T(f32), T(i32), T(i32), layout):
            yield f"block {block}", launch
        if block in (64, 4096):  # bfloat16 errors (read widened, stored rounded)
            bf, m = torch.bfloat16, N - 8 * 3
            made = [*tb.worker_compress_launches(T(f32), T(bf), T(u8), T(f32), T(i32), T(i32), m, layout,
                                                 True),
                    *tb.decompress_launches(T(u8), T(f32), T(f32), T(bf), T(f32), m, layout, True),
                    *tb.server_reduce_launches(T(u8), T(f32), T(bf), T(u8), T(f32), T(i32), T(i32), layout)]
            for launch in made:
                yield f"block {block}, bf16 errors", launch


def _with_paths(tag: str, launch, split: bool):
    """The launch as made (both block paths); with ``split``, each path compiled alone too:
    the masked path is what every block ran before full blocks went unmasked."""
    yield tag, launch
    if split:
        for path, label in ((tk.FULL_PATH, "full-block path"), (tk.MASKED_PATH, "masked path")):
            alone = dataclasses.replace(launch, constexprs={**launch.constexprs, "PATHS": path})
            yield ", ".join(t for t in (tag, label) if t), alone


def specialise(launch, backend, fp_fusion: bool | None = None):
    """What JITFunction.run does before compiling: bind, specialise, pack (Triton 3.x), with the
    launchers' contraction setting (``fp_fusion`` overrides it: tests/test_compile_check.py)."""
    fn = launch.kernel
    fusion = tk.FP_FUSION if fp_fusion is None else fp_fusion
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, enable_fp_fusion=fusion)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, spec, opts)


def ptxas_usage(log: str) -> dict:
    """Registers, spills and stack from the log of the ptxas run that made the kernel's cubin
    (Triton runs it with -v; ``knobs.nvidia.dump_ptxas_log`` prints that log)."""
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


_AMD_META = ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count", "group_segment_fixed_size",
             "private_segment_fixed_size")
_AMD_ACCESS = re.compile(r"\b(global|buffer)_(load|store)_(\w+)")
_FMA = {"cuda": re.compile(r"\bfma\.rn(?:\.ftz)?(?:\.sat)?\.(?:f16|bf16|f32|f64)(?:x2)?\b"),
        "hip": re.compile(r"\bv_(?:pk_)?fma(?:c|mk|ak)?_(?:f16|bf16|f32|f64)\w*"
                          r"|\bv_fma_mix\w*|\bv_mac_f32\w*")}


def amd_usage(amdgcn: str) -> dict:
    """VGPRs, SGPRs, spills, LDS and scratch bytes from the code object's metadata."""
    found = {}
    for key in _AMD_META:
        m = re.search(rf"\.{key}:\s+(\d+)", amdgcn)
        found[key] = int(m.group(1)) if m else -1
    return found


def amd_widths(amdgcn: str) -> str:
    """Global and buffer loads and stores by instruction, e.g. ``ld buffer.dwordx4*2 st global.byte*1``
    (two 128-bit buffer loads, one byte store)."""
    counts: dict[str, dict[str, int]] = {"load": {}, "store": {}}
    for space, op, width in _AMD_ACCESS.findall(amdgcn):
        key = f"{space}.{width}"
        counts[op][key] = counts[op].get(key, 0) + 1
    return " ".join(f"{op} " + (" ".join(f"{k}*{v}" for k, v in sorted(c.items())) or "-")
                    for op, c in (("ld", counts["load"]), ("st", counts["store"])))


# AMD lowers some operations to short sequences that use FMAs by design (correctly rounded
# IEEE division and square root: v_div_scale ... v_div_fixup, v_rsq + Newton steps, v_sqrt_f32 +
# the residuals of its two neighbours; 64-bit
# integer division through float32, scaling by 2^32 exactly) or folds a conversion into an add
# as x * 1.0 + y (v_fma_mix_f32: an exact product, one rounding, as convert-then-add). Those
# are not contractions of the kernels' own products; the fma column counts them apart.
_EXPANSION_CONSTANTS = ("0x4f800000", "0xcf800000", "0x2f800000", "0x5f7ffffc")


def fma_count(code: str, backend: str) -> tuple[int, int]:
    """(contracted, expansion): fused floating-point multiply-adds in the PTX (cuda) or the
    AMDGCN assembly (hip) that come from the kernels' arithmetic, and those inside the lowering
    of division, square root and 64-bit integer division (AMD only; PTX keeps those as
    div.rn / sqrt.rn / div.u64 instructions)."""
    if backend == "cuda":
        return len(_FMA["cuda"].findall(code)), 0
    contracted = expansion = 0
    scales = fixups = sqrt_fmas = 0  # a division opens with two v_div_scale, closes with v_div_fixup;
    roots: set[tuple[str, str]] = set()  # the float32 square roots seen: (result, operand) registers
    for line in code.splitlines():  # the scheduler interleaves several divisions' sequences
        text = line.strip()
        if text.startswith(("v_div_scale_f32", "v_div_scale_f64")):
            scales += 1
        in_div = scales > 2 * fixups
        if text.startswith("v_rsq_f64"):
            sqrt_fmas += 7  # LLVM's float64 sqrt: v_rsq_f64 and 7 Newton FMAs (interleaved when several)
        if text.startswith("v_sqrt_f32") and " " in text:
            ops = [t.strip() for t in text.split(None, 1)[1].split(",")]
            if len(ops) == 2:
                roots.add((ops[0], ops[1]))
        if _FMA["hip"].match(text):
            sources = [t.strip() for t in text.split(None, 1)[1].split(",")][1:] if " " in text else []
            by_one = len(sources) >= 2 and sources[1].lstrip("-") == "1.0"  # x * 1.0 + y: one rounding
            newton = sqrt_fmas > 0 and "_f64" in text.split()[0]
            # LLVM's correctly rounded float32 sqrt: s = v_sqrt_f32(x), then the residuals
            # fma(-(s -+ 1 ulp), s, x) of its two neighbours pick the rounding
            residual = len(sources) == 3 and sources[0].startswith("-") and (sources[1], sources[2]) in roots
            if in_div or newton or by_one or residual or any(c in text for c in _EXPANSION_CONSTANTS):
                expansion += 1
                sqrt_fmas -= newton
            else:
                contracted += 1
        if text.startswith(("v_div_fixup_f32", "v_div_fixup_f64")):
            fixups += 1
    return contracted, expansion


def target_of(arch: str):
    """GPUTarget for "80" / "90" (NVIDIA, warp 32) or "gfx942" / "gfx90a" (AMD, wavefront 64)."""
    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    return GPUTarget("cuda", int(arch), 32)


def compile_target(arch: str, dump: str | None = None,
                   paths: bool = False) -> tuple[list[str], int, int, int, int]:
    """Compile every variant for one target: (lines, compiled, failures, variants with an FMA,
    variants of the fused optimizer passes that spill registers)."""
    target = target_of(arch)
    backend = make_backend(target)
    knobs.nvidia.dump_ptxas_log = True  # the registers and spills of the compile itself (ptxas -v)
    label = f"sm_{arch}" if target.backend == "cuda" else arch
    lines, compiled, failures, fused, spilled, seen = [], 0, 0, 0, 0, set()
    for tag, launch in launches(paths=paths):
        options, signature, constexprs, attrs = specialise(launch, backend)
        key = (launch.name, str(signature), str(constexprs), str(attrs))
        if key in seen:
            continue
        seen.add(key)
        name = f"{launch.name} ({tag})" if tag else launch.name
        try:
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
            if target.backend == "cuda":
                code = kernel.asm["ptx"]
                use = ptxas_usage(log.getvalue())
                spills = use["spills"] != "0/0B"
                usage = (f"regs {use['regs']:3d}  spills {use['spills']:6} stack {use['stack']}B  "
                         f"shared {kernel.metadata.shared}B  warps {kernel.metadata.num_warps}  "
                         f"{vector_widths(code)}")
            else:
                code = kernel.asm["amdgcn"]
                use = amd_usage(code)
                spills = use["vgpr_spill_count"] > 0 or use["sgpr_spill_count"] > 0
                usage = (f"vgpr {use['vgpr_count']:3d} sgpr {use['sgpr_count']:3d}  spills "
                         f"{use['vgpr_spill_count']}/{use['sgpr_spill_count']}  "
                         f"lds {use['group_segment_fixed_size']}B  "
                         f"scratch {use['private_segment_fixed_size']}B  "
                         f"warps {kernel.metadata.num_warps}  {amd_widths(code)}")
        except Exception as exc:  # noqa: BLE001 - report every variant, then fail
            failures += 1
            first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
            lines.append(f"{label} {name:44} FAILED: {first[0][:300]}")
            continue
        compiled += 1
        fma, expansion = fma_count(code, target.backend)
        # a variant that writes its multiply-add (FMA=True) may show it: its twin (FMA=False) may not
        contracted = fma and not tk.FP_FUSION and not launch.constexprs.get("FMA", False)
        if contracted:
            fused += 1
        wrong = "  <- contraction is off" if contracted else ""
        if spills and launch.kernel.fn.__module__ in (adam.__name__, th.__name__, tz.__name__):  # issue 38
            spilled += 1
            wrong += "  <- spills"
        lines.append(f"{label} {name:44} {usage}  fma {fma}" + (f" (+{expansion} exact)" if expansion
                                                                  else "") + wrong)
        if dump:
            os.makedirs(dump, exist_ok=True)
            base = os.path.join(dump, f"{label}-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", name))
            for ext in [k for k in ("ttir", "ttgir", "llir", "ptx", "amdgcn") if k in kernel.asm]:
                with open(f"{base}.{ext}", "w") as fh:
                    fh.write(kernel.asm[ext])
    return lines, compiled, failures, fused, spilled


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="80,90,gfx942,gfx90a",
                   help="targets, comma-separated: NVIDIA compute capabilities, AMD gfx names")
    p.add_argument("--dump", default=None, help="write each variant's IRs and assembly here")
    p.add_argument("--paths", action="store_true",
                   help="also compile each block path alone where n is not a multiple of 16")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="targets compiled at once")
    args = p.parse_args(argv)
    from triton.backends.nvidia.compiler import get_ptxas

    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    cuda = [a for a in archs if not a.startswith("gfx")]
    print(f"triton {triton.__version__}, torch {torch.__version__}; N = 2**26, W = 4; fp fusion "
          f"{'on' if tk.FP_FUSION else 'off'} (triton_kernels.FP_FUSION); ptxas "
          + ", ".join(f"sm_{a} {get_ptxas(int(a)).version.strip().splitlines()[-1]}" for a in cuda),
          flush=True)
    t0 = time.time()
    import concurrent.futures
    import multiprocessing

    jobs = max(1, min(args.jobs, len(archs)))
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(compile_target, archs, [args.dump] * len(archs),
                                [args.paths] * len(archs)))
    compiled = failures = fused = spilled = 0
    for lines, c, f, u, s in results:
        print("\n".join(lines), flush=True)
        compiled, failures, fused, spilled = compiled + c, failures + f, fused + u, spilled + s
    print(f"{compiled} variants compiled for {', '.join(archs)}, {failures} failed, {fused} with an FMA "
          f"while contraction is off, {spilled} fused-pass variants that spill, {time.time() - t0:.0f} s",
          flush=True)
    return 1 if failures or fused or spilled or not compiled else 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    finally:
        shutil.rmtree(_CACHE, ignore_errors=True)
    sys.exit(code)
