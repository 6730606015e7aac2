"""The benchmarks that benchmarks/gpu_check.sh runs on a GPU, and generate.py (whose CPU table times the
attention calls apart), run here at tiny sizes on the CPU so that they cannot rot unseen: each exits 0,
prints its table header and writes its JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qsinkkv

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {  # script and tiny arguments -> the table header it must print
    "e2e_decode": (["e2e_decode.py", "--tiny", "--device", "cpu"],
                   "| cache | ms/step | x StaticCache | KV bytes/seq |"),
    "prefill": (["prefill.py", "--lengths", "256", "--capacity", "128", "--reps", "1"],
                "| T | qsinkkv ms | qsinkkv ms / 1k tokens | causal SDPA ms | SDPA ms / 1k tokens |"),
    "prefill_llama_bf16": (["prefill.py", "--shape", "llama", "--dtype", "bfloat16", "--lengths", "256",
                            "--capacity", "128", "--reps", "1"], "| T | qsinkkv ms |"),
    "decode_attention": (["decode_attention.py", "--lengths", "256", "--batches", "1", "--shapes", "smollm2",
                          "--reps", "2"], "| shape | L | B | sdpa ms | sdpa-gqa ms |"),
    "generate": (["generate.py", "--contexts", "64", "--new", "2"],
                 "| context | cache | ms/token | x dyn | attn ms | attn x dyn | cache bytes |"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_benchmark_runs_tiny(case, tmp_path):
    if case == "e2e_decode":
        pytest.importorskip("transformers")
    argv, header = CASES[case]
    out = tmp_path / "out.json"
    # the qsinkkv this test imports (a script's own directory would come first on its sys.path);
    # one thread: a smoke test, not a measurement
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(qsinkkv.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:], "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert header in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    if case == "generate":  # DynamicCache, quanto int4 (a test dependency), QSinkKVCache int16/8/4
        assert [r["cache"].split(" (")[0] for r in rows] == [
            "DynamicCache", "QuantizedCache quanto int4", "QSinkKVCache int16", "QSinkKVCache int8",
            "QSinkKVCache int4"]
        # every cache's attention time was caught by the timers, and is part of its step; qsinkkv's work is in
        # its attention function (its update only hands the cache on), ~20% of a step here, ~0.3% if not timed
        assert all(0 < r["attn_ms_per_token"] < r["ms_per_token"] for r in rows), rows
        assert all(r["attn_ms_per_token"] > 0.05 * r["ms_per_token"] for r in rows if "QSinkKV" in r["cache"]), rows
        return
    assert rows and len(rows) == (3 if case == "e2e_decode" else 1)
