#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, the ahead-of-time compile of every
# Triton kernel variant for sm_80 and sm_90 (no GPU needed), pytest. Extra arguments go to
# pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
.venv/bin/python -m ruff check .
.venv/bin/python scripts/compile_check.py
exec .venv/bin/pytest "$@"
