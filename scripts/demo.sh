#!/usr/bin/env bash
# The demo: set-up (first run only), then a small GPT-style language model trained with
# OnebitAdam over local ranks through torchrun.
#   NPROC   number of local ranks (default 4)
# Extra arguments go to examples/train_lm.py (--optimizer, --steps, ... ; --help lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup-env.sh"
cd "$root"
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-4}" examples/train_lm.py "$@"
