#!/bin/bash
# the write op again after f1d4685 (the write's entries computed once), and generate's disturbed main round 2 again
set -e
OUT=/tmp/ab/out; mkdir -p $OUT
B=/work/main/benchmarks
for round in 1 2 3; do
  for tree in base main; do
    root=$([ $tree = base ] && echo /tmp/base || echo /work/main)
    for w in torch c; do
      PYTHONPATH=$root python3 $B/write_op.py --writer $w --json $OUT/write2-$w-$tree-$round.json > $OUT/write2-$w-$tree-$round.md
    done
  done
done
for tree in main base prev; do
  root=/tmp/$tree; [ $tree = main ] && root=/work/main
  r=$([ $tree = main ] && echo 2 || echo 3)
  PYTHONPATH=$root python3 $B/generate.py --context 512 2048 --new 32 --bits 8 4 --baselines --json $OUT/generate-$tree-$r.json > $OUT/generate-$tree-$r.md 2>&1
done
PYTHONPATH=/work/main python3 $B/generate.py --context 512 2048 --new 32 --bits 8 4 --baselines --json $OUT/generate-main-3.json > $OUT/generate-main-3.md 2>&1
echo ALLDONE
