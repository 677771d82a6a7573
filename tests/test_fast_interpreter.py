"""tests/fast_interpreter.py: installed in the test process and in the ranks, and the kernels' results
the same with the interpreter's own patching (every helper call patches the language again)."""

from __future__ import annotations

import os

import pytest
import torch

from onebit.collectives import local_compressed_allreduce

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter")


def _installed() -> bool:
    from triton.runtime import interpreter

    return getattr(interpreter, "_onebit_fast", False)


def test_the_shortcut_is_installed_here_and_in_the_ranks(ranks):
    assert _installed()
    assert ranks(2).run(_installed) == [True, True]


@pytest.mark.parametrize("block", [None, 64])
def test_the_kernels_give_the_same_bits_with_the_interpreters_own_patching(monkeypatch, block):
    from triton.runtime import interpreter

    g = torch.Generator().manual_seed(7)
    n, W = 1003, 3
    inputs = [torch.randn(n, generator=g) * 10 ** torch.randn(1, generator=g) for _ in range(W)]
    pad = -(-n // (8 * W * 64)) * 8 * W * 64  # (a multiple of every padding the codec asks for)
    worker = [torch.randn(pad, generator=g) * 0.1 for _ in range(W)]
    server = [torch.randn(pad // W, generator=g) * 0.1 for _ in range(W)]

    def run():
        xs, ws = [x.clone() for x in inputs], [w.clone() for w in worker]
        ss = [s.clone() for s in server]
        out = local_compressed_allreduce(xs, ws, ss, backend="triton", block=block)
        return [t.clone() for t in (*out, *ws, *ss)]

    walks = []  # the language's walks (one per module patched)
    real_walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: walks.append(1) or real_walk(*a))
    fast = run()
    walked_fast = len(walks)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._onebit_real_patch)
    monkeypatch.setattr(interpreter, "_get_np_dtype", interpreter._onebit_real_np_dtype)
    monkeypatch.setattr(interpreter.interpreter_semantic, "binary_op_sanitize_overflow_impl",
                        interpreter._onebit_real_overflow_check)
    slow = run()
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(fast[0], inputs[0])  # (the collective ran)
    assert len(walks) - walked_fast > 2 * walked_fast > 0, (walked_fast, len(walks))  # (the shortcut took)



def test_the_numpy_dtypes_are_the_interpreters():
    import triton.language as tl
    from triton.runtime import interpreter

    kinds = [tl.float32, tl.bfloat16, tl.int1, tl.uint8, tl.int64, tl.pointer_type(tl.float32),
             tl.block_type(tl.float32, [128, 8]), tl.block_type(tl.pointer_type(tl.bfloat16), [4])]
    for dtype in kinds + kinds:  # (the second time from the table)
        assert interpreter._get_np_dtype(dtype) == interpreter._onebit_real_np_dtype(dtype), dtype
    assert interpreter._get_np_dtype is not interpreter._onebit_real_np_dtype


def test_the_overflow_check_is_skipped_only_where_the_interpreter_drops_it(monkeypatch):
    # the interpreter builds an int32 overflow check at every int +, -, * and asserts it only with debug on:
    # with debug off an overflowing add wraps (the check is not built); with debug on it is built, and raises
    import dataclasses

    import triton
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    @triton.jit
    def add(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i) + 2147483000)

    x = torch.tensor([0, 647, 648, -5], dtype=torch.int32)
    y = torch.zeros_like(x)
    add[(1,)](x, y, BLOCK=4)
    assert y.tolist() == [2147483000, 2147483647, -2147483648, 2147482995]  # (wrapped, as a GPU does)
    assert "binary_op_sanitize_overflow_impl" in vars(interpreter.interpreter_semantic)  # (installed)
    builder = interpreter.interpreter_semantic.builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation add"):
        add[(1,)](x, y, BLOCK=4)
    monkeypatch.setattr(interpreter.interpreter_semantic, "binary_op_sanitize_overflow_impl",
                        interpreter._onebit_real_overflow_check)
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation add"):
        add[(1,)](x, y, BLOCK=4)
