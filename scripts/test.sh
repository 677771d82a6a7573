#!/usr/bin/env bash
# The whole test suite: set-up (first run only), ruff, pytest. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
.venv/bin/python -m ruff check .
exec .venv/bin/pytest "$@"
