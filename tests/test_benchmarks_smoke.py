"""The benchmarks run here at tiny sizes on the CPU so that they cannot rot unseen: each exits 0, prints its
table header and writes its JSON. Their CPU paths directly; their GPU paths through benchmarks/gpu_check.sh
itself (``GPU_CHECK_TINY=1``: every step on CPU tensors, the Triton kernels in Triton's interpreter, the
benchmarks' ``--interpret``), and generate.py's with ``--interpret``: a stale call in a GPU branch fails here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {  # script and tiny arguments -> the table header it must print
    "e2e_decode": (["e2e_decode.py", "--tiny", "--device", "cpu"],
                   "| cache | ms/step | x StaticCache | KV bytes/seq |"),
    "prefill": (["prefill.py", "--context", "256", "--capacity", "128", "--reps", "1"],
                "| T | qsinkkv ms | qsinkkv ms / 1k tokens | causal SDPA ms | SDPA ms / 1k tokens |"),
    "prefill_llama_bf16": (["prefill.py", "--shape", "llama", "--dtype", "bfloat16", "--context", "256",
                            "--capacity", "128", "--reps", "1"], "| T | qsinkkv ms |"),
    "decode_attention": (["decode_attention.py", "--context", "256", "--batch", "1", "--shapes", "smollm2",
                          "--reps", "2"], "| shape | L | B | sdpa ms | sdpa-gqa ms |"),
    "generate": (["generate.py", "--context", "64", "--new", "2"],
                 "| context | cache | ms/token | x dyn | attn ms | attn x dyn | cache bytes |"),
    "mixed_step": (["mixed_step.py", "--batch", "2", "--context", "64", "--reps", "1"],
                   "| B | step tokens | attend ms | x B=first | attend_packed ms | x B=first |"),
    "pool": (["pool.py", "--shapes", "smollm2", "--capacity", "256"],
             "| model shape | cache | bytes / token | sequences at capacity | vs bf16 | bytes held / pool |"),
    "write_op": (["write_op.py", "--batch", "2", "--reps", "2"], "| case | us / call |"),
    "write_op_c": (["write_op.py", "--batch", "2", "--reps", "2", "--writer", "c"], "| case | us / call |"),
    # the GPU path (no attention split, a synchronize per step) with the Triton backend, interpreted
    "generate_interpret": (["generate.py", "--context", "16", "--new", "1", "--backend", "triton", "--bits", "4",
                            "--baselines", "--interpret"], "| context | cache | ms/token |"),
}

# generate.py runs the default model; e2e_decode builds and runs a random Llama (~6 s on 2 cores)
CASE_MARKS = {"generate": pytest.mark.model, "generate_interpret": pytest.mark.model, "e2e_decode": pytest.mark.slow}


def env(**extra):
    """One thread: a smoke test, not a measurement. (The scripts import the installed qsinkkv.)"""
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


@pytest.mark.parametrize("case", [pytest.param(c, marks=CASE_MARKS[c]) if c in CASE_MARKS else c for c in CASES])
def test_benchmark_runs_tiny(case, tmp_path):
    if case == "e2e_decode":
        pytest.importorskip("transformers")
    argv, header = CASES[case]
    out = tmp_path / "out.json"
    extra = {"TRITON_INTERPRET": "1"} if "--interpret" in argv else {}
    proc = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:], "--json", str(out)],
                          capture_output=True, text=True, env=env(**extra), check=False)
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
    if case == "generate_interpret":
        assert [r["cache"] for r in rows] == ["DynamicCache", "QSinkKVCache int4 (C=18, triton)"]
        assert not any("attn_ms_per_token" in r for r in rows)  # the GPU path: no split
        return
    if case == "pool":  # at equal bytes the quantized windows hold more sequences, none over the pool
        assert [r["cache"] for r in rows] == ["bf16 window", "int8", "int4"]
        assert rows[0]["sequences"] < rows[1]["sequences"] < rows[2]["sequences"], rows
        assert all(r["held_bytes"] <= r["pool_bytes"] for r in rows), rows
        return
    if case.startswith("write_op"):  # every case of the write timed, with the writer asked for
        assert json.loads(out.read_text())["writer"] == ("c" if case == "write_op_c" else "torch")
        assert [r["case"] for r in rows] == ["decode, equal lengths", "decode, different lengths",
                                             "decode completing a block", "64-token chunk per row"]
        assert all(r["us"] > 0 for r in rows), rows
        return
    assert rows and len(rows) == (3 if case == "e2e_decode" else 1)


@pytest.mark.slow
def test_gpu_check_tiny(tmp_path):
    """benchmarks/gpu_check.sh itself, every step at tiny sizes on the CPU (``GPU_CHECK_TINY=1``): each step
    exits 0 and each benchmark writes its rows, the GPU code paths of decode_attention.py (the default decode
    body and "fp16"), prefill.py, e2e_decode.py and decode_pages.py (the plugin's engine path) included."""
    pytest.importorskip("transformers")
    # the per-step caps are the GPU session's: tiny mode runs no step under `timeout` (on a loaded 2-core machine a
    # step ran past its 25 s cap and failed the suite): a `timeout` that always times out must not matter
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "timeout").write_text("#!/bin/sh\nexit 124\n")
    (stub / "timeout").chmod(0o755)
    dest = tmp_path / "out"
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), str(dest)], capture_output=True, text=True,
                          env=env(GPU_CHECK_TINY="1", PATH=f"{stub}:{os.environ['PATH']}"), check=False)
    steps = (dest / "steps.txt").read_text() if (dest / "steps.txt").exists() else ""
    failed = [line.split()[0] for line in steps.splitlines() if " rc=0 " not in line]
    logs = "\n".join(f"--- {name}\n{(dest / name).read_text()[-3000:]}" for name in failed)
    assert proc.returncode == 0 and not failed, steps + logs + proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ["tests.log", "decode_attention.md", "decode_attention_fp16.md", "prefill.md", "e2e_decode.md",
             "decode_pages.md", "decode_pages_fp16.md"]
    assert [line.split()[0] for line in steps.splitlines()] == names
    assert "2 passed" in (dest / "tests.log").read_text()
    for name in ("decode_attention", "decode_attention_fp16"):
        result = json.loads((dest / f"{name}.json").read_text())
        assert result["device"] == "cpu (Triton interpreter)" and len(result["rows"]) == 1, name
        assert result["decode_variant"] == (name.removeprefix("decode_attention").strip("_") or "dequantize")
        assert all(result["rows"][0][f"int{bits}_ms"] > 0 for bits in (16, 8, 4))
    assert "x sdpa | torch ms | x torch |" in (dest / "prefill.md").read_text()  # the GPU table
    assert len(json.loads((dest / "prefill.json").read_text())["rows"]) == 1
    e2e = json.loads((dest / "e2e_decode.json").read_text())["rows"]
    assert [r["cache"] for r in e2e] == ["static", "dynamic", "qsinkkv"] and not any("error" in r for r in e2e)
    pages = json.loads((dest / "decode_pages.json").read_text())  # the engine path: int8/int4 pages, the stack
    assert [r["bits"] for r in pages["pages"]] == [8, 4] and all(r["ms"] > 0 for r in pages["pages"])
    assert [r["cache"] for r in pages["e2e"]] == ["bf16", "int4 pages"] and pages["e2e"][1]["rows"] == 3
    assert pages["decode_variant"] == "dequantize"
    fp16 = json.loads((dest / "decode_pages_fp16.json").read_text())  # the fp16 body over the pages, no stack
    assert fp16["decode_variant"] == "fp16" and [r["bits"] for r in fp16["pages"]] == [8, 4] and "e2e" not in fp16


def test_ab_runs_each_revision_s_own_qsinkkv(tmp_path):
    """``benchmarks/ab.sh``: the command runs once per revision and round, each time importing that revision's
    ``qsinkkv`` (a temporary worktree; "." the working tree), never the installed one; the worktrees go after."""
    root = BENCH.parent
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: ab.sh checks revisions out of its history")
    command = 'python -c "import qsinkkv; print(qsinkkv.__file__)"'
    proc = subprocess.run(["bash", str(BENCH / "ab.sh"), "--rounds", "2", "--out", str(tmp_path), "HEAD", ".", "--",
                           command], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for round_ in (1, 2):
        head = (tmp_path / f"HEAD-{round_}.txt").read_text().strip()
        tree = (tmp_path / f"tree-{round_}.txt").read_text().strip()
        assert tree == str(root / "qsinkkv" / "__init__.py"), tree
        assert head.endswith("/HEAD/qsinkkv/__init__.py") and not head.startswith(str(root)), head
    worktrees = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True).stdout
    assert "/HEAD" not in worktrees, worktrees
