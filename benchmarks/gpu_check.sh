#!/usr/bin/env bash
# The GPU check, one script for a short GPU session (6 minutes of per-step timeouts in all):
#   1. env.txt: date, GPU, torch/triton/transformers versions
#   2. tests.log: the Triton kernels (quantize, write, decode, prefill) natively on CUDA against their
#      PyTorch references and the float64 oracle, over own pools and an engine's pages
#      (tests/test_kernels.py, test_kernels_pages.py, test_kernels_write.py)                     <= 100 s
#   3. decode_attention.md/.json: decode attention, ours (int16/8/4) vs SDPA and SDPA-GQA over a
#      bf16 cache, llama shape, L 8k..128k, B 1..64                                              <= 50 s
#   4. decode_attention_fp16.md/.json: the same with --decode-variant fp16, fewer rows         <= 25 s
#   5. prefill.md/.json: prefill of T 4k..32k tokens into an empty cache (the Triton prefill kernel)
#      vs causal SDPA and vs the torch backend (the reference prefill), llama shape (H 32, Hkv 8,
#      D 128), bf16, with peak extra memory                                                     <= 40 s
#   6. e2e_decode.md/.json: a decode step of a Llama-3-8B-shaped model (random weights), B 64,
#      context 8k: QSinkKVCache int4 vs StaticCache/DynamicCache bf16, KV bytes per budget      <= 45 s
#   7. decode_pages.md/.json: the vLLM plugin's engine path: the Triton decode over an engine's
#      int8/int4 pages (block 16), llama shape, B 8..64, L 4k..32k, vs SDPA's flash kernel over a bf16
#      cache and qsinkkv's bits=16 decode, with copy-bandwidth fractions; and one decode step of an
#      8B-shaped stack at equal KV memory: bf16 at batch 16 vs int4 pages at 48 rows             <= 75 s
#   8. decode_pages_fp16.md/.json: the pages table with --decode-variant fp16 (the body with the
#      fewest instructions per KV byte, docs/kernels.md), B 8 and 64, L 4k and 32k                <= 25 s
# Every step runs even if one before it failed; steps.txt has each one's exit status and seconds;
# the script exits non-zero if any step failed.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]                  # default out/gpu
#   TRANSFORMERS_WHEEL=benchmarks/wheels/transformers-5.24.0-py3-none-any.whl bash benchmarks/gpu_check.sh out/gpu
#   GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh out/gpu-tiny   # no GPU: every step at tiny sizes on the CPU,
#     the Triton kernels in Triton's interpreter (benchmarks' --interpret) and two kernel tests; what
#     tests/test_benchmarks_smoke.py runs, so that a stale call in this script or a GPU path fails CI
#
# Needs a CUDA GPU with torch, triton, pytest and hypothesis. Works from an installed qsinkkv
# or from a bare checkout (the package is then staged on PYTHONPATH, kernels/ as qsinkkv.kernels).
# transformers: the project needs >=5.24 (pyproject; qsinkkv.hf refuses older ones). On a machine
# with an older one and no network, fetch the wheel beforehand on a machine with network,
#   python3 -m pip download transformers==5.24.0 --no-deps -d benchmarks/wheels
# (benchmarks/wheels/ is git-ignored: carry it, e.g. the device `run` tool's carry=["benchmarks/wheels"])
# and point TRANSFORMERS_WHEEL at it: the wheel is unpacked into a temporary directory put first on
# PYTHONPATH (no pip, no network, the machine's site-packages untouched). transformers 5.24 checks
# huggingface-hub>=1.31 at import; if the import fails, any huggingface_hub-*.whl lying next to the
# transformers wheel is unpacked there too.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=$(mkdir -p "${1:-out/gpu}" && cd "${1:-out/gpu}" && pwd)
WHEEL=""
if [ -n "${TRANSFORMERS_WHEEL:-}" ]; then  # resolved before the cd below: relative to the caller's directory
  [ -f "$TRANSFORMERS_WHEEL" ] || { echo "TRANSFORMERS_WHEEL=$TRANSFORMERS_WHEEL is not a file" >&2; exit 2; }
  WHEEL=$(cd "$(dirname "$TRANSFORMERS_WHEEL")" && pwd)/$(basename "$TRANSFORMERS_WHEEL")
fi
cd /tmp  # a checkout's own qsinkkv/ lacks kernels/: never import from the repo root
if ! python3 -c "import qsinkkv.kernels" 2>/dev/null; then
  STAGE=$(mktemp -d)
  cp -r "$REPO/qsinkkv" "$STAGE/" && rm -f "$STAGE/qsinkkv/kernels" && cp -r "$REPO/kernels" "$STAGE/qsinkkv/kernels"
  export PYTHONPATH=$STAGE${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "$WHEEL" ]; then
  SITE=$(mktemp -d)
  python3 -m zipfile -e "$WHEEL" "$SITE"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  if ! python3 -c "import transformers" 2>/dev/null; then
    for w in "$(dirname "$WHEEL")"/huggingface_hub-*.whl; do
      [ -f "$w" ] && echo "unpacking $w" && python3 -m zipfile -e "$w" "$SITE"
    done
  fi
fi
export PYTHONUNBUFFERED=1
if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then  # the same steps on the CPU at tiny sizes (a smoke test)
  export TRITON_INTERPRET=1
  TESTS=(-k "test_decode_bad_arguments or test_decode_variant_is_an_argument")
  DEV=(--device cpu --interpret)
  DECODE=(--shapes smollm2 --context 128 --batch 1)
  DECODE_FEW=(--shapes smollm2 --context 128 --batch 1)
  PREFILL=(--shape smollm2 --dtype float32 --context 64 --capacity 32 --reps 1)
  E2E=(--tiny --backend triton)
  PAGES=(--tiny)
  PAGES_FEW=(--tiny)
  KERNEL_TESTS=("$REPO/tests/test_kernels.py")
else
  TESTS=()
  DEV=(--device cuda)
  DECODE=(--shapes llama --context 8192 32768 131072 --batch 1 8 64)
  DECODE_FEW=(--shapes llama --context 8192 131072 --batch 1 64)
  PREFILL=(--shape llama --dtype bfloat16 --context 4096 8192 16384 32768 --reps 5)
  E2E=(--batch 64 --context 8192)
  PAGES=()
  PAGES_FEW=(--batch 8 64 --context 4096 32768)
  KERNEL_TESTS=("$REPO/tests/test_kernels.py" "$REPO/tests/test_kernels_pages.py" "$REPO/tests/test_kernels_write.py")
fi
{ date -u +%F; { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader; } || echo "no nvidia-smi"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__, transformers.__file__)"; } \
  2>&1 | tee "$DEST/env.txt"

failed=0
: > "$DEST/steps.txt"
step() {  # step OUTFILE TIMEOUT_S COMMAND...: stdout+stderr to OUTFILE; status and seconds to steps.txt
  local out=$1 limit=$2 t0=$SECONDS
  shift 2
  if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then  # the caps are the GPU session's: a loaded CPU must not fail the smoke test
    echo "== $out (tiny: no cap)"
    "$@" 2>&1 | tee "$DEST/$out"
  else
    echo "== $out (timeout ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$DEST/$out"
  fi
  local rc=${PIPESTATUS[0]}
  echo "$out rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$DEST/steps.txt"
  [ "$rc" = 0 ] || failed=1
}
B="$REPO/benchmarks"
step tests.log 100 python3 -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" ${TESTS[@]+"${TESTS[@]}"}
step decode_attention.md 50 python3 "$B/decode_attention.py" "${DEV[@]}" "${DECODE[@]}" \
  --json "$DEST/decode_attention.json"
# the fp16 tensor-core body (not the default until this check has passed)
step decode_attention_fp16.md 25 python3 "$B/decode_attention.py" "${DEV[@]}" "${DECODE_FEW[@]}" \
  --decode-variant fp16 --json "$DEST/decode_attention_fp16.json"
step prefill.md 40 python3 "$B/prefill.py" "${DEV[@]}" "${PREFILL[@]}" --json "$DEST/prefill.json"
step e2e_decode.md 45 python3 "$B/e2e_decode.py" "${DEV[@]}" "${E2E[@]}" --json "$DEST/e2e_decode.json"
step decode_pages.md 75 python3 "$B/decode_pages.py" "${DEV[@]}" ${PAGES[@]+"${PAGES[@]}"} --json "$DEST/decode_pages.json"
step decode_pages_fp16.md 25 python3 "$B/decode_pages.py" "${DEV[@]}" "${PAGES_FEW[@]}" --decode-variant fp16 \
  --skip-e2e --json "$DEST/decode_pages_fp16.json"
cat "$DEST/steps.txt"
exit $failed
