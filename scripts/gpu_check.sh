#!/usr/bin/env bash
# The GPU checks, in one bounded run on a machine with one CUDA device (the project's lent GPU, or
# yours): the CUDA-marked tests, the kernels' throughput against copy bandwidth and the reference
# chain, and OnebitAdam's compression-stage step against fused AdamW. Uses the python3 that holds
# a CUDA torch and triton; installs onebit into a temporary folder, without dependencies and
# without the network. Results go to $OUT (default bench/out/gpu).
#
#   bash scripts/gpu_check.sh            # everything, about 6 minutes on an H100
#   bash scripts/gpu_check.sh tests      # one part: env | tests | kernels | optimizer | profile | memory | bases
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py="${ONEBIT_GPU_PYTHON:-python3}"
parts=("${@:-env tests memory kernels optimizer profile bases}")
parts=(${parts[*]})
has() { [[ " ${parts[*]} " == *" $1 "* ]]; }

rm -rf /tmp/onebit-site  # a rerun on a warm machine installs this tree, not the last run's package
"$py" -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/onebit-site . \
  > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/onebit-site

if has env; then
  { date -u; nvidia-smi; "$py" -P -c "import torch, triton, onebit; print('torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0)); print(onebit.__file__)"
  } 2>&1 | tee "$OUT/env.txt"
fi
if has tests; then
  # tests/test_cuda.py: Triton against the torch path and the float64 chain on CUDA tensors; the sync counts
  # and the agreement on the device, the stage against the per-bucket launches, the hook's multi-tensor own step,
  # OnebitAdam(capturable=True)'s step captured in a CUDA graph and replayed (issue 57); tests/test_ranks_on_one_gpu.py: 2-3 gloo ranks sharing the GPU
  timeout 240 "$py" -P -m pytest -q -p no:cacheprovider -m cuda -n 8 tests/test_cuda.py tests/test_multi.py \
    tests/test_triton_fused.py tests/test_triton_fused_zoa.py tests/test_triton_hook.py tests/test_momentum_message.py \
    tests/test_rounding.py tests/test_bf16_codec.py tests/test_ranks_on_one_gpu.py tests/test_own_steps.py tests/test_warmup_fused.py \
    --junitxml="$OUT/cuda-tests.xml" 2>&1 | tail -n 40 | tee "$OUT/cuda-tests.log"
fi
if has memory; then
  # issue 56's GPU rows: the state per parameter and one training step's peak (max_memory_allocated),
  # each optimizer against AdamW, 2 gloo ranks sharing the GPU, a 14.7M-parameter MLP
  timeout 120 "$py" bench/bench_memory.py --device cuda --ranks 2 --blocks 4 --csv "$OUT/memory-cuda.csv" 2>&1 \
    | tee "$OUT/memory.log" | tail -n 9
fi
if has kernels; then
  timeout 200 "$py" bench/bench_kernels.py --device cuda --log2 20 24 26 28 --worlds 1 4 8 \
    --dtypes float32 bfloat16 --csv "$OUT/kernels-cuda.csv" 2>&1 | tee "$OUT/kernels.log" | tail -n 60
fi
if has optimizer; then
  for mode in --unfused ""; do
    timeout 90 "$py" bench/bench_optimizer.py --device cuda $mode --csv "$OUT/optimizer-cuda.csv" 2>&1 \
      | tee -a "$OUT/optimizer.log"
  done
  # OnebitAdam(capturable=True)'s compression step replayed from a CUDA graph, 25 MB and 100 MB buckets (issue 57)
  for mb in 25 100; do
    timeout 90 "$py" bench/bench_optimizer.py --device cuda --capture --bucket-cap-mb $mb \
      --csv "$OUT/optimizer-cuda.csv" 2>&1 | tee -a "$OUT/optimizer.log"
  done
  # ZeroOneAdam's phase 1 (its fused Triton passes against unfused, interleaved)
  timeout 90 "$py" bench/bench_optimizer.py --device cuda --zero-one --interleave --csv "$OUT/optimizer-cuda.csv" \
    2>&1 | tee -a "$OUT/optimizer.log"
  # the hook's pre- and post-pass and ZeroOneAdam's local step: Triton against the plain ops
  timeout 60 "$py" bench/bench_triton_passes.py --device cuda --csv "$OUT/triton-passes-cuda.csv" 2>&1 \
    | tee -a "$OUT/optimizer.log"
fi
if has profile; then
  # wall time against kernel time and launches per step, for each path of bench/TRAFFIC.md's table;
  # the per-tensor ops first (the baseline), the multi-tensor ones (optimizers/_multi.py), then
  # OnebitAdam's fused passes (optimizers/_fused.py)
  for mode in --per-tensor --unfused ""; do
    timeout 150 "$py" bench/bench_profile.py --device cuda $mode --top onebit_compress_nosync \
      --csv "$OUT/profile-cuda.csv" 2>&1 | grep -v '^USDT' | tee -a "$OUT/profile.log" | tail -n 9
  done
fi
if has bases; then
  # issue 59: the DDP hook's momentum bases for Muon (docs/ALGORITHMS.md 8.4): the SVD every 10 iterations and
  # the turns, against Muon's own Newton-Schulz step, on a language model's matrix shapes
  timeout 120 "$py" bench/bench_bases.py --device cuda --shapes 1024x1024 4096x4096 4096x11008 2>&1 \
    | tee "$OUT/bases.log"
fi
