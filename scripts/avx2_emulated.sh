#!/usr/bin/env bash
# The test suite on an emulated AVX2-only x86 CPU: qemu-user's TCG ("-cpu max") has AVX2 and FMA but
# no AVX-512, so torch dispatches its AVX2 kernels and onebit's C picks its AVX2 variants (best_isa 1),
# as on a CPU without AVX-512, on any x86 machine. Every Python the tests start (xdist workers, ranks,
# subprocesses) runs emulated too. About 4-5x slower than native; the timing tests (marked serial)
# are left out, since emulation changes every timing.
#   sudo apt-get install qemu-user     # once (Debian/Ubuntu)
#   bash scripts/avx2_emulated.sh                          # the suite but the serial and CUDA tests
#   bash scripts/avx2_emulated.sh tests/test_native_codec.py  # some files
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 not found: apt-get install qemu-user" >&2; exit 1; }
site="$("$root/.venv/bin/python" -c "import site; print(site.getsitepackages()[0])")"
python="$(readlink -f "$root/.venv/bin/python")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/python" <<SH
#!/bin/sh
PYTHONPATH="$tmp/site\${PYTHONPATH:+:\$PYTHONPATH}" exec qemu-x86_64 -cpu max "$python" "\$@"
SH
chmod +x "$tmp/python"
mkdir "$tmp/site"
cat > "$tmp/site/sitecustomize.py" <<PY
import multiprocessing, site, sys
site.addsitedir("$site")
sys.executable = "$tmp/python"
multiprocessing.set_executable("$tmp/python")
PY
args=()
for a in "$@"; do  # test paths relative to the caller's folder, made absolute before the cd below
  if [ -e "${a%%::*}" ]; then args+=("$(readlink -f "${a%%::*}")${a#"${a%%::*}"}"); else args+=("$a"); fi
done
[ ${#args[@]} -gt 0 ] || args=("$root/tests")
cd "$tmp"  # not the repository's root: it would shadow onebit.kernels as a top-level "kernels"
TRITON_INTERPRET=1 "$tmp/python" -c "
import sys, torch
from onebit.kernels import cpu_simd
print('emulated CPU: torch', torch.backends.cpu.get_cpu_capability(), '| onebit native ISA', cpu_simd.best_isa(),
      '(1: AVX2)', flush=True)
import pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--rootdir', '$root', '-c', '$root/pyproject.toml', '-n', '2',
                      '--dist', 'worksteal', '-m', 'not serial and not cuda', '-rf', *sys.argv[1:]]))
" "${args[@]}"
