#!/bin/bash
# before (/tmp/base = 28b3338, where issue 43 started), /tmp/prev = 87c808e (before the step plan) and after
# (/work/main) in turn, one copy of benchmarks/ (main's)
set -e
OUT=/tmp/ab/out; mkdir -p $OUT
B=/work/main/benchmarks
VPY=/root/.cache/qsinkkv/vllm-venv/bin/python
for round in 1 2 3; do
  for tree in base main; do
    root=$([ $tree = base ] && echo /tmp/base || echo /work/main)
    for w in torch c; do
      PYTHONPATH=$root python3 $B/write_op.py --writer $w --json $OUT/write-$w-$tree-$round.json > $OUT/write-$w-$tree-$round.md
    done
  done
done
for round in 1 2; do
  for tree in base prev main; do
    root=/tmp/$tree; [ $tree = main ] && root=/work/main
    PYTHONPATH=$root python3 $B/generate.py --context 512 2048 --new 32 --bits 8 4 --baselines --json $OUT/generate-$tree-$round.json > $OUT/generate-$tree-$round.md 2>&1
  done
done
for tree in base prev main; do
  root=/tmp/$tree; [ $tree = main ] && root=/work/main
  PYTHONPATH=$root $VPY $B/vllm_profile.py --engine stock 4 8 16 --batch 32 > $OUT/vllm-profile-$tree.md 2>&1
done
echo ALLDONE
