"""Models with trained window layers through transformers: tiny random-weight models, no
download -- a Gemma 3 whose layers 2 and 5 are global and the rest keep a trained window of 8 tokens, a Mistral with
a model-wide window, a gpt-oss (alternating window and full layers, learned sinks).

* ``attn_implementation="qsinkkv"`` without a QSinkKVCache runs the model as trained (each layer's causal, window and
  padding mask): stock's logits and tokens, never full attention in place of a window.
* ``QSinkKVCache`` serves them under a ``LayerPolicy``: while the global layers hold every token (bits=16, float32)
  it is stock, token for token; past their capacity every layer type keeps exactly its visible set (a float64
  oracle: the model itself under each layer type's mask); a padded batch gives each row its answer alone.
* What cannot be served exactly is refused by name, nothing changed: the portable mode, a pool, soft-capping,
  chunked attention. (The eval on these models: ``test_eval_hybrid.py``.)"""
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from qsinkkv import CacheConfig  # noqa: E402
from qsinkkv.hf import QSinkKVCache  # noqa: E402
from qsinkkv.paged import PagedCache  # noqa: E402
from qsinkkv.policy import SLIDING, hybrid_layers  # noqa: E402

WINDOW = 8
GEMMA_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
GEMMA_LAYERS = "sliding_attention (a trained window of 8 tokens) at layers 0-1, 3-4; full_attention at layers 2, 5"
NAMED = re.escape(GEMMA_LAYERS)  # as a regex
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, max_position_embeddings=256)
EXACT = dict(bits=16, block_size=4, value_group_size=8, window_dtype=torch.float32, sink_dtype=torch.float32)


def gemma_config():
    return transformers.Gemma3TextConfig(num_hidden_layers=6, layer_types=GEMMA_TYPES, sliding_window=WINDOW, **TINY)


def _gpt_oss(**kw):
    return transformers.GptOssConfig(num_local_experts=2, num_experts_per_tok=1, **{**kw, "intermediate_size": 64})


# the architecture matrix: family -> (config class and its own arguments, the attn_implementation stock runs it with)
MATRIX = {
    "llama": (transformers.LlamaConfig, dict(num_hidden_layers=2), "sdpa"),
    "mistral": (transformers.MistralConfig, dict(num_hidden_layers=2, sliding_window=WINDOW), "sdpa"),
    "qwen2": (transformers.Qwen2Config, dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=2), "sdpa"),
    "qwen3": (transformers.Qwen3Config, dict(num_hidden_layers=2), "sdpa"),              # QK-norm
    "phi3": (transformers.Phi3Config, dict(num_hidden_layers=2, sliding_window=WINDOW, pad_token_id=0), "sdpa"),
    "olmo2": (transformers.Olmo2Config, dict(num_hidden_layers=2), "sdpa"),
    "cohere2": (transformers.Cohere2Config, dict(num_hidden_layers=4, sliding_window=WINDOW), "sdpa"),
    "gemma3": (transformers.Gemma3TextConfig, dict(num_hidden_layers=6, layer_types=GEMMA_TYPES,
                                                   sliding_window=WINDOW), "sdpa"),
    "gpt_oss": (_gpt_oss, dict(num_hidden_layers=2, sliding_window=WINDOW), "eager"),     # learned sinks
}
FAMILIES = list(MATRIX)


def build(family: str, dtype=torch.float32):
    """(model, the attn_implementation stock runs it with): random weights, seeded; gpt-oss's learned sinks drawn
    (zeros at init)."""
    make, own, stock = MATRIX[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(**{**TINY, **own}))
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model.to(dtype).eval(), stock


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return (request.param, *build(request.param))


def prompt(T=30, B=1, seed=0):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def run(model, impl, *args, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(*args, **kwargs)


def generate(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)


# --- no QSinkKVCache: the model as trained --------------------------------------------------------------------

def test_without_a_cache_the_qsinkkv_attention_runs_the_model_as_trained(family):
    """Without a QSinkKVCache the qsinkkv attention ran every layer as full attention (Gemma 3
    270M: perplexity 68 where stock reads 44). Now each layer's own mask: stock's logits with no cache, with
    transformers' own cache (a chunk after a prefix: the causal mask aligned to the newest key), a left-padded
    batch, and stock's greedy tokens."""
    name, model, stock = family
    ids = prompt()
    want = run(model, stock, ids, use_cache=False).logits
    assert (run(model, "qsinkkv", ids, use_cache=False).logits - want).abs().max() < 1e-5
    prefix = run(model, "qsinkkv", ids[:, :22], use_cache=True)
    chunk = run(model, "qsinkkv", ids[:, 22:], cache=prefix.past_key_values, use_cache=True).logits
    assert (chunk - want[:, 22:]).abs().max() < 1e-5, name
    padded = torch.cat((torch.zeros(1, 5, dtype=torch.long), ids), dim=1).repeat(2, 1)
    padded[1, 5:] = prompt(seed=1)
    mask = torch.ones_like(padded)
    mask[0, :5] = 0
    ours = run(model, "qsinkkv", padded, attention_mask=mask, use_cache=False).logits
    theirs = run(model, stock, padded, attention_mask=mask, use_cache=False).logits
    assert (ours[:, 5:] - theirs[:, 5:]).abs().max() < 1e-5
    assert torch.equal(generate(model, "qsinkkv", ids), generate(model, stock, ids))


# --- QSinkKVCache under the model's policy ------------------------------------------------------------------

def test_the_cache_is_stock_while_the_global_layers_hold_every_token(family):
    """bits=16 in float32, global layers of capacity 256: the prefill's logits and every greedy token are stock's
    (window layers keep exactly their trained window, no sinks; gpt-oss's learned sinks through the cache)."""
    name, model, stock = family
    ids = prompt()
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, **EXACT)
    want = run(model, stock, ids).logits
    cache = QSinkKVCache(cfg, model)
    assert (run(model, "qsinkkv", ids, cache=cache).logits - want).abs().max() < 1e-5
    assert torch.equal(generate(model, "qsinkkv", ids, cache=QSinkKVCache(cfg, model)), generate(model, stock, ids))
    windows = hybrid_layers(model.config)  # the layers trained with a window: exactly it, no sinks; the rest cfg
    for i, kind in enumerate(cache.policy.layer_types):
        kept = cache.policy.config(i)
        assert kept == cfg if i not in windows else (kind, kept.sink_tokens, kept.recent_tokens) == (SLIDING, 0, WINDOW)
    assert repr(cache).startswith("QSinkKVCache(" + ("sliding_attention" if 0 in windows else "full_attention"))


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The float64 reference of a policy, built from the visible sets alone: window layers see [i-W+1 .. i], global
    layers [0..S-1] and [i-R+1 .. i] once past S + R (ORACLE = (S, R)); no cache, every token's K/V."""
    T = query.shape[2]
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    S, R = ORACLE
    seen = (j <= i) & ((j > i - window) if window else ((j < S) | (j > i - R) | (i < S + R)))
    bias = torch.zeros(T, T, dtype=query.dtype).masked_fill_(~seen, float("-inf"))
    k, v = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
    scores = query @ k.transpose(-1, -2) * scaling + bias
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :T]
    return (p @ v).transpose(1, 2).contiguous(), None


ORACLE = (2, 14)
AttentionInterface.register("test_policy_oracle", oracle_attention)
AttentionMaskInterface.register("test_policy_oracle", lambda *args, **kwargs: None)


def test_past_the_capacity_every_layer_type_keeps_its_visible_set(family):
    """Global layers of 2 sinks + 14 recent (capacity 16) and window layers of 8 over a 40-token stream (a 24-token
    prompt, then 16 steps): every step's logits equal the float64 model (gpt-oss: float32) under each layer type's
    visible set."""
    name, _, _ = family
    model, _ = build(name, torch.float32 if name == "gpt_oss" else torch.float64)  # (its experts: no float64 kernel)
    ids = prompt(40)
    want = run(model, "test_policy_oracle", ids, use_cache=False).logits
    cache = QSinkKVCache(CacheConfig(sink_tokens=ORACLE[0], recent_tokens=ORACLE[1], **EXACT), model)
    got = [run(model, "qsinkkv", ids[:, :24], cache=cache).logits]
    got += [run(model, "qsinkkv", ids[:, t:t + 1], cache=cache).logits for t in range(24, 40)]
    err = (torch.cat(got, dim=1) - want).abs().max().item()
    assert err < 1e-4, (name, err)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_padded_batch_gives_each_row_its_answer_alone(bits):
    """Two left-padded prompts (one shorter) through an int8/int4 policy with generate: each row's tokens are the
    row's own alone, every layer type."""
    model, _ = build("gemma3")
    cfg = CacheConfig(sink_tokens=2, recent_tokens=14, bits=bits, block_size=4, value_group_size=8)
    a, b = prompt(26, seed=2), prompt(19, seed=3)
    batch = torch.zeros(2, 26, dtype=torch.long)
    batch[0], batch[1, 7:] = a[0], b[0]
    mask = (torch.arange(26) >= torch.tensor([[0], [7]])).long()
    model.set_attn_implementation("qsinkkv")
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              cache=QSinkKVCache(cfg, model))
        alone = [model.generate(x, max_new_tokens=10, do_sample=False, cache=QSinkKVCache(cfg, model)) for x in (a, b)]
    assert torch.equal(both[0, 26:], alone[0][0, 26:]) and torch.equal(both[1, 26:], alone[1][0, 19:])


def test_beam_search_and_crop_on_a_window_model():
    """Beam search (the cache reorders every layer type's rows) gives stock's beams; a crop every layer can take
    (within the window layers' ring) forgets the newest tokens in every layer type: the same tokens fed again give
    the logits they gave."""
    model, stock = build("gemma3")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, **EXACT)
    ids = prompt(20)
    assert torch.equal(generate(model, "qsinkkv", ids, num_beams=3, cache=QSinkKVCache(cfg, model)),
                       generate(model, stock, ids, num_beams=3))
    cache = QSinkKVCache(cfg, model)
    full = run(model, "qsinkkv", ids[:, :7], cache=cache).logits
    cache.crop(4)
    assert cache.get_seq_length() == 4 and cache.inner.layer_lengths() == [4] * 6
    again = run(model, "qsinkkv", ids[:, 4:7], cache=cache).logits
    assert (again - full[:, 4:]).abs().max() < 1e-5


def test_window_bits_and_the_bytes_of_each_type():
    """``window_bits`` sets the window layers' bits apart from the global layers'; the window layers' bytes are
    bounded by their window whatever the global layers keep."""
    model, _ = build("gemma3")
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=124, bits=4, block_size=4, value_group_size=8),
                         model, window_bits=8)
    assert cache.policy.config(0).bits == 8 and cache.policy.config(2).bits == 4
    run(model, "qsinkkv", prompt(30), cache=cache)
    by_type = cache.inner.nbytes_by_type()
    wide = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=252, bits=4, block_size=4, value_group_size=8),
                        model, window_bits=8)
    run(model, "qsinkkv", prompt(30), cache=wide)
    assert wide.inner.nbytes_by_type()[SLIDING] == by_type[SLIDING]
    assert wide.inner.nbytes_by_type()["full_attention"] > by_type["full_attention"]


# --- refused by name, nothing changed ----------------------------------------------------------------------------

def test_the_portable_mode_and_a_pool_are_refused_on_window_models():
    model, _ = build("gemma3")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=60, bits=4, block_size=4, value_group_size=8)
    cache = QSinkKVCache(cfg, model)
    with pytest.raises(ValueError, match="served with attn_implementation='qsinkkv' only"):
        run(model, "sdpa", prompt(), cache=cache)
    assert cache.inner is None and cache.get_seq_length() == 0
    pool = PagedCache(cfg, 6, 1, 32, max_seqs=1, float_blocks=8, quant_blocks=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="pool= serves models whose every layer is full attention"):
        QSinkKVCache(cfg, model, pool=pool)


@pytest.mark.parametrize("config, match", [
    (lambda: transformers.Gemma2Config(num_hidden_layers=2, **TINY), "soft-caps its attention logits"),
    (lambda: transformers.Llama4TextConfig(num_hidden_layers=4), "chunked_attention layers"),
    (lambda: transformers.Qwen3NextConfig(num_hidden_layers=4), "linear_attention layers"),
])
def test_what_cannot_be_served_exactly_is_refused_at_construction(config, match):
    with pytest.raises(ValueError, match=match):
        QSinkKVCache(CacheConfig(), config())


def test_a_cache_built_for_another_model_is_refused_by_the_layer():
    """A QSinkKVCache built with a full-attention Llama's config, handed to the Gemma 3: its window layer 0 refuses
    by name (the cache would keep sinks there)."""
    model, _ = build("gemma3")
    llama = transformers.LlamaConfig(num_hidden_layers=6, **TINY)
    llama._attn_implementation = "qsinkkv"  # (the fused mode, as the model's own config would say)
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=60, **EXACT), llama)
    with pytest.raises(ValueError, match="layer 0 has sliding_window=8 but the cache keeps 4 sinks"):
        run(model, "qsinkkv", prompt(), cache=cache)


@pytest.mark.parametrize("name,kwargs,expected", [
    ("Gemma3TextConfig", dict(num_hidden_layers=6, layer_types=GEMMA_TYPES), {0, 1, 3, 4}),
    ("Gemma2Config", dict(num_hidden_layers=4), {0, 2}),
    ("GptOssConfig", dict(num_hidden_layers=4), {0, 2}),
    ("Cohere2Config", dict(num_hidden_layers=4), {0, 1, 2}),
    ("Llama4TextConfig", dict(num_hidden_layers=4), {0, 1, 2}),
    ("Qwen3NextConfig", dict(num_hidden_layers=4), {0, 1, 2}),
    ("Qwen2Config", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2),
     {2, 3}),
    ("MistralConfig", dict(num_hidden_layers=4, sliding_window=4096), {0, 1, 2, 3}),
    ("MistralConfig", dict(num_hidden_layers=4, sliding_window=None), set()),
    ("Phi3Config", dict(num_hidden_layers=4, sliding_window=262144, max_position_embeddings=131072), set()),
    ("Qwen2Config", dict(num_hidden_layers=4), set()),
    ("LlamaConfig", dict(num_hidden_layers=4), set()),
])
def test_hybrid_layers_of_each_family(name, kwargs, expected):
    assert set(hybrid_layers(getattr(transformers, name)(**kwargs))) == expected


# --- tensor parallel --------------------------------------------------------------------------------------------

@pytest.mark.model  # the default model's tokenizer
def test_tensor_parallel_on_a_window_model_equals_one_process(tmp_path, default_model):
    """torchrun, 2 ranks on CPU (gloo), a tiny Gemma 3 with 2 KV heads sharded with tp_plan="auto": each rank's
    HybridCache holds 1 KV head of each layer type (half the bytes), and a lossless stream past the global layers'
    capacity and the window layers' window gives the tokens of one process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import save_tiny_gemma3

    model = save_tiny_gemma3(tmp_path / "gemma", default_model, num_attention_heads=4, num_key_value_heads=2)
    script = [str(Path(__file__).parents[1] / "examples" / "tp_generate.py"), "--bits", "16", "--tokens", "48",
              "--model", str(model)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *script, "--json", str(tmp_path / "one.json")], env=env,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    tp = subprocess.run([*torchrun, *script, "--json", str(tmp_path / "tp.json")], env=env, capture_output=True,
                        text=True)
    assert tp.returncode == 0, tp.stderr[-2000:]
    one, tp = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp"))
    assert tp["world"] == 2 and tp["tokens"] == one["tokens"]
    assert [r["kv_heads"] for r in tp["ranks"]] == [1, 1] and one["ranks"][0]["kv_heads"] == 2
    assert [2 * r["bytes"] for r in tp["ranks"]] == [one["ranks"][0]["bytes"]] * 2
