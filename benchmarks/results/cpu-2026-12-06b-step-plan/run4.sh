#!/bin/bash
# the torch (reference) writer only, final code: base (28b3338) and main alternating which goes first, 6 rounds
set -e
OUT=/tmp/ab/out; B=/work/main/benchmarks
for round in 1 2 3 4 5 6; do
  order=$([ $((round % 2)) = 1 ] && echo "base main" || echo "main base")
  for tree in $order; do
    root=$([ $tree = base ] && echo /tmp/base || echo /work/main)
    PYTHONPATH=$root python3 $B/write_op.py --writer torch --json $OUT/write4-torch-$tree-$round.json > $OUT/write4-torch-$tree-$round.md
  done
done
echo ALLDONE
