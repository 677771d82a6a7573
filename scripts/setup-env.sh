#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv and install onebit into it.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (it only fills gaps).
#
# torch is installed first, pinned, so that pip never picks a build by itself: a plain
# `pip install torch` on a CPU-only machine would pull several GB of CUDA packages.
#   ONEBIT_TORCH        torch requirement (default torch==2.13.0)
#   ONEBIT_TORCH_INDEX  index URL for it, e.g. the CPU-only wheel index of your mirror
#   ONEBIT_PYTHON       interpreter for the venv (default python3)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${ONEBIT_PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c 'import sys; assert sys.version_info >= (3, 10), "onebit needs Python >= 3.10"'
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  torch_req="${ONEBIT_TORCH:-torch==2.13.0}"
  if [ -n "${ONEBIT_TORCH_INDEX:-}" ]; then
    "${pip[@]}" install "$torch_req" --index-url "$ONEBIT_TORCH_INDEX"
  else
    "${pip[@]}" install "$torch_req"
  fi
fi
stamp="$venv/.onebit-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "${pip[@]}" install -e "$root[test]"
  # torchtitan without its trainer's dependencies (datasets, wandb, tensorboard): the tests use
  # its optimizer container on CPU; the `torchtitan` extra installs all of it
  "${pip[@]}" install --no-deps "torchtitan==0.3.0"
  touch "$stamp"
fi
