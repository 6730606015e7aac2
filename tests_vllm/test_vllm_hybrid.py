"""qsinkkv inside vLLM on models with trained window layers: a tiny random Gemma 3 (``make_reference.py``'s
``tiny_gemma3``: layers 2 and 5 global, the rest a trained window of 24 tokens) and a tiny random gpt-oss
(``tiny_gpt_oss``: a window layer, a global one, learned sinks, experts) under the per-layer-type policy -- its
global layers on qsinkkv's sinks + window, its window layers on qsinkkv's pages with exactly their window and no
sinks, each type its own KV cache group in vLLM's hybrid allocator. Before, the plugin refused the model at
start (``sliding_window`` by name)."""
from dataclasses import replace

import pytest
from conftest import run_engine

from qsinkkv.engine_pages import PageLayout, max_pages
from qsinkkv.integrations.vllm import parse_config
from qsinkkv.layout import WindowLayout

WIDE = {"sink_tokens": 4, "recent_tokens": 1020, "bits": 16, "block_size": 32,
        "sink_dtype": "float32", "window_dtype": "float32"}  # the global layers keep every token here


def departures(ref: list, out: list) -> list:
    return [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out)]


@pytest.mark.parametrize("model", ["gemma3", "gptoss"])
def test_a_window_model_within_the_global_capacity_equals_stock_vllm(reference, model):
    """bits=16 float32, the global layers holding every token: the plugin's greedy tokens are stock vLLM's (its own
    sliding-window layers; gpt-oss: its learned sinks too), 8 x 64, every row past the 24-token window."""
    run = reference[f"{model}_bits16"]
    spec = {"model": run["model"], "prompts": run["prompts"], "max_tokens": 64}
    stock = run_engine(spec)
    ours = run_engine({**spec, "qsinkkv": WIDE})
    assert "error" not in stock and "error" not in ours, (stock.get("error"), ours.get("error"))
    assert ours["block_size"] == 32 and stock["block_size"] != 32  # the plugin's engine really took our config
    assert ours["tokens"] == stock["tokens"]


@pytest.mark.parametrize("name", ["gemma3_bits16", "gemma3_int4", "gptoss_bits16", "gptoss_int4"])
def test_a_window_model_past_capacity_follows_qsinkkvcache(reference, name):
    """S=4 W=60 on the global layers (bits=16 float32, or int4 blocks of 32), 24 tokens on the window layers: every
    row streams past both, and keeps HF generate's tokens with QSinkKVCache's policy (made in the main venv). Two KV
    cache groups' windows: the global layers' sinks + 60, the window layers' 24 and no sinks; each request holds a
    constant number of blocks in each."""
    run = reference[name]
    cfg, prompts, ref = run["config"], run["prompts"], run["tokens"]
    C = cfg["sink_tokens"] + cfg["recent_tokens"]
    out = run_engine({"model": run["model"], "prompts": prompts, "max_tokens": len(ref[0]), "qsinkkv": cfg,
                      "step": True})
    assert "error" not in out, out.get("error")
    windows = {(g["sink_tokens"], g["recent_tokens"]) for g in out["groups"]}
    assert windows == {(cfg["sink_tokens"], cfg["recent_tokens"]), (0, 24)}, out["groups"]
    firsts = departures(ref, out["tokens"])
    margin = 32 if cfg["bits"] == 16 else 16
    for p, r, first in zip(prompts, ref, firsts):
        assert len(p) + len(r) > C + 32, "the reference must stream past the capacity"
        # a window layer run as full attention departs within a few tokens of its window (24), a wrong global window
        # at the capacity
        assert first is None or first >= C - len(p) + margin, f"rows depart from qsinkkv's reference at {firsts}"
    # float32 engines (vLLM's fused ops vs HF's) may part on a near-tie far past the window
    assert sum(f is None for f in firsts) >= 6, f"rows depart from qsinkkv's reference at {firsts}"
    base = parse_config(cfg)
    for g in out["groups"]:  # bounded by the window, whatever the length: what leaves it goes back to the pool
        c = replace(base, sink_tokens=g["sink_tokens"], recent_tokens=g["recent_tokens"])
        if c.bits == 16:
            bound = -(-c.sink_tokens // c.block_size) + -(-c.recent_tokens // c.block_size) + 1
        else:  # the tiny models' 2 KV heads of 64
            bound = max_pages(WindowLayout(c), PageLayout.of(c, 2, 64).pinned, 1 + max(map(len, prompts)))
        assert max(g["most"]) <= bound, (bound, out["groups"])


@pytest.mark.parametrize("text,named", [
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8, attn_logit_softcapping=50.0),
     "soft-caps its attention logits"),
    (dict(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=8192), "chunked_attention layers"),
    (dict(layer_types=["linear_attention", "full_attention"]), "linear_attention layers"),
], ids=["gemma2-softcap", "llama4-chunked", "qwen3next-linear"])
def test_what_the_policy_cannot_serve_is_refused_in_the_front_end(text, named):
    """Before any engine process starts (``_validate``, the platform's ``check_and_update_config``), by name."""
    from types import SimpleNamespace

    from qsinkkv.integrations.vllm import PluginConfigError, _validate
    text_config = SimpleNamespace(num_hidden_layers=2, model_type="test", **text)
    model = SimpleNamespace(hf_text_config=text_config, max_model_len=1024)
    raw = {"sink_tokens": 4, "recent_tokens": 60, "block_size": 32}
    vllm_config = SimpleNamespace(additional_config={"qsinkkv": raw},
                                  cache_config=SimpleNamespace(block_size=16, user_specified_block_size=False,
                                                               enable_prefix_caching=False),
                                  model_config=model, speculative_config=None, parallel_config=None)
    with pytest.raises(PluginConfigError, match=named):
        _validate(vllm_config)
