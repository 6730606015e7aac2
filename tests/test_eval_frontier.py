"""qsinkkv-eval frontier / tune (eval/frontier.py, eval/footprint.py), the bytes in the tables, and the cache_index
replay.

On the real default model with a tiny grid and a short text (the default grid and text are what
the README's tables come from)."""
import json
import math

import pytest
import torch
from helpers import outlier_qkv

pytest.importorskip("transformers")
from qsinkkv import CacheConfig, Rotary, SinkQuantCache, quant  # noqa: E402
from qsinkkv.eval import cli, data, footprint, frontier, replay, report, schemes  # noqa: E402

MODEL_DTYPE = torch.float32  # conftest.py's model_tok: the model as the eval loads it

TOKENS = 96
# 16 configurations whose bytes differ (block, group, residual and sinks all move them); no calibrate:
# it needs 81+ tokens and is covered by the README's default run
GRID = ["bits=8,4", "block=16,32", "group=32", "residual=0,16", "sinks=1,4"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory, monkeypatch_module, default_model):
    """One frontier run: the grid and every baseline (quanto included: every token is visible)."""
    out = tmp_path_factory.mktemp("frontier")
    assert cli.main(["frontier", "--tokens", str(TOKENS), "--grid", *GRID, "--out", str(out), "--quiet"]) == 0
    return out, json.loads((out / "results.json").read_text())["frontier"]


def geometry(model) -> footprint.Geometry:
    cfg = model.config
    return footprint.Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype)


def real_cache_bytes(config: dict, geo: footprint.Geometry) -> int:
    """A real SinkQuantCache of the row's config, every layer, after a stream of its capacity."""
    fields = {k: v for k, v in config.items() if not k.endswith("dtype")}
    c = CacheConfig(**fields)
    cache = SinkQuantCache(c, geo.num_layers, 1, geo.num_kv_heads, geo.head_dim, dtype=torch.bfloat16,
                           backend="torch")
    kv = torch.randn(1, geo.num_kv_heads, c.capacity, geo.head_dim, dtype=torch.bfloat16)
    for layer in range(geo.num_layers):
        cache.append(layer, kv, kv)
    return cache.nbytes()


def token_by_token_layer_bytes(layer, geo, tokens: int, dtype) -> int:
    """A transformers cache layer fed one token at a time (as generate does): the bytes it holds."""
    x = torch.randn(1, geo.num_kv_heads, tokens, geo.head_dim, dtype=dtype)
    for t in range(tokens):
        layer.update(x[:, :, t:t + 1], x[:, :, t:t + 1])
    out = 0
    for t in (layer.keys, layer.values, getattr(layer, "_quantized_keys", None),
              getattr(layer, "_quantized_values", None)):
        if t is None:
            continue
        names = t.__tensor_flatten__()[0] if hasattr(type(t), "__tensor_flatten__") else None
        if names:  # quanto: packed codes (one more level), scales, shifts
            for n in names:
                inner = getattr(t, n)
                inner = getattr(inner, "_data", inner)
                out += inner.numel() * inner.element_size()
        else:
            out += t.numel() * t.element_size()
    return out


def expected_bytes(row: dict, geo: footprint.Geometry, capacity: int, sink_tokens: int) -> int:
    """Each point's storage, measured or counted independently of footprint.py."""
    from transformers.cache_utils import DynamicLayer, QuantoQuantizedLayer

    if row["config"] is not None:  # ours, KIVI, group: the real cache
        return real_cache_bytes(row["config"], geo)
    scheme = schemes.find_scheme(row["name"])
    L, H, D = geo.num_layers, geo.num_kv_heads, geo.head_dim
    if scheme.family == "bf16":
        return L * token_by_token_layer_bytes(DynamicLayer(), geo, capacity, torch.bfloat16)
    if scheme.family == "quanto":
        layer = QuantoQuantizedLayer(nbits=4, **schemes.QUANTO)
        return L * token_by_token_layer_bytes(layer, geo, capacity, geo.dtype)
    S = sink_tokens if scheme.bf16_sinks else 0
    n = (capacity - S) * H * D  # quantized values of K (and of V) per layer
    sinks = S * H * D * 2
    if scheme.family == "per-tensor":  # codes at bits each, one float32 scale
        return L * 2 * (n * scheme.bits // 8 + 4 + sinks)
    bits = 8 if scheme.family == "bnb-dyn8" else 4  # bitsandbytes: codes + a float32 absmax per 64 values
    return L * 2 * (n * bits // 8 + n // schemes.BNB_BLOCK * 4 + sinks)


def test_frontier_bytes_are_the_real_storage_of_every_point(swept, model_tok):
    out, r = swept
    geo = geometry(model_tok[0])
    rows = [o for o in r["rows"] if o["status"] == "ok"]
    names = {o["name"] for o in rows}
    assert len([o for o in rows if o["ours"]]) == 16
    assert {s.name for b in (8, 4) for s in schemes.schemes_for(b)} | {"bf16"} <= names  # every baseline measured
    for o in rows:
        m = o["memory"]
        assert m["capacity"] == TOKENS and m["bytes"] == sum(m["parts"].values()), o["name"]
        assert m["bytes"] == expected_bytes(o, geo, TOKENS, r["sink_tokens"]), o["name"]
        assert math.isclose(m["bytes_per_token"] * TOKENS, m["bytes"])
        assert math.isclose(m["bf16_fraction"], m["bytes"] / (TOKENS * geo.bf16_bytes_per_token))
    # what moves the bytes moves them: a bigger block holds more of the window in bf16, bf16 sinks cost
    by = {o["name"]: o["memory"]["bytes"] for o in rows}
    assert by["int4 S1 b16 g32 r0"] < by["int4 S1 b32 g32 r0"] < by["int4 S1 b32 g32 r16"]
    assert by["int4 S1 b16 g32 r0"] < by["int4 S4 b16 g32 r0"] < by["int8 S4 b16 g32 r0"]
    assert by["per-tensor-int4"] < by["per-tensor-int4+sinks"]


def test_frontier_marks_the_pareto_points_and_writes_the_plot(swept):
    out, r = swept
    assert (out / "frontier.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert ("| configuration | bits | sinks | block | group | residual | allocated bytes/token | ideal bytes/token "
            "| x bf16 (allocated) |") in md
    rows = [o for o in r["rows"] if o["status"] == "ok"]
    front = [o for o in rows if o["pareto"]]
    assert front and any(o["ours"] for o in front)
    for o in rows:  # on the frontier exactly when nothing dominates it
        dominated = any(p["memory"]["bytes"] <= o["memory"]["bytes"] and p["kl"] <= o["kl"]
                        and (p["memory"]["bytes"] < o["memory"]["bytes"] or p["kl"] < o["kl"]) for p in rows)
        assert o["pareto"] == (not dominated), o["name"]
    bf16 = next(o for o in rows if o["name"] == "bf16")
    assert bf16["kl"] == 0.0 and bf16["pareto"]
    assert all(o["kl"] > 0 for o in rows if o["ours"])  # (KIVI's residual holds all of 96 tokens: KL 0)
    kivi = next(e for e in r["equal_bytes"] if e["baseline"] == "kivi-int4")
    ours_within = [o for o in rows if o["ours"] and o["memory"]["bytes_per_token"] <= kivi["bytes_per_token"]]
    assert kivi["best"] == min(ours_within, key=lambda o: (o["kl"], o["memory"]["bytes"]))["name"]


def test_tune_returns_the_least_kl_within_the_budget(swept, tmp_path, capsys):
    _, r = swept
    ours = [o for o in r["rows"] if o["ours"] and o["status"] == "ok"]
    fractions = sorted(o["memory"]["bf16_fraction"] for o in ours)
    budget = round(fractions[len(fractions) // 2], 4)  # about half the grid fits
    assert cli.main(["tune", "--budget", str(budget), "--tokens", str(TOKENS), "--grid", *GRID, "--out",
                     str(tmp_path), "--quiet"]) == 0
    printed = capsys.readouterr().out
    t = json.loads((tmp_path / "results.json").read_text())["tune"]
    within = [o for o in ours if o["memory"]["bf16_fraction"] <= budget]
    assert 0 < t["within"] == len(within) < len(ours) and t["considered"] == len(ours)
    want = min(within, key=lambda o: (o["kl"], o["memory"]["bytes"]))
    assert t["best"]["name"] == want["name"]
    assert math.isclose(t["best"]["kl"], want["kl"], rel_tol=1e-6)
    # the printed line is the configuration itself, and a real cache of it fits the budget
    line = next(s.strip() for s in printed.splitlines() if s.strip().startswith("CacheConfig("))
    config = eval(line, {"CacheConfig": CacheConfig})  # noqa: S307 (our own output)
    assert config == CacheConfig(**{k: v for k, v in want["config"].items() if not k.endswith("dtype")})
    assert real_cache_bytes(want["config"], footprint.Geometry(30, 3, 64)) <= budget * TOKENS * 23040


@pytest.mark.model  # refused once the model's geometry is known
def test_tune_refuses_a_budget_nothing_fits(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["tune", "--budget", "0.05", "--tokens", "64", "--grid", "bits=4", "block=16", "group=32",
                     "residual=0", "sinks=1", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--budget 0.05: no configuration of the grid fits" in err and "int4 S1 b16 g32 r0" in err
    assert not out.exists()


@pytest.mark.model
def test_tune_refuses_before_calibrating_when_no_sink_count_could_fit(tmp_path, capsys, monkeypatch):
    from qsinkkv.eval import calibrate

    monkeypatch.setattr(calibrate, "run", lambda *a, **k: pytest.fail("calibrated although nothing could fit"))
    out = tmp_path / "out"
    assert cli.main(["tune", "--budget", "1000B", "--tokens", "96", "--grid", "bits=4", "residual=0",
                     "--out", str(out), "--quiet"]) == 2
    assert "--budget 1000B: no configuration of the grid fits 1,000 bytes/token" in capsys.readouterr().err
    assert not out.exists()


def test_budget_forms():
    geo = footprint.Geometry(30, 3, 64)
    assert frontier.Budget.parse("0.30").limit(geo) == pytest.approx(0.30 * 23040)
    assert frontier.Budget.parse("30%").limit(geo) == pytest.approx(0.30 * 23040)
    assert frontier.Budget.parse("7000").limit(geo) == 7000 == frontier.Budget.parse("7000B").limit(geo)


def test_tune_budget_below_one_byte_is_printed_as_asked():
    """--budget 1.5 is 1.5 bytes/token (any plain number above 1): the messages say 1.5, not a rounded 2."""
    from qsinkkv import CacheConfig
    from qsinkkv.eval import footprint, frontier

    budget = frontier.Budget.parse("1.5")
    assert budget.bytes_per_token == 1.5
    geo = footprint.Geometry(2, 1, 16)
    with pytest.raises(ValueError) as e:
        frontier.check_budget([CacheConfig(sink_tokens=1, recent_tokens=15, bits=4, block_size=8,
                                           value_group_size=16)], budget, geo, 16)
    assert "no configuration of the grid fits 1.5 bytes/token" in str(e.value)
    best = dict(kl=0.01, ppl=10.0, delta_pct=1.0, memory=dict(bytes_per_token=1.0, bf16_fraction=0.001))
    r = dict(budget=dict(text="1.5", limit_bytes_per_token=1.5), capacity=16, within=1, considered=1,
             config_line="CacheConfig()", best=best, tokens=16, positions="absolute")
    assert report.tune_summary(r).startswith("budget 1.5: 1.5 bytes/token at capacity 16")


# --- the cache_index contract ------------------------------------------------------------------------

@pytest.mark.parametrize("bits,S,W,bs,R", [(4, 4, 40, 8, 0), (8, 2, 29, 5, 7), (4, 0, 33, 4, 0), (16, 3, 20, 8, 0),
                                           (4, 4, 40, 8, 16)])
def test_cache_index_replay_equals_the_real_cache_decode(bits, S, W, bs, R):
    """Token by token through SinkQuantCache(positions="cache_index") == one parallel replay, pre-RoPE
    keys quantized and rotated by cache index; the absolute contract on the same keys is not."""
    B, H, Hkv, T, D = 1, 6, 2, 97, 16
    q, k, v = outlier_qkv(bits * 100 + W, B, H, Hkv, T, D)
    rotary = Rotary.from_schedule(D, base=100.0)
    kw = dict(bits=bits, block_size=bs, value_group_size=8, residual_tokens=R)
    real = SinkQuantCache(CacheConfig(sink_tokens=S, recent_tokens=W, positions="cache_index", **kw), 1, B, Hkv, D,
                          dtype=torch.float32, rotary=rotary, backend="torch")
    stream = torch.cat([real.attend(0, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(T)], 2)
    view = schemes.config_view(k, v, CacheConfig(sink_tokens=S, recent_tokens=W, **kw)) if bits != 16 else None
    out, _ = replay.attend(q, k, v, view, S, W, rotary=rotary)
    assert ((out - stream).norm() / stream.norm()).item() < 1e-5
    # absolute: the same keys rotated once at their true positions (a sink then drifts away from the query)
    pos = torch.arange(T)
    k_abs = rotary.rotate(k, pos)
    view_abs = schemes.config_view(k_abs, v, CacheConfig(sink_tokens=S, recent_tokens=W, **kw)) if bits != 16 \
        else None
    absolute, _ = replay.attend(rotary.rotate(q, pos), k_abs, v, view_abs, S, W)
    assert ((absolute - stream).norm() / stream.norm()).item() > (1e-3 if S else 0)


def test_cache_index_replay_tracks_a_real_token_by_token_stream(model_tok):
    """End to end on the model (float32): the cache_index replay's per-token log-probs match streams
    through QSinkKVCache(positions="cache_index"), bf16 window (float noise only) and int4; the
    absolute replay of the bf16 window does not."""
    from qsinkkv.hf import QSinkKVCache

    model, tok = model_tok
    ids = data.encode(tok, data.default_text(), 64)
    S, W = 4, 20  # 35 of the 63 predictions come after the cache fills
    configs = {bits: CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=8, value_group_size=16,
                                 positions="cache_index") for bits in (16, 4)}
    par = {}
    for bits, c in configs.items():
        for positions in ("cache_index", "absolute"):
            def view(layer, k, v, sinks, c=c):
                return schemes.config_view(k, v, c) if c.bits != 16 else None
            with replay.replay(view, S, W, rotary=replay.positions_rotary(model, positions)):
                par[bits, positions], _, _ = replay.token_logprobs(model, ids)
    model.set_attn_implementation("qsinkkv")
    try:
        caches = {bits: QSinkKVCache(c, model.config, backend="torch") for bits, c in configs.items()}
        seq = {bits: [] for bits in configs}
        with torch.no_grad():
            for t in range(ids.shape[1] - 1):
                for bits, cache in caches.items():
                    ls = model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float().log_softmax(-1)
                    seq[bits].append(ls[ids[0, t + 1]])
    finally:
        model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    seq = {bits: torch.stack(x) for bits, x in seq.items()}
    ci, ab = (par[16, p] - seq[16] for p in ("cache_index", "absolute"))
    assert ci.abs().mean() < 0.01 and torch.corrcoef(torch.stack((par[16, "cache_index"], seq[16])))[0, 1] > 0.9999
    assert ab.abs().mean() > 5 * ci.abs().mean()  # the contracts differ once the sinks stop moving with the query
    four = par[4, "cache_index"]
    assert abs(four.mean() - seq[4].mean()) < 0.01 * abs(seq[4].mean())
    assert torch.corrcoef(torch.stack((four, seq[4])))[0, 1] > 0.99


def test_ppl_under_cache_index_reports_it_and_skips_quanto(model_tok):
    from qsinkkv.eval import ppl

    model, tok = model_tok
    ids = data.encode(tok, data.default_text(), TOKENS)  # the first 64-token block is quantized at 68
    res = ppl.run(model, ids, [4], 4, TOKENS, only=["qsinkkv-int4", "quanto-int4"], positions="cache_index")
    rows = {r["scheme"]: r for r in res["rows"]}
    assert res["positions"] == "cache_index" and rows["qsinkkv-int4"]["kl"] > 0
    assert "absolute positions only" in rows["quanto-int4"]["status"]
    assert rows["qsinkkv-int4"]["memory"]["bytes"] == real_cache_bytes(
        frontier._config_dict(schemes.cache_config(schemes.find_scheme("qsinkkv-int4"), 4, TOKENS)), geometry(model))


def test_per_tensor_int4_codes_pack_two_per_byte():
    codes, _ = quant.quantize_per_tensor_symmetric(torch.randn(1, 3, 10, 64), 4)
    geo = footprint.Geometry(1, 3, 64)
    fp = footprint.of_scheme(schemes.find_scheme("per-tensor-int4"), geo, 0, 10)
    assert fp.parts["codes"] == 2 * codes.numel() // 2
