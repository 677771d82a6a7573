#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, the ahead-of-time compile of every
# Triton kernel variant for sm_80, sm_90, gfx942 and gfx90a (no GPU needed), pytest (the timing
# tests alone, then two processes).
# Extra arguments go to pytest. `scripts/test.sh --quick`: ruff and the single-process tests
# only (under 2 minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
.venv/bin/python -m ruff check .
if [ "${1:-}" = "--quick" ]; then
  # the quick tier, for the one who changes code: single-process unit and property tests, no
  # compile check, no test that starts processes or ranks (marked slow by tests/conftest.py)
  shift
  exec .venv/bin/pytest -m "not slow and not cuda" -p no:cacheprovider "$@"
fi
# every Triton kernel variant compiled for four GPU targets, without a GPU; beside it, the native C
# library built once (a few seconds; cached under ~/.cache/onebit) before the test processes load it
.venv/bin/python -c "from onebit.kernels import cpu_simd; cpu_simd.available()" & built_pid=$!
checked=0
.venv/bin/python scripts/compile_check.py || checked=$?
built=0
wait "$built_pid" || built=$?
[ "$checked" -eq 0 ] && [ "$built" -eq 0 ] || { echo "compile check: exit $checked, C build: exit $built" >&2; exit 1; }
# the tests that compare timings alone, then two test processes (pytest-xdist; every multi-rank
# test rendezvouses through its own file or a free port); ONEBIT_TEST_WORKERS=0: one process
serial=0
.venv/bin/pytest -m serial "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0  # 5: nothing selected (e.g. a file with serial tests only)
status=0
.venv/bin/pytest -n "${ONEBIT_TEST_WORKERS:-2}" --dist worksteal -m "not serial" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
exit $(( status != 0 ? status : serial ))
