#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv and install onebit into it.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (it only fills gaps).
#
# torch is installed first, pinned, so that pip never picks a build by itself: a plain
# `pip install torch` on a CPU-only machine would pull several GB of CUDA packages.
#   ONEBIT_TORCH        torch requirement (default torch==2.13.0)
#   ONEBIT_TORCH_INDEX  index URL for it, e.g. the CPU-only wheel index of your mirror
#   ONEBIT_PYTHON       interpreter for the venv (default python3)
#   ONEBIT_INSTALLER    uv (default: pip picks torch's wheel, uv installs; pip if uv fails) or pip
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${ONEBIT_PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c 'import sys; assert sys.version_info >= (3, 10), "onebit needs Python >= 3.10"'
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# pip chooses every wheel of torch (its configuration: a local wheel folder, a mirror, the
# constraints); the rest goes through uv where it can be had (a wheel from PyPI, into the venv),
# which downloads in parallel and unpacks and compiles byte code on every core: about 65 s sooner
# than pip alone on 2 cores. pip does all of it where uv cannot be installed or fails (a private
# index that only pip is configured for), or with ONEBIT_INSTALLER=pip.
uv_ok() {
  [ "${ONEBIT_INSTALLER:-uv}" = uv ] && { [ -x "$venv/bin/uv" ] || "${pip[@]}" install uv >/dev/null 2>&1; }
}
uv_install() {  # uv_install PIN_FILE ARGS...: false (and a line on stderr) where uv failed
  local status=0
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" --compile-bytecode -c "$1" "${@:2}" || status=$?
  [ "$status" -eq 0 ] || echo "setup-env.sh: uv failed (status $status); installing with pip" >&2
  return "$status"
}
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  torch_req=("${ONEBIT_TORCH:-torch==2.13.0}")
  [ -n "${ONEBIT_TORCH_INDEX:-}" ] && torch_req+=(--index-url "$ONEBIT_TORCH_INDEX")
  wheels="$(mktemp -d)"
  if ! { uv_ok && "${pip[@]}" download --no-deps -d "$wheels" "${torch_req[@]}" \
         && uv_install /dev/null "$wheels"/torch-*.whl; }; then
    "${pip[@]}" install "${torch_req[@]}"
  fi
  rm -rf "$wheels"
fi
install() {  # the packages after torch, with the installed torch pinned
  if uv_ok; then
    local pin status=0
    pin="$(mktemp)"
    "$venv/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$pin"
    uv_install "$pin" "$@" || status=$?
    rm -f "$pin"
    [ "$status" -eq 0 ] && return 0
  fi
  "${pip[@]}" install "$@"
}
stamp="$venv/.onebit-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  install -e "$root[test]"
  # torchtitan without its trainer's dependencies (datasets, wandb, tensorboard): the tests use
  # its optimizer container on CPU; the `torchtitan` extra installs all of it
  install --no-deps "torchtitan==0.3.0"
  touch "$stamp"
fi
