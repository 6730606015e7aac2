"""qsinkkv-eval on models with trained window layers: every layer replays as the model was
trained, the bytes count each layer type, and what cannot be replayed exactly is refused before the weights load.

The models are tiny random-weight ones (``test_hf_hybrid.py``'s architecture matrix); the command line runs on a tiny
Gemma 3 saved with the default model's tokenizer. The real Gemma 3 270M: ``test_gemma3_model.py``."""
import json
import math
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from helpers import save_tiny_gemma3  # noqa: E402
from test_hf_hybrid import FAMILIES, TINY, WINDOW, build, gemma_config, prompt  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from qsinkkv import CacheConfig  # noqa: E402
from qsinkkv.eval import calibrate, cli, data, footprint, kv, memory, replay, schemes  # noqa: E402
from qsinkkv.hf import QSinkKVCache  # noqa: E402

T = 40  # > WINDOW: every window layer drops tokens


def stock_bf16_kv(model, impl: str) -> str:
    """An attn_implementation that is ``impl`` (the model's stock attention) on K and V rounded to bf16: the model
    with transformers' own cache holding bf16, which is what the eval's bf16 reference is."""
    own = AttentionInterface._global_mapping.get(impl) or \
        sys.modules[type(model.model.layers[0].self_attn).__module__].eager_attention_forward

    def attention(module, q, k, v, *args, **kwargs):
        return own(module, q, k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), *args, **kwargs)
    AttentionInterface.register("stock_bf16_kv", attention)
    AttentionMaskInterface.register("stock_bf16_kv", AttentionMaskInterface._global_mapping[impl])
    return "stock_bf16_kv"


def logprobs(model, impl, ids):
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            ls = model(ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
    finally:
        model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    return ls.gather(1, ids[0, 1:, None])[:, 0]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model, stock = build(request.param)
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    return request.param, model, stock


@pytest.mark.parametrize("fused", [False, True], ids=["tiled", "fused"])
def test_the_full_cache_replay_is_the_model_itself(family, fused):
    """The replay ran every layer as full attention (Gemma 3 270M: the full-cache row read
    perplexity 108.6 where the model reads 45.4). Now each layer type as trained, learned sinks included: the
    bf16 reference with every token visible is the model with a bf16 cache, to float rounding."""
    name, model, stock = family
    ids = prompt(T)
    want = logprobs(model, stock_bf16_kv(model, stock), ids)
    with replay.replay(schemes.store_of(schemes.REFERENCE), 4, T, fused_causal=fused):
        got, _, _ = replay.token_logprobs(model, ids)
    assert (got - want).abs().max() < 2e-5, name


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "mistral"])
@pytest.mark.parametrize("bits", [16, 4])
def test_the_replay_of_a_window_tracks_a_token_by_token_stream_through_qsinkkvcache(name, bits):
    """A windowed, quantized run: global layers 4 sinks + 20 recent, window layers their trained 8 tokens, both int4
    (or bf16): one parallel replay equals a stream of single tokens through QSinkKVCache's LayerPolicy."""
    model, _ = build(name)
    ids = prompt(T, seed=3)
    S, W = 4, 20
    config = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=4, value_group_size=8)

    def store(layer, k, v, sinks):
        return None if bits == 16 else schemes.config_view(k, v, CacheConfig(**{**vars(config), "sink_tokens": sinks}))
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    with replay.replay(store, S, W):
        par, _, _ = replay.token_logprobs(model, ids)
    model.set_attn_implementation("qsinkkv")
    cache = QSinkKVCache(config, model, backend="torch")
    with torch.no_grad():
        seq = torch.stack([model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float().log_softmax(-1)[
            ids[0, t + 1]] for t in range(T - 1)])
    assert (par - seq).abs().max() < 1e-4, (name, (par - seq).abs().max())


def test_footprint_counts_each_layer_type_as_the_real_cache_holds_it():
    """Bytes per layer type: a real QSinkKVCache's (``HybridCache.nbytes_by_type``), and the model's own cache
    (transformers' ``DynamicSlidingWindowLayer`` on a window layer) for bf16 and the budgets."""
    model, _ = build("gemma3")
    geo = footprint.Geometry.of(model, tokens=T)
    assert (geo.num_layers, geo.window_layers, geo.window, geo.window_held) == (6, 4, WINDOW, WINDOW)
    ids = prompt(T)
    model.set_attn_implementation("qsinkkv")
    for bits in (8, 4):
        config = CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=4, value_group_size=8)
        cache = QSinkKVCache(config, model)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        fp = footprint.of_config(config, geo)
        assert fp.by_type == cache.inner.nbytes_by_type() and fp.total == cache.nbytes()
        assert footprint.allocated(config, geo) == fp.total
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        own = model(ids, use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in own.layers for t in (layer.keys, layer.values))
    assert footprint.bf16(geo, T).total == held // 2  # float32 there
    # a budget bf16:N is the model's own bf16 cache of N tokens: window layers hold WINDOW - 1 between steps
    per_token = 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 2  # one layer's K and V of a token in bf16
    assert memory.Budget("bf16", 100).nbytes(geo) == per_token * (2 * 100 + 4 * (WINDOW - 1))
    # a window layer's bytes do not grow with the capacity; a stream shorter than the window caps them
    d64 = footprint.Geometry(6, 1, 64, window_layers=4, window=WINDOW)  # the eval's schemes use groups of 64
    small, large = (footprint.of_scheme(schemes.Scheme("qsinkkv", 4, True), d64, 4, c) for c in (16, 128))
    assert small.by_type["sliding_attention"] == large.by_type["sliding_attention"]
    assert small.by_type["full_attention"] < large.by_type["full_attention"]
    short = footprint.Geometry.of(model, tokens=5)
    assert footprint.bf16(short, 5).by_type["sliding_attention"] == 4 * 5 * per_token


def test_kv_and_calibrate_measure_each_layer_type():
    """kv: a window layer attends its window with no sinks (its sink figures 0); calibrate measures the
    full-attention layers only, each with its learned sink logits."""
    model, _ = build("gpt_oss")  # layer 0: a window of 8, layer 1: full attention with learned sinks
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    ids = prompt(96)
    res = kv.run(model, ids, [4], 4, 96, only=["per-tensor-int4"])  # its sinks quantized like the rest
    layer = res["per_layer"]["per-tensor-int4"]
    assert res["ref_sink_mass"][0] == 0.0 < res["ref_sink_mass"][1]
    assert layer["sink_v_err"][0] == 0.0 < layer["sink_v_err"][1] and layer["out_err"][0] > 0
    cal = calibrate.run(model, ids)
    assert cal["layers"] == [1] and len(cal["first_mass"]) == 1
    assert any("trained window of 8 tokens" in w for w in cal["warnings"])
    mistral, _ = build("mistral")  # every layer a window: nothing to calibrate, refused before any forward
    with pytest.raises(ValueError, match="every layer of this mistral model keeps a trained window of 8 tokens"):
        calibrate.run(mistral, ids)


# --- the command line on a tiny Gemma 3 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_model):
    """A tiny random Gemma 3 (``helpers.save_tiny_gemma3``) with the default model's tokenizer."""
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "gemma", default_model)


def eval_cli(gemma_dir, tmp_path, *argv) -> dict:
    out = tmp_path / argv[0]
    assert cli.main([*argv, "--model", str(gemma_dir), "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.model
def test_ppl_on_a_window_model_reads_the_model_itself(gemma_dir, tmp_path):
    res = eval_cli(gemma_dir, tmp_path, "ppl", "--tokens", "96", "--bits", "4")["ppl"]
    rows = {r["scheme"]: r for r in res["rows"]}
    model, tok = data.load(str(gemma_dir), "cpu", torch.float32)
    ids = data.encode(tok, data.default_text(), 96)
    stock = math.exp(-logprobs(model, stock_bf16_kv(model, "sdpa"), ids).mean().item())
    assert rows["bf16"]["ppl"] == pytest.approx(stock, rel=1e-5)
    assert rows["qsinkkv-int4"]["kl"] > 0 and "window layers" in rows["quanto-int4"]["status"]
    # bytes: the window layers hold their 32 tokens, the global ones the 96
    assert rows["bf16"]["memory"]["bf16_fraction"] == 1.0  # the model's own cache
    by_type = rows["bf16"]["memory"]["by_type"]
    assert by_type == {"full_attention": 2 * 96 * 256, "sliding_attention": 4 * 31 * 256}  # 256: K, V of a token


@pytest.mark.model
def test_every_command_runs_on_a_window_model(gemma_dir, tmp_path):
    mem = eval_cli(gemma_dir, tmp_path, "stream", "--tokens", "800", "--memory-of", "bf16:256", "--window", "64")
    stream = mem["stream"]
    assert stream["positions"] == ["absolute"]  # the default on a window model: cache_index is not replayed there
    for row in stream["budgets"][0]["rows"]:
        assert row["bytes"] <= stream["budgets"][0]["bytes"] and row["memory"]["by_type"]["sliding_attention"] > 0
    rec = eval_cli(gemma_dir, tmp_path, "recall", "--capacity", "48", "--distances", "60,100", "--trials", "1")
    assert len(rec["recall"]["budgets"][0]["rows"]) == 4
    assert eval_cli(gemma_dir, tmp_path, "calibrate", "--tokens", "96")["calibrate"]["layers"] == [2, 5]
    front = eval_cli(gemma_dir, tmp_path, "frontier", "--tokens", "96", "--grid", "bits=4", "block=16",
                     "group=16", "residual=0", "sinks=4", "--schemes", "per-tensor-int4")["frontier"]
    assert all(r["status"] == "ok" and r["memory"]["by_type"] for r in front["rows"])
    tune = eval_cli(gemma_dir, tmp_path, "tune", "--tokens", "96", "--grid", "bits=4", "block=16", "group=16",
                    "residual=0", "sinks=4", "--budget", "0.9")["tune"]
    assert tune["best"]["status"] == "ok"
    report = eval_cli(gemma_dir, tmp_path, "report", "--tokens", "96", "--capacity", "64", "--bits", "4",
                      "--schemes", "qsinkkv-int4")
    assert report["stream"]["positions"] == ["absolute"] and report["calibrate"]["layers"] == [2, 5]


@pytest.fixture
def config_only(tmp_path):
    """A model folder holding only a config: its weights are never read."""
    def save(config):
        config.save_pretrained(tmp_path / "model")
        return tmp_path / "model"
    return save


@pytest.mark.parametrize("argv", [["ppl"], ["stream"], ["recall"], ["kv"], ["frontier"], ["tune", "--budget", "0.3"],
                                  ["report"]], ids=lambda a: a[0])
def test_cache_index_on_a_window_model_is_refused_before_the_weights(argv, config_only, tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(data, "load_model", lambda *a, **k: pytest.fail("the weights would load"))
    out = tmp_path / "out"
    model = config_only(gemma_config())
    assert cli.main([*argv, "--positions", "cache_index", "--model", str(model), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"qsinkkv-eval: error: --model {model}: positions='cache_index' on a model with trained window" in err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["ppl"], ["stream"], ["recall"], ["kv"], ["calibrate"], ["frontier"],
                                  ["tune", "--budget", "0.3"], ["report"]], ids=lambda a: a[0])
@pytest.mark.parametrize("make,named", [
    (lambda: transformers.Llama4TextConfig(num_hidden_layers=4), "chunked_attention layers"),
    (lambda: transformers.Gemma2Config(num_hidden_layers=4, **TINY), "soft-caps its attention logits"),
], ids=["chunked", "softcap"])
def test_what_cannot_be_replayed_is_refused_before_the_weights(argv, make, named, config_only, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setattr(data, "load_model", lambda *a, **k: pytest.fail("the weights would load"))
    out = tmp_path / "out"
    model = config_only(make())
    assert cli.main([*argv, "--model", str(model), "--out", str(out), "--quiet"]) == 2
    assert re.search(f"qsinkkv-eval: error: --model {re.escape(str(model))}: .*{named}", capsys.readouterr().err)
    assert not out.exists()


def test_a_head_the_eval_does_not_reproduce_is_refused():
    """The eval scores the output embedding's logits through ``head_logits``; a model whose forward changes them
    otherwise (here: a soft-cap its forward does not apply) is refused, never scored wrongly. Cohere's logit_scale
    is reproduced (it was missed before: every Cohere perplexity would have read wrong)."""
    model, _ = build("cohere2")
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    replay.check_head(model)
    assert model.logit_scale != 1.0
    model, _ = build("llama")
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    model.config.final_logit_softcapping = 3.0
    with pytest.raises(ValueError, match="changes its logits after the output embedding"):
        replay.check_head(model)
