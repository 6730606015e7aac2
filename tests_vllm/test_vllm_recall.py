"""``benchmarks/vllm_recall.py`` on two distances x 2 trials (its three engines at once): the eval's own prompts,
every trial counted in every row, stock vLLM at the budget refusing the prompt it cannot hold (vLLM's own
refusal), the plugin answering every prompt within the same bytes."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from engine import default_model

from qsinkkv.eval import passkey, recall
from qsinkkv.eval.data import default_text

ROOT = Path(__file__).resolve().parent.parent
DISTANCES, TRIALS = [100, 400], 2  # 216 and 516 prompt tokens: stock at bf16:256 (256 tokens) holds only the first


def test_recall_through_vllm_at_one_budget(tmp_path):
    out = tmp_path / "recall.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_recall.py"), "--distances",
                        ",".join(map(str, DISTANCES)), "--trials", str(TRIALS), "--jobs", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "does not fit" in p.stdout
    r = json.loads(out.read_text())
    L, Hkv, D = (r["shape"][k] for k in ("layers", "kv_heads", "head_dim"))
    assert r["budget"] == {"text": "bf16:256", "bytes": 2 * L * Hkv * 256 * D * 2}
    rows = {row["engine"]: row for row in r["rows"]}
    full, stock, ours = (rows[k] for k in ("stock vLLM, full memory", "stock vLLM at the budget",
                                           "qsinkkv int4 at the budget"))

    # the prompts are the eval's: the same builder, text, seed, keys and ids
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model())
    haystack = tok(default_text()[:recall.HAYSTACK_CHARS], add_special_tokens=False)["input_ids"]
    todo = recall.prompts(tok, haystack, DISTANCES, TRIALS, 0)
    for d in DISTANCES:
        got = r["prompts"][str(d)]
        assert got["keys"] == [q.key for q in todo[d]]
        assert got["sha256"] == hashlib.sha256(json.dumps([q.ids for q in todo[d]]).encode()).hexdigest()
        assert all(len(q.ids) - q.key_pos == d for q in todo[d])
        assert todo[d][0].key == passkey.Passkey.of(tok).build(haystack, d, passkey.trial_rng(0, d, 0)).key

    for row in (full, stock, ours):  # every trial counted once, the counts add up
        assert [c["distance"] for c in row["by_distance"]] == DISTANCES
        for c, d in zip(row["by_distance"], DISTANCES):
            assert c["trials"] == TRIALS == c["answered"] + c["refused"] == len(c["answers"])
            keys = r["prompts"][str(d)]["keys"]
            assert c["correct"] == sum(a is not None and passkey.correct(a, k) for a, k in zip(c["answers"], keys))
    assert all(c["refused"] == 0 for c in full["by_distance"] + ours["by_distance"])
    assert full["by_distance"][0]["correct"] >= 1  # the model itself answers a near key

    # stock at the budget: 256 tokens; vLLM refuses the 516-token prompt itself, runs the 216-token one whole
    assert stock["capacity"] == 256 and stock["bytes_per_request"] == r["budget"]["bytes"]
    near, far = stock["by_distance"]
    assert near["answered"] == TRIALS and near["cut_short"] == 0
    assert far["refused"] == TRIALS and far["correct"] == 0 and "256" in far["refusal"]

    # the plugin: a longer window in no more bytes (its peak pages), answering every prompt
    assert ours["capacity"] > max(DISTANCES) > stock["capacity"]
    assert ours["bytes_at_capacity"] <= ours["bytes_per_request"] <= r["budget"]["bytes"]
    assert sum(c["correct"] for c in ours["by_distance"]) >= 1
