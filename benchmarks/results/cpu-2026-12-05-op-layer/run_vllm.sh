#!/bin/bash
VPY=/root/.cache/qsinkkv/vllm-venv/bin/python
OUT=/tmp/ab/out2; mkdir -p $OUT
for round in 1 2; do
for tree in base main; do
  root=$([ $tree = base ] && echo /tmp/base || echo /work/main)
  PYTHONPATH=$root $VPY /work/main/benchmarks/vllm_profile.py --engine stock 4 8 16 --batch 32 > $OUT/vllm-profile-$tree-$round.md 2>&1
  PYTHONPATH=$root python benchmarks/results/cpu-2026-12-05-op-layer/engine_step_overhead.py > $OUT/overhead-$tree-$round.txt 2>&1
done
done
echo ALLDONE
