#!/bin/bash
# issue 56's error-rounding study: mlp and words tasks, onebit_adam, 4 gloo ranks, paired seeds
cd "$(dirname "$0")/../../.."; mkdir -p "${OUT:-/tmp/er}"
for task in mlp words; do
  steps=600; [ $task = words ] && steps=1000
  for seed in 0 1 2; do
    for r in none nearest stochastic; do
      out=${OUT:-/tmp/er}/$task-$r-$seed.jsonl
      [ -f $out ] && grep -q '"final"' $out && continue
      rm -f $out
      timeout 900 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 \
        bench/studies/error_rounding/run.py --rounding $r --task $task --optimizer onebit_adam \
        --steps $steps --eval-every 50 --lr 2e-3 --seed $seed --log-jsonl $out > ${OUT:-/tmp/er}/$task-$r-$seed.log 2>&1
    done
  done
done
echo done > ${OUT:-/tmp/er}/DONE
