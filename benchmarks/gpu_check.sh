#!/usr/bin/env bash
# The GPU check: the Triton kernels natively on CUDA against their PyTorch references and the
# float64 oracle, then the decode-attention table (ours vs SDPA over a bf16 cache, same run).
#
#   bash benchmarks/gpu_check.sh [OUTDIR]      # default out/gpu; writes env.txt, tests.log,
#                                              # decode_attention.md and decode_attention.json
# Needs a CUDA GPU with torch, triton, pytest and hypothesis. Works from an installed qsinkkv
# or from a bare checkout (the package is then staged on PYTHONPATH, kernels/ as qsinkkv.kernels).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=$(mkdir -p "${1:-out/gpu}" && cd "${1:-out/gpu}" && pwd)
cd /tmp  # a checkout's own qsinkkv/ lacks kernels/: never import from the repo root
if ! python3 -c "import qsinkkv.kernels" 2>/dev/null; then
  STAGE=$(mktemp -d)
  cp -r "$REPO/qsinkkv" "$STAGE/" && cp -r "$REPO/kernels" "$STAGE/qsinkkv/kernels"
  export PYTHONPATH=$STAGE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ date -u +%F; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$DEST/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/test_kernels.py" "$REPO/tests/test_attention.py" \
  2>&1 | tee "$DEST/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 300 python3 "$REPO/benchmarks/decode_attention.py" --json "$DEST/decode_attention.json" \
  2>&1 | tee "$DEST/decode_attention.md"
bench_rc=${PIPESTATUS[0]}
# the values-folded kernel (off by default until this check has passed on a GPU)
QSINKKV_FOLD_VALUES=1 timeout 300 python3 "$REPO/benchmarks/decode_attention.py" \
  --json "$DEST/decode_attention_folded.json" 2>&1 | tee "$DEST/decode_attention_folded.md"
bench_rc=$(( bench_rc || PIPESTATUS[0] ))
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
