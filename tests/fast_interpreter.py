"""The Triton interpreter without its repeated patching: the same execution, a third less CPU.

Under ``TRITON_INTERPRET=1`` a launch (``GridExecutor.__call__``) patches ``triton.language`` with
the interpreter's builtins and restores it when the grid is done. Every call of a ``@triton.jit``
helper *inside* the launch (``InterpretedFunction.__call__``) patches the language again, walking
every member of ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core`` with ``inspect.getmembers``: the
builtins it finds are already the patched ones (not builtins any more, so left as they are), and the
rest it sets to the same closures again. The kernels call their helpers thousands of times per step,
and that walk was 28% of an interpreted optimizer step's CPU (profiled on ZeroOneAdam, 2 ranks).

:func:`install` skips the walk for a helper call inside a launch whose patch already covers the
helper's language modules (the same objects: ``tl`` and ``tl.core`` are process-wide); everything
else, the launch's own patch and restore included, runs as the interpreter has it. The kernels'
results are unchanged: the suite's bitwise tests run through it. A Triton whose interpreter lacks
these names is left alone (slower, the same results). It also answers the interpreter's question "which
numpy dtype holds this Triton dtype", asked at every op of every program, from a table made once per
dtype instead of one of 19 numpy dtypes built for each question (another 7% of an interpreted step).
And it does not build the int32 overflow checks that the interpreter's ``device_assert`` then drops (it
asserts only with ``debug`` on, which the interpreter's options never are): a quarter of the rest.
Like the interpreter itself (it patches the language process-wide), this assumes one launch at a time
in a process.
"""

from __future__ import annotations

import functools
import os


def install() -> bool:
    """Install the shortcut if the interpreter is on and has the expected shape; True if installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    if getattr(ti, "_onebit_fast", False):
        return True
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not all(hasattr(ti, name) for name in needed):
        return False
    real_patch, real_launch = ti._patch_lang, ti.GridExecutor.__call__
    active: list[list] = []  # per launch in progress: [the language modules patched, patched yet]

    def langs(fn) -> set:
        return set(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn):
        seen = langs(fn)  # (none: the interpreter's own patch raises "must be visible": let it)
        if seen and active and active[-1][1] and seen <= active[-1][0]:
            return ti._LangPatchScope()  # already patched by the launch (nothing to restore)
        scope = real_patch(fn)
        if active:  # the launch's own patch (GridExecutor.__call__'s first call), or a helper's whose
            # modules it did not cover (``tl.sum``'s module sees ``tl.core`` alone): patched now for the
            # rest of the launch (a helper's patch is never restored, by the interpreter either)
            active[-1][0] |= seen
            active[-1][1] = True
        return scope

    @functools.wraps(real_launch)
    def launch(self, *args, **kwargs):
        active.append([set(), False])
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            active.pop()

    real_np_dtype = getattr(ti, "_get_np_dtype", None)
    if real_np_dtype is not None:  # every op of every program asks for its numpy dtype, and the
        # interpreter builds a table of 19 numpy dtypes to answer each time: answered once per dtype
        np_dtypes: dict = {}

        def get_np_dtype(tt_dtype):
            try:
                return np_dtypes[tt_dtype]
            except KeyError:
                out = np_dtypes[tt_dtype] = real_np_dtype(tt_dtype)
                return out
            except TypeError:  # (an unhashable dtype: asked as the interpreter asks)
                return real_np_dtype(tt_dtype)

        ti._get_np_dtype, ti._onebit_real_np_dtype = get_np_dtype, real_np_dtype
    semantic = getattr(ti, "interpreter_semantic", None)
    real_check = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    if real_check is not None:  # every int32 +, -, * of every program builds an overflow check (two
        # casts, the op in int64, two compares, an and) and hands it to device_assert, which drops it
        # unless the options say debug (the interpreter's never do): the check is not built when dropped

        def overflow_check(lhs, rhs, binary_op):
            if semantic.builder.options.debug:
                return real_check(lhs, rhs, binary_op)
            return None

        semantic.binary_op_sanitize_overflow_impl = overflow_check
        ti._onebit_real_overflow_check = real_check
    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = launch
    ti._onebit_fast, ti._onebit_real_patch = True, real_patch  # (the latter for the test of this module)
    return True
