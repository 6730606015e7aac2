"""``benchmarks/vllm_load.py`` at a tiny size (stock and int4, 3 requests of 40-60 tokens x 24, burst and steady, a
one-batch sweep of the plugin): every request completes whole, each engine gets the blocks its budget buys at its own
block size, the gauge saw the requests run, and the tables print. A stale call in the script fails here, not in
a user's run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_load_run_tiny(tmp_path):
    from vllm_load import block_bytes
    from vllm_serve import model_shape
    out = tmp_path / "load.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_load.py"), "--requests", "3",
                        "--prompt-tokens", "40", "60", "--tokens", "24", "--capacity", "64", "--budget-mib", "16",
                        "--rate", "4", "--poll", "0.05", "--engines", "stock", "4", "--sweep", "1",
                        "--sweep-engines", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert [(x["engine"], x["mode"]) for x in r["runs"]] == [
        ("stock CPU_ATTN", "burst"), ("stock CPU_ATTN", "steady"), ("qsinkkv bits=4", "burst"),
        ("qsinkkv bits=4", "steady")]
    cfg = {"sink_tokens": 4, "recent_tokens": 60, "block_size": 32, "value_group_size": 32}
    shape = tuple(model_shape()[1])
    for run in r["runs"]:
        bits = None if run["engine"].startswith("stock") else 4
        assert run["block_bytes"] == block_bytes(bits, cfg, shape, 128)
        assert run["budget_mib"] == 16 and run["blocks"] == 16 * 2**20 // run["block_bytes"]
        assert run["samples"] >= 1 and run["output_tokens_per_s"] > 0 and run["ttft_p50_s"] > 0
    assert max(run["peak_running"] for run in r["runs"]) >= 1  # (the gauge sees requests run; a tiny run is short)
    assert [(x["engine"], x["batch"]) for x in r["sweep"]] == [("qsinkkv bits=4", 1)]
    assert r["sweep"][0]["output_tokens_per_s"] > 0 and r["sweep"][0]["ttft_p50_s"] > 0
    assert "| 16 | burst | qsinkkv bits=4 |" in p.stdout and "| 1 | qsinkkv bits=4 |" in p.stdout
