#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, the ahead-of-time compile of every
# Triton kernel variant for sm_80, sm_90, gfx942 and gfx90a (no GPU needed; in the background,
# at low priority, while the tests run: the multi-rank tests leave a core idle much of the time),
# the compiled CPU passes built into torch.compile's cache, pytest (two processes, then the
# timing tests alone, after the compile check).
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
check_log="$(mktemp)"
nice -n 10 .venv/bin/python scripts/compile_check.py > "$check_log" 2>&1 &
check_pid=$!
trap 'kill "$check_pid" 2>/dev/null || true' EXIT
# onebit's compiled CPU passes into torch.compile's cache once (a fresh machine's ranks would
# each build them, ~25 s of a core apiece, when the first tests start together)
.venv/bin/python scripts/warm_compile_cache.py
# two test processes (pytest-xdist; every multi-rank test rendezvouses through its own file or a
# free port), then the tests that compare timings alone; ONEBIT_TEST_WORKERS=0 runs in one process
status=0
.venv/bin/pytest -n "${ONEBIT_TEST_WORKERS:-2}" --dist worksteal -m "not serial" "$@" || status=$?
[ "$status" -eq 5 ] && status=0  # 5: nothing selected (e.g. a file with serial tests only)
checked=0
wait "$check_pid" || checked=$?
cat "$check_log"
rm -f "$check_log"
[ "$checked" -eq 0 ] || echo "scripts/compile_check.py failed (exit $checked)" >&2
serial=0
.venv/bin/pytest -m serial "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0
exit $(( status != 0 ? status : checked != 0 ? checked : serial ))
