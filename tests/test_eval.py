"""qsinkkv-eval on the real default model (a few hundred tokens; no network): the report, the replay against the
real cache, kv, stream and calibrate. (The frontier and tune: test_eval_frontier.py; --memory-of:
test_eval_memory.py; the command line's refusals: test_cli_errors.py.)"""
import json
import math
import types

import pytest
import torch
from helpers import outlier_qkv

pytest.importorskip("transformers")
from qsinkkv import CacheConfig, SinkQuantCache  # noqa: E402
from qsinkkv.eval import calibrate, cli, data, replay, schemes  # noqa: E402

MODEL_DTYPE = torch.bfloat16  # conftest.py's model_tok: the model as the eval loads it, in bf16


@pytest.fixture(scope="module")
def report(tmp_path_factory, monkeypatch_module, default_model):
    out = tmp_path_factory.mktemp("report")
    # 224 tokens: KIVI keeps the newest 128 in bf16, so its first blocks are read quantized from token 159 on
    assert cli.main(["report", "--tokens", "224", "--out", str(out), "--quiet"]) == 0
    return out, json.loads((out / "results.json").read_text())


def all_schemes():
    return [schemes.REFERENCE.name] + [s.name for b in (8, 4) for s in schemes.schemes_for(b)]


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_report_writes_every_file_and_scheme(report):
    out, res = report
    for f in ("results.json", "report.md", "kv.png", "ppl.png", "stream.png", "calibrate.png"):
        assert (out / f).stat().st_size > 0, f
    assert {"command", "date", "model", "versions", "config", "kv", "ppl", "stream", "calibrate"} <= set(res)
    assert res["versions"]["torch"] and res["versions"]["transformers"]
    assert res["command"].startswith("qsinkkv-eval report --tokens 224")
    md = (out / "report.md").read_text()
    # every scheme is measured (bitsandbytes and quanto are test dependencies) and reported
    assert [r["scheme"] for r in res["ppl"]["rows"]] == all_schemes()
    assert [r["scheme"] for r in res["kv"]["overall"]] == all_schemes()
    for name in all_schemes():
        assert f"`{name}`" in md
    for r in res["ppl"]["rows"]:
        assert r["status"] == "ok", r
        assert finite(r["ppl"]) and finite(r["kl"]) and r["kl"] >= -1e-6
    for r in res["kv"]["overall"]:
        assert all(finite(r[m]) for m in ("k_err", "v_err", "sink_v_err", "out_err", "kl", "sink_mass"))
    for layer in res["kv"]["per_layer"].values():
        assert len(layer["out_err"]) == 30
    stream_configs = __import__("qsinkkv.eval.stream").eval.stream.configs(4, 508)
    assert [r["config"] for r in res["stream"]["rows"]] == [c["name"] for c in stream_configs]
    assert all(finite(r["ppl"]) for r in res["stream"]["rows"])
    assert res["calibrate"]["recommended_sink_tokens"] >= 1
    # bytes beside every error: each scheme's real cache at the run's capacity (224 tokens here)
    assert md.count("bytes/token") >= 3 and "perplexity (all), cache_index" in md
    for r in res["ppl"]["rows"] + res["kv"]["overall"] + res["stream"]["rows"]:
        m = r["memory"]
        assert m["bytes"] == sum(m["parts"].values()) > 0 and 0 < m["bf16_fraction"] <= 1.25, r
    ppl_bytes = {r["scheme"]: r["memory"]["bytes_per_token"] for r in res["ppl"]["rows"]}
    assert ppl_bytes["bf16"] == 30 * 3 * 64 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    assert ppl_bytes["per-tensor-int4"] < ppl_bytes["qsinkkv-int4"] < ppl_bytes["qsinkkv-int8"] < ppl_bytes["bf16"]
    assert ppl_bytes["group-int4"] < ppl_bytes["qsinkkv-int4"]  # the bf16 sinks cost bytes


def test_bf16_reproduces_itself_and_quantization_costs(report):
    _, res = report
    rows = {r["scheme"]: r for r in res["ppl"]["rows"]}
    assert rows["bf16"]["kl"] == 0.0 and rows["bf16"]["delta_pct"] == 0.0
    kv = {r["scheme"]: r for r in res["kv"]["overall"]}
    assert kv["bf16"]["out_err"] == 0.0 and kv["bf16"]["kl"] == 0.0
    for name in all_schemes()[1:]:
        assert kv[name]["out_err"] > 0 and kv[name]["kl"] > 0, name
        assert rows[name]["kl"] > 0, name
    # the design's claims, as orderings a broken scheme would fail
    assert kv["per-tensor-int4"]["out_err"] > 5 * kv["qsinkkv-int4"]["out_err"]
    assert rows["per-tensor-int4"]["kl"] > 10 * rows["qsinkkv-int4"]["kl"]
    assert kv["qsinkkv-int4"]["sink_v_err"] == 0.0 < kv["group-int4"]["sink_v_err"]


def test_identity_store_is_exactly_the_reference(model_tok):
    """A 'quantizer' that stores bf16 exercises the stored-view path and must change nothing."""
    model, tok = model_tok
    ids = data.encode(tok, data.default_text(), 96)
    with replay.replay(lambda layer, k, v, sinks: None, 4, 40):
        ref, _, _ = replay.token_logprobs(model, ids)

    def identity(layer, k, v, sinks):
        return schemes.StoredKV(k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(),
                                torch.zeros(k.shape[2], dtype=torch.long))
    with replay.replay(identity, 4, 40):
        same, _, _ = replay.token_logprobs(model, ids)
    assert torch.allclose(same, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits,S,W,bs,R", [(4, 4, 40, 8, 0), (8, 2, 29, 5, 7), (4, 0, 33, 4, 0), (16, 3, 20, 8, 0)])
def test_replay_equals_the_real_cache_decode(bits, S, W, bs, R):
    """Token by token through SinkQuantCache.attend (eviction included) == one parallel replay."""
    B, H, Hkv, T, D = 1, 6, 2, 97, 16
    q, k, v = outlier_qkv(bits * 100 + W, B, H, Hkv, T, D)
    kw = dict(bits=bits, block_size=bs, value_group_size=8, residual_tokens=R)
    real = SinkQuantCache(CacheConfig(sink_tokens=S, recent_tokens=W, **kw), 1, B, Hkv, D, dtype=torch.float32,
                          backend="torch")
    stream = torch.cat([real.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(T)], 2)
    full = CacheConfig(sink_tokens=S, recent_tokens=T - S, **kw)
    view = schemes._real_cache_view(k, v, full) if bits != 16 else None
    out, _ = replay.attend(q, k, v, view, S, W)
    assert ((out - stream).norm() / stream.norm()).item() < 1e-5


@pytest.mark.model  # a float32 model of its own
def test_replay_tracks_a_real_token_by_token_stream():
    """End to end on the model (float32): the replay's per-token log-probs match a stream through
    QSinkKVCache; only float noise differs (it can flip a bf16 rounding or an int4 code)."""
    from qsinkkv.hf import QSinkKVCache

    model, tok = data.load(None, "cpu", torch.float32)
    ids = data.encode(tok, data.default_text(), 96)
    S, W = 4, 40
    kw = dict(sink_tokens=S, bits=4, block_size=8, value_group_size=16)
    def view(layer, k, v, sinks):
        return schemes._real_cache_view(k, v, CacheConfig(recent_tokens=k.shape[2] - S, **kw))

    with replay.replay(view, S, W):
        par, _, _ = replay.token_logprobs(model, ids)
    model.set_attn_implementation("qsinkkv")
    cache = QSinkKVCache(CacheConfig(recent_tokens=W, **kw), model.config, backend="torch")
    seq = []
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            ls = model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float().log_softmax(-1)
            seq.append(ls[ids[0, t + 1]])
    seq = torch.stack(seq)
    assert abs(par.mean() - seq.mean()) < 0.01 * abs(seq.mean())
    assert torch.corrcoef(torch.stack((par, seq)))[0, 1] > 0.99


@pytest.mark.model
def test_stream_detects_evicted_sinks(tmp_path, monkeypatch):
    assert cli.main(["stream", "--tokens", "320", "--capacity", "64", "--window", "64", "--out", str(tmp_path)]) == 0
    rows = {r["config"]: r for r in json.loads((tmp_path / "results.json").read_text())["stream"]["rows"]}
    for contract in ("absolute", "cache_index"):  # both contracts, by default; the claims hold under each
        after = {name: r["by_positions"][contract]["after_fill"] for name, r in rows.items()}
        assert after["window, no sinks"] > 1.5 * after["sinks + bf16 window"]
        assert after["sinks + int4"] < 1.1 * after["sinks + bf16 window"]
        assert after["full cache"] < after["window, no sinks"]
    # measured apart: once the cache fills, cache_index puts the sinks at another distance from the query
    bf16 = rows["sinks + bf16 window"]["by_positions"]
    assert bf16["absolute"]["after_fill"] != bf16["cache_index"]["after_fill"]


def test_calibrate_warnings():
    cfg = types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                num_hidden_layers=2)
    cfg.get_text_config = lambda decoder=True: cfg
    model = types.SimpleNamespace(config=cfg, named_parameters=lambda: iter([("layers.0.self_attn.sinks", None)]))
    w = calibrate.model_warnings(model)
    assert any("sink logits" in x for x in w) and any("1 of the 2 layers keep a trained window of 8" in x for x in w)
    plain = types.SimpleNamespace(layer_types=["full_attention"], num_hidden_layers=1)
    plain.get_text_config = lambda decoder=True: plain
    assert calibrate.model_warnings(types.SimpleNamespace(config=plain, named_parameters=lambda: iter([]))) == []


def test_short_text_keeps_kivi_unquantized(model_tok):
    """A text shorter than KIVI's 128-token residual is all bf16 for KIVI (not an error)."""
    model, tok = model_tok
    ids = data.encode(tok, data.default_text(), 100)
    from qsinkkv.eval import kv
    res = kv.run(model, ids, [4], 4, 100, only=["kivi-int4", "qsinkkv-int4"])
    rows = {r["scheme"]: r for r in res["overall"]}
    assert rows["kivi-int4"]["out_err"] == 0.0 < rows["qsinkkv-int4"]["out_err"]
