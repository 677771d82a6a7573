#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, the ahead-of-time compile of every
# Triton kernel variant for sm_80, sm_90, gfx942 and gfx90a (no GPU needed), the compiled CPU
# passes built into torch.compile's cache, pytest (the timing tests alone, then two processes).
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
# onebit's compiled CPU passes into torch.compile's cache once (a fresh machine's ranks would
# each build them, ~25 s of a core apiece, when the first tests start together); beside it, at
# the lowest priority, the compile check, which goes on through the timing tests (their ranks
# wait on an emulated link a third of the time: the check takes that idle CPU, and yields it
# whenever a rank runs) and, where it has not finished by then, through the rest
check_log="$(mktemp)"
nice -n 19 .venv/bin/python scripts/compile_check.py > "$check_log" 2>&1 &
check_pid=$!
warmed=0
.venv/bin/python scripts/warm_compile_cache.py || warmed=$?
finish_check() {  # the compile check's output and verdict
  local checked=0
  wait "$check_pid" || checked=$?
  cat "$check_log"
  rm -f "$check_log"
  [ "$checked" -eq 0 ] || echo "compile check: exit $checked" >&2
  return "$checked"
}
[ "$warmed" -eq 0 ] || { echo "warm-up: exit $warmed" >&2; finish_check || true; exit 1; }
# the tests that compare timings alone (no other test beside them), then two test processes
# (pytest-xdist; every multi-rank test rendezvouses through its own file or a free port);
# ONEBIT_TEST_WORKERS=0 runs in one process
serial=0
.venv/bin/pytest -m serial "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0  # 5: nothing selected (e.g. a file with serial tests only)
status=0
.venv/bin/pytest -n "${ONEBIT_TEST_WORKERS:-2}" --dist worksteal -m "not serial" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
checked=0
finish_check || checked=$?
[ "$status" -ne 0 ] && exit "$status"
[ "$serial" -ne 0 ] && exit "$serial"
exit "$checked"
