#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, the ahead-of-time compile of every
# Triton kernel variant for sm_80 and sm_90 (no GPU needed), pytest. Extra arguments go to
# pytest. `scripts/test.sh --quick`: ruff and the single-process tests only (under 2 minutes).
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
.venv/bin/python scripts/compile_check.py
exec .venv/bin/pytest "$@"
