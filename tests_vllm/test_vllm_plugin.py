"""qsinkkv inside vLLM: stock parity within the capacity, qsinkkv's own reference past it, refusals."""
import pytest
from conftest import run_engine

WIDE = {"sink_tokens": 4, "recent_tokens": 1020, "bits": 16, "block_size": 32,
        "sink_dtype": "float32", "window_dtype": "float32"}  # S + W = 1024 > every sequence here


def test_within_capacity_equals_stock_vllm(reference):
    """bits=16, S + W longer than every sequence: the plugin's greedy tokens are stock vLLM's, 8 x 64."""
    spec = {"prompts": reference["prompts"], "max_tokens": 64}
    stock = run_engine(spec)
    ours = run_engine({**spec, "qsinkkv": WIDE})
    assert "error" not in stock and "error" not in ours, (stock.get("error"), ours.get("error"))
    assert ours["block_size"] == 32 and stock["block_size"] != 32  # the plugin's engine really took our config
    assert ours["tokens"] == stock["tokens"]


def test_past_capacity_follows_qsinkkv_reference(reference):
    """bits=16 float32, S=4 W=60: every row streams past the capacity (64) and keeps qsinkkv's tokens
    (HF generate with QSinkKVCache, made in the main venv); the pool holds a constant block count."""
    cfg, prompts, ref = reference["config"], reference["prompts"], reference["tokens"]
    C = cfg["sink_tokens"] + cfg["recent_tokens"]
    out = run_engine({"prompts": prompts, "max_tokens": len(ref[0]), "qsinkkv": cfg, "step": True})
    assert "error" not in out, out.get("error")
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out["tokens"])]
    for p, r, first in zip(prompts, ref, firsts):
        past = C - len(p)                      # generated tokens until the row reaches the capacity
        assert len(p) + len(r) > C + 32, "the reference must stream past the capacity"
        # a full-attention (or wrong-window) engine departs within a few tokens of the capacity
        assert first is None or first >= past + 32, f"rows depart from qsinkkv's reference at {firsts}"
    # float32 engines (vLLM's fused ops vs HF's) may part on a near-tie far past the window
    assert sum(f is None for f in firsts) >= 6, f"rows depart from qsinkkv's reference at {firsts}"
    bs = out["block_size"]
    bound = -(-cfg["sink_tokens"] // bs) + -(-cfg["recent_tokens"] // bs) + 1
    assert max(out["held_blocks"]["most"]) <= bound, out["held_blocks"]


@pytest.mark.parametrize("bad, field", [({"bits": 3}, "bits"), ({"sink_tokens": 4, "windw": 8}, "windw"),
                                        ({"bits": 16, "block_size": 24}, "block_size"), ({"bits": 4}, "bits")])
def test_bad_config_stops_the_engine_naming_the_field(bad, field):
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": bad}, timeout=240)
    assert "error" in out and field in out["error"], out


def test_prefix_caching_is_refused():
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": WIDE,
                      "llm": {"enable_prefix_caching": True}}, timeout=240)
    assert "error" in out and "enable_prefix_caching" in out["error"], out
