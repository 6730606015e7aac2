"""Issue 64, item 5: a model with layers that are not full attention (a trained sliding window, chunks, linear
attention) is refused by name, never run as full attention: by ``attn_implementation="qsinkkv"`` without a
QSinkKVCache (before any layer runs), by ``QSinkKVCache``, and by every ``qsinkkv-eval`` command (by the model's
config, before its weights load). Tiny random-weight models, no download: a Gemma 3 whose layers 2 and 5 are
global and the rest keep a trained window of 8 tokens, and a Mistral with a model-wide window."""
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from qsinkkv import CacheConfig  # noqa: E402
from qsinkkv.hf import QSinkKVCache, qsinkkv_attention  # noqa: E402
from qsinkkv.integrations.transformers import hybrid_layers  # noqa: E402

WINDOW = 8
GEMMA_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
GEMMA_LAYERS = "sliding_attention (a trained window of 8 tokens) at layers 0-1, 3-4; full_attention at layers 2, 5"
NAMED = re.escape(GEMMA_LAYERS)  # as a regex
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, max_position_embeddings=256)


def gemma_config():
    return transformers.Gemma3TextConfig(num_hidden_layers=6, layer_types=GEMMA_TYPES, sliding_window=WINDOW, **TINY)


def mistral(sliding_window):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=sliding_window, **TINY)
    return transformers.MistralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def gemma():
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(gemma_config()).eval()


@pytest.fixture
def ids():
    return torch.randint(0, TINY["vocab_size"], (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))


def layer_calls(model) -> list[int]:
    """The decoder layers that run from now on (a forward pre-hook on each)."""
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *a, i=i: ran.append(i))
    return ran


def full_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What attn_implementation='qsinkkv' ran without a cache before it refused: plain causal SDPA, every layer."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=query.shape[2] > 1)


AttentionInterface.register("test_full_causal", full_causal)
AttentionMaskInterface.register("test_full_causal", lambda *args, **kwargs: None)


def test_full_attention_reads_this_model_wrongly(gemma, ids):
    """The premise: past its window, the old fallback (every layer as full attention) reads this model differently
    from stock, silently."""
    with torch.no_grad():
        gemma.set_attn_implementation("sdpa")
        stock = gemma(ids, use_cache=False).logits
        gemma.set_attn_implementation("test_full_causal")
        served = gemma(ids, use_cache=False).logits
    gemma.set_attn_implementation("sdpa")
    assert torch.allclose(stock[:, :WINDOW], served[:, :WINDOW], atol=1e-5)
    assert (stock[:, WINDOW:] - served[:, WINDOW:]).abs().max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(), dict(use_cache=False), dict(cache="dynamic")],
                         ids=["default", "no-cache", "dynamic-cache"])
def test_qsinkkv_attention_without_a_cache_refuses_before_any_layer(gemma, ids, kwargs):
    cache = DynamicCache(config=gemma.config) if kwargs.get("cache") == "dynamic" else None
    if cache is not None:
        kwargs = dict(cache=cache, use_cache=True)
    gemma.set_attn_implementation("qsinkkv")
    try:
        ran = layer_calls(gemma)
        with torch.no_grad(), pytest.raises(ValueError, match=f"attn_implementation='qsinkkv'.*{NAMED}"):
            gemma(ids, **kwargs)
        assert ran == []  # refused by the mask builder, before the first layer
        assert cache is None or cache.get_seq_length() == 0  # nothing stored
    finally:
        gemma.set_attn_implementation("sdpa")
        for layer in gemma.model.layers:
            layer._forward_pre_hooks.clear()


def test_the_attention_function_itself_refuses_a_window_layer(gemma):
    """Where the mask builder is skipped (a prepared 4D mask), the attention function refuses a window layer by
    its index, and runs a global one (full attention is what it was trained with)."""
    q, k = torch.randn(1, 2, 5, 32), torch.randn(1, 1, 5, 32)
    with pytest.raises(ValueError, match=r"without a QSinkKVCache \(layer 3; use 'sdpa' for this model\)"):
        qsinkkv_attention(gemma.model.layers[3].self_attn, q, k, k, None, scaling=1.0, sliding_window=WINDOW)
    out, _ = qsinkkv_attention(gemma.model.layers[2].self_attn, q, k, k, None, scaling=1.0)
    assert out.shape == (1, 5, 2, 32)


def test_qsinkkv_cache_refuses_naming_the_layers(gemma):
    for model_config in (gemma, gemma.config):
        with pytest.raises(ValueError, match=f"QSinkKVCache: this gemma3_text model .*{NAMED}"):
            QSinkKVCache(CacheConfig(), model_config)


def test_a_model_wide_window_is_refused_and_none_is_served(ids):
    model = mistral(WINDOW)
    model.set_attn_implementation("qsinkkv")
    with torch.no_grad(), pytest.raises(ValueError, match="mistral model .*sliding_attention .*at layers 0-1"):
        model(ids)
    # no window, or one at least as long as the positions (it never drops a token): full attention, served
    for window in (None, TINY["max_position_embeddings"]):
        model = mistral(window)
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            stock = model(ids, use_cache=False).logits
            model.set_attn_implementation("qsinkkv")
            ours = model(ids, use_cache=False).logits
        assert torch.allclose(stock, ours, atol=1e-5)


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


# --- qsinkkv-eval: refused by the config, before the weights load ---------------------------------------------

@pytest.fixture
def gemma_dir(tmp_path):
    """A model folder holding only the tiny Gemma 3's config: its weights are never read."""
    gemma_config().save_pretrained(tmp_path / "gemma")
    return tmp_path / "gemma"


def test_eval_load_refuses_before_the_weights(gemma_dir, monkeypatch):
    from qsinkkv.eval import data

    monkeypatch.setattr(data, "load_model", lambda *a, **k: pytest.fail("the weights would load"))
    with pytest.raises(ValueError, match=f"--model {re.escape(str(gemma_dir))}: this gemma3_text model .*{NAMED}"):
        data.load(str(gemma_dir), "cpu", torch.float32)


@pytest.mark.parametrize("argv", [["ppl"], ["stream"], ["recall"], ["kv"], ["calibrate"], ["frontier"],
                                  ["tune", "--budget", "0.3"], ["report"]], ids=lambda a: a[0])
def test_every_eval_command_refuses_a_hybrid_model_writing_nothing(argv, gemma_dir, tmp_path, capsys, monkeypatch):
    from qsinkkv.eval import cli, data, recall

    monkeypatch.setattr(data, "load_model", lambda *a, **k: pytest.fail("the weights would load"))
    monkeypatch.setattr(recall, "run", lambda *a, **k: pytest.fail("recall's full-cache row would run"))
    out = tmp_path / "out"
    assert cli.main([*argv, "--model", str(gemma_dir), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"qsinkkv-eval: error: --model {gemma_dir}: this gemma3_text model" in err and GEMMA_LAYERS in err
    assert not out.exists()
