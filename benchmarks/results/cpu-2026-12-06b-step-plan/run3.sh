#!/bin/bash
# the write op, final code, base (28b3338) and main in turn, 3 rounds
set -e
OUT=/tmp/ab/out; B=/work/main/benchmarks
for round in 1 2 3; do
  for tree in base main; do
    root=$([ $tree = base ] && echo /tmp/base || echo /work/main)
    for w in torch c; do
      PYTHONPATH=$root python3 $B/write_op.py --writer $w --json $OUT/write3-$w-$tree-$round.json > $OUT/write3-$w-$tree-$round.md
    done
  done
done
echo ALLDONE
