"""The C sign-packing passes (onebit.kernels.cpu_simd), every variant this CPU runs (AVX-512, AVX2,
portable C), against the plain-torch path: packed bits bitwise, float64 sums of squares to 1e-12
(exact squares added in another order). Sizes not a multiple of 16, odd world sizes, block lengths
that are odd multiples of 8, NaN, inf and -0.0, unaligned views and strided rows; a block's sum
independent of the thread count and of where the piece starts; a build that fails warns once and
leaves the compiled path."""

from __future__ import annotations

import warnings

import pytest
import torch

from onebit.kernels import cpu_simd, torch_kernels
from onebit.kernels.fused import adam

pytestmark = pytest.mark.skipif("not cpu_simd.library()", reason="no C compiler here: the compiled path runs")


def _isas() -> list[int]:
    return list(range(cpu_simd.best_isa() + 1))


def _inputs(n: int, seed: int, offset: int = 3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n + offset, generator=g) * torch.rand(n + offset, generator=g).pow(4) * 3
    x = base[offset:]  # a view that starts off any vector alignment
    x[: n // 7] = 0.0  # a run of zeros (unused rows)
    e = torch.randn(n, generator=g) * 0.2
    e[: n // 11] = 0.0
    if n > 40:
        x[20], e[20] = -0.0, -0.0
        x[33] = float("inf")
        e[37] = float("nan")
    return x, e


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    nan = ref.isnan()
    return bool(torch.equal(got.isnan(), nan)
                and ((got - ref).abs() <= 1e-12 * ref.abs()).masked_fill(nan | ref.isinf(), True).all()
                and torch.equal(got[ref.isinf()], ref[ref.isinf()]))


@pytest.mark.parametrize("n", [8, 24, 8 * 101, (1 << 16) + 40])  # the last one on every thread
@pytest.mark.parametrize("seed", [0, 1])
def test_encode_is_the_plain_paths_bits_and_sums(n, seed):
    x, e = _inputs(n, seed)
    z = x + e
    bits_ref, sq = torch_kernels.pack_signs(z), z.double() ** 2
    for isa in _isas():
        bits = torch.full((n // 8,), 0xA5, dtype=torch.uint8)
        total = cpu_simd.encode_total(x, e, bits, isa)
        assert torch.equal(bits, bits_ref), isa
        assert _close(torch.tensor([total], dtype=torch.float64), sq.sum().view(1)), (isa, total)
        for block in (8, 24, 64, 96):
            if n % block:
                continue
            bits = torch.full((n // 8,), 0xA5, dtype=torch.uint8)
            sums = cpu_simd.encode_blocks(x, e, bits, block, isa)
            assert torch.equal(bits, bits_ref), (isa, block)
            assert _close(sums, sq.view(-1, block).sum(-1)), (isa, block)


def test_finite_inputs_give_finite_sums_close_to_float64():
    x, e = torch.randn(8 * 999), torch.randn(8 * 999)
    ref = float(((x + e).double() ** 2).sum())
    for isa in _isas():
        got = cpu_simd.encode_total(x, e, torch.empty(999, dtype=torch.uint8), isa)
        assert abs(got - ref) <= 1e-12 * ref, (isa, got, ref)


def test_a_blocks_sum_does_not_depend_on_threads_or_where_the_piece_starts():
    # the sliced calls (onebit.collectives._pipeline) encode pieces of a chunk: each block's sum
    # must be the one the whole chunk's call gives, bitwise
    x, e = torch.randn(64 * 4096), torch.randn(64 * 4096)
    whole = cpu_simd.encode_blocks(x, e, torch.empty(x.numel() // 8, dtype=torch.uint8), 64)
    lo, hi = 64 * 1000, 64 * 3001
    piece = cpu_simd.encode_blocks(x[lo:hi], e[lo:hi], torch.empty((hi - lo) // 8, dtype=torch.uint8), 64)
    assert torch.equal(piece, whole[1000:3001])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_simd.encode_blocks(x, e, torch.empty(x.numel() // 8, dtype=torch.uint8), 64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)


@pytest.mark.parametrize("W", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [8, 24, 8 * 131, (1 << 16) + 24])
def test_server_is_the_plain_paths_sum_bits_and_sums(W, n):
    g = torch.Generator().manual_seed(W * 1000 + n)
    rows = torch.randint(0, 256, (W, n // 8 + 5), generator=g, dtype=torch.uint8)
    rows = rows[:, 2 : n // 8 + 2]  # rows strided, starting off alignment
    e = torch.randn(n, generator=g) * 0.05
    e[: n // 9], e[3] = 0.0, -0.0
    signs = [torch_kernels.unpack_signs(rows[r].contiguous()) for r in range(W)]

    def m_of(w):  # the plain path's sum, ranks in order, then e
        m = signs[0] * w[0]
        for r in range(1, W):
            m = m + signs[r] * w[r]
        return m + e

    w = torch.rand(W, generator=g) * 0.1
    if W > 2:
        w[1] = 0.0  # a rank whose scale is zero
    m = m_of(w)
    for isa in _isas():
        out = torch.full((n // 8,), 0xA5, dtype=torch.uint8)
        total = cpu_simd.server_total(rows, w, e, out, isa)
        assert torch.equal(out, torch_kernels.pack_signs(m)), isa
        assert _close(torch.tensor([total], dtype=torch.float64), (m.double() ** 2).sum().view(1)), isa
        for block in (8, 24, 64):
            if n % block:
                continue
            wb = torch.rand(W, n // block, generator=g)
            mb = m_of([wb[r].repeat_interleave(block) for r in range(W)])
            out = torch.full((n // 8,), 0xA5, dtype=torch.uint8)
            sums = cpu_simd.server_blocks(rows, wb, e, out, block, isa)
            assert torch.equal(out, torch_kernels.pack_signs(mb)), (isa, block)
            assert _close(sums, (mb.double() ** 2).view(-1, block).sum(-1)), (isa, block)


def test_bad_buffers_are_refused_before_any_write():
    x, e, bits = torch.randn(64), torch.randn(64), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float32 x and e"):
        cpu_simd.encode_total(x.double(), e, bits)
    with pytest.raises(ValueError, match="n / 8"):
        cpu_simd.encode_total(x, e, torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block: expected a multiple of 8 dividing 64"):
        cpu_simd.encode_blocks(x, e, bits, 12)
    assert torch.equal(bits, torch.zeros(8, dtype=torch.uint8))


def test_the_isa_cap_lowers_the_level_and_names_itself_when_wrong(monkeypatch):
    from onebit.kernels.backends import use_backend

    best = int(cpu_simd.library().onebit_best_isa())
    for value, level in (("native:avx512", 2), ("native:avx2", 1), ("native:c", 0), ("native", 2), ("", 2)):
        monkeypatch.setenv("ONEBIT_BACKEND", value)
        assert cpu_simd.best_isa() == min(best, level), value
    with use_backend("native:c", steps=["codec"]):  # a block's cap wins over the environment's
        assert cpu_simd.best_isa() == 0
    monkeypatch.setenv("ONEBIT_BACKEND", "native:sse4")
    with pytest.raises(ValueError, match=r"ONEBIT_BACKEND: expected one of plain, native, triton \(or "
                                         r"native:c\|avx2\|avx512\), got 'native:sse4'"):
        cpu_simd.best_isa()


def test_a_compile_error_names_the_file_and_line(monkeypatch, tmp_path):
    from onebit.kernels.native import build

    broken = tmp_path / "codec.c"
    broken.write_text(build.SOURCES[0].read_text() + "\nthis is not C;\n")
    (tmp_path / "native.h").write_text(build.HEADERS[0].read_text())
    monkeypatch.setattr(build, "SOURCES", (broken, *build.SOURCES[1:]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"codec\.c:\d+:\d+: error"):
        build.build()


def test_a_failed_build_warns_once_and_leaves_the_compiled_path(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_simd, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached library to fall back on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not cpu_simd.available() and cpu_simd.library() is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "could not be built" in messages[0], messages
    monkeypatch.setattr(cpu_simd, "_state", {})
    monkeypatch.setenv("ONEBIT_CPU_SIMD", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_simd.available()  # switched off: no build, no warning


@pytest.mark.parametrize("block", [None, 8, 64, 88])
@pytest.mark.parametrize("n", [24 * 8, 8 * 24 * 7, 64 * 1031 + 0])
@pytest.mark.parametrize("update", [True, False])
def test_decompress_is_the_plain_error_update_and_decode(block, n, update):
    if block is not None and n % block:
        pytest.skip("n is not whole blocks")
    g = torch.Generator().manual_seed(n + (block or 0))
    per = 1 if block is None else n // block
    bits = torch.randint(0, 256, (n // 8,), generator=g, dtype=torch.uint8)
    scales, ws = torch.rand(per, generator=g), torch.rand(per, generator=g)
    scales[0] = 0.0
    x, e = _inputs(n, n, offset=1)
    x, e = x.nan_to_num(0.0, 0.0, 0.0), e.nan_to_num(0.0, 0.0, 0.0)  # finite: the update runs only then
    B = n if block is None else block
    z = x + e
    e_ref = z - torch.copysign(ws.repeat_interleave(B), z + 0.0)
    out_ref = (torch_kernels.unpack_signs(bits).view(-1, B) * scales.view(-1, 1)).view(-1)
    for isa in _isas():
        out, ee = x.clone(), e.clone()
        cpu_simd.decompress(bits, scales, out, block, ee if update else None, ws if update else None, isa=isa)
        assert torch.equal(out, out_ref), isa
        assert torch.equal(ee, e_ref if update else e), isa


@pytest.mark.parametrize("W", [1, 3, 4])
@pytest.mark.parametrize("block", [None, 8, 64, 88])
def test_server_update_is_the_plain_error_pass(W, block):
    n = 64 * 517
    g = torch.Generator().manual_seed(W)
    rows = torch.randint(0, 256, (W, n // 8 + 3), generator=g, dtype=torch.uint8)[:, 1 : n // 8 + 1]
    per = 1 if block is None else n // block
    B = n if block is None else block
    w = torch.rand(W, per, generator=g).squeeze(1) if block is None else torch.rand(W, per, generator=g)
    e = torch.randn(n, generator=g) * 0.05
    e[5] = -0.0
    s = torch.rand(per, generator=g)
    signs = [torch_kernels.unpack_signs(rows[r].contiguous()) for r in range(W)]
    m = (signs[0].view(-1, B) * w[0].view(-1, 1)).view(-1)
    for r in range(1, W):
        m = m + (signs[r].view(-1, B) * w[r].view(-1, 1)).view(-1)
    m = m + e
    ref = m - torch.copysign(s.repeat_interleave(B), m + 0.0)
    for isa in _isas():
        got = e.clone()
        cpu_simd.server_update(rows, w.contiguous(), got, s, block, isa=isa)
        assert torch.equal(got, ref), isa


@pytest.mark.parametrize("n", [1, 7, 17, 1000, (1 << 16) + 3])
def test_sum_of_squares_is_float64s(n):
    x, _ = _inputs(n, n)
    ref = (x.double() ** 2).sum().view(1)
    for isa in _isas():
        assert _close(torch.tensor([cpu_simd.sumsq(x, isa)], dtype=torch.float64), ref), isa


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("W, n", [(1, 70001), (3, 200003), (5, 3 * 65536 + 13), (7, 1000), (4, 40)])
def test_the_all_chunk_passes_are_the_per_chunk_calls_bitwise(W, n, isa):
    # one C call per bucket (fold_encode_all, decompress_update_all; on AVX-512 a run inside one
    # tensor in one loop) against one call per chunk (the same calls with every other chunk empty):
    # bits, sums, momentum, error and parameters bitwise, chunks above and below the one-thread
    # size, every ISA
    from onebit.kernels import _chunks

    if isa > cpu_simd.best_isa():
        pytest.skip(f"ISA level {isa} not on this CPU")
    from onebit.kernels.layout import Layout, empty_message, message_bits

    gen = torch.Generator().manual_seed(W * n)
    sizes = [n // 3, n // 3 + 5, n - 2 * (n // 3) - 5]
    layout = Layout(-(-n // (8 * W)) * 8 * W, W, None)
    splits = [_chunks.split(layout, n, j) for j in range(W)]
    grads = [torch.randn(s, generator=gen) for s in sizes]
    variances = [torch.rand(s, generator=gen) ** 2 for s in sizes]  # the floor 0.3 binds under sqrt(v) < 0.3
    p0 = [torch.randn(s, generator=gen) for s in sizes]
    u0, e0 = torch.randn(n, generator=gen), torch.randn(layout.N, generator=gen) * 0.1
    scales = torch.rand(W, generator=gen) + 0.1
    wscales = torch.rand(W, generator=gen) + 0.1
    out = []
    for merged in (False, True):
        u, e, ps = u0.clone(), e0.clone(), [q.clone() for q in p0]
        t = adam.table([0, sizes[0], sizes[0] + sizes[1]], sizes, "cpu")
        t.fill({"grad": grads, "var": variances, "param": ps},
               [(0.9, 0.1, 0.999, -1e-3, 0.5 + k, 0.3, 1.25, 1e-8) for k in range(3)])
        bits = message_bits(empty_message(layout, W, torch.device("cpu")), layout)
        enc = [mid - lo for lo, mid, _ in splits]
        fold = [max(0, min(hi, n) - lo) for lo, _, hi in splits]
        def only(values, j):
            return [v if i == j else 0 for i, v in enumerate(values)]

        if merged:
            sums = adam.fold_encode_all(u, e, bits, layout.C, enc, fold, t, isa=isa)
        else:
            sums = [adam.fold_encode_all(u, e, bits, layout.C, only(enc, j), only(fold, j), t,
                                         isa=isa)[j] if fold[j] else 0.0 for j in range(W)]
        folded = u.clone()
        if merged:
            adam.decompress_update_all(bits, scales, u, e, wscales, layout.C, enc, t, 0.3, isa=isa)
        else:
            for j, (lo, mid, _) in enumerate(splits):
                if mid > lo:
                    adam.decompress_update_all(bits, scales, u, e, wscales, layout.C, only(enc, j),
                                               t, 0.3, isa=isa)
        coded = torch.cat([bits[j, : enc[j] // 8] for j in range(W)])  # the padded rests: not theirs
        out.append(([s for s, f in zip(sums, enc, strict=True) if f], coded, folded, u, e, ps))
    (s0, b0, f0, u0_, e0_, ps0), (s1, b1, f1, u1, e1, ps1) = out
    assert s0 == s1
    for a, b in [(b0, b1), (f0, f1), (u0_, u1), (e0_, e1)] + list(zip(ps0, ps1, strict=True)):
        assert torch.equal(a, b)


@pytest.mark.skipif("not cpu_simd.available()", reason="the C passes are not built here")
@pytest.mark.parametrize("case", ["finite", "inf scale", "nan scale", "overflow"])
@pytest.mark.parametrize("W, n", [(1, 4096), (3, 70008), (4, 200000), (5, 40), (70, 560)])
def test_the_one_call_server_is_the_two_passes_bitwise(W, n, case):
    # server_reduce_one (weights, first pass, scale, error pass in C) against the Python sequence
    # the native codec ran before: bits, scale and error bitwise; a non-finite received
    # scale or sum: a NaN scale and the error unchanged
    gen = torch.Generator().manual_seed(W * n)
    bits = torch.randint(0, 256, (W, n // 8 + 3), dtype=torch.uint8, generator=gen)[:, 3:]  # strided rows
    scales = (torch.rand(2 * W, generator=gen) + 0.1)[::2]  # strided, as a message's
    e = torch.randn(n, generator=gen)
    if case == "inf scale":
        scales[W - 1] = float("inf")
    elif case == "nan scale":
        scales[0] = float("nan")
    elif case == "overflow":  # every sign +: m = 3e38 + 3e38 overflows at one element
        bits.fill_(255)
        e[n // 2] = 3e38
        scales.fill_(3e38)
    w = scales * (1.0 / W)
    e0, out0 = e.clone(), torch.zeros(n // 8, dtype=torch.uint8)
    total = cpu_simd.server_total(bits, w.contiguous(), e0, out0)
    s0 = torch.sqrt(torch.tensor(total, dtype=torch.float64) / n).to(torch.float32).view(1)
    ran0 = bool(torch.isfinite(scales).all()) and bool(torch.isfinite(s0).all())
    if ran0:
        cpu_simd.server_update(bits, w.contiguous(), e0, s0, None)
    e1, out1, s1 = e.clone(), torch.zeros(n // 8, dtype=torch.uint8), torch.zeros(1)
    ran1 = cpu_simd.server_reduce_one(bits, scales, e1, out1, s1)
    assert ran1 == ran0 == (case == "finite")
    assert torch.equal(out1, out0) and torch.equal(e1, e0)
    if ran0:
        assert torch.equal(s1, s0)
    else:
        assert bool(s1.isnan().all()) and torch.equal(e1, e)
