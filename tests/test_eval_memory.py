"""qsinkkv-eval stream --memory-of: every scheme at the largest capacity whose allocated bytes
fit a budget, compared over the same positions; bad budgets refused before any work."""
import json
import types

import pytest
import torch

pytest.importorskip("transformers")
from qsinkkv import SinkQuantCache  # noqa: E402
from qsinkkv.eval import cli, footprint, memory, stream  # noqa: E402
from qsinkkv.eval.schemes import cache_config  # noqa: E402

SMOLLM = footprint.Geometry(30, 3, 64)


def real_bytes(name: str, S: int, C: int, geo: footprint.Geometry) -> int:
    """A really built cache of the row's scheme holding C tokens, fed them: what it holds."""
    scheme = stream.WINDOWED[name][0]
    if scheme.family == "bf16":  # a DynamicLayer per layer, fed token by token as generate does
        from transformers.cache_utils import DynamicLayer

        layer = DynamicLayer()
        x = torch.randn(1, geo.num_kv_heads, C, geo.head_dim, dtype=torch.bfloat16)
        for t in range(C):
            layer.update(x[:, :, t:t + 1], x[:, :, t:t + 1])
        return geo.num_layers * (layer.keys.nbytes + layer.values.nbytes)
    config = cache_config(scheme, S, C)
    cache = SinkQuantCache(config, geo.num_layers, 1, geo.num_kv_heads, geo.head_dim, dtype=torch.bfloat16,
                           backend="torch")
    kv = torch.randn(1, geo.num_kv_heads, C, geo.head_dim, dtype=torch.bfloat16)
    for layer in range(geo.num_layers):
        cache.append(layer, kv, kv)
    return cache.nbytes()


@pytest.mark.parametrize("geo", [SMOLLM, footprint.Geometry(2, 2, 128)], ids=["smollm2", "d128"])
@pytest.mark.parametrize("text", ["bf16:128", "bf16:257", "fp32:200"])
def test_each_row_fits_and_one_more_block_would_not(geo, text):
    budget, = memory.parse_memory_of(text)
    limit = budget.nbytes(geo)
    assert limit == geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * budget.tokens * \
        (4 if budget.dtype == "fp32" else 2)
    plan = stream.plan_memory(geo, [budget], 4, 100_000)
    for name, fit in plan["budgets"][0]["fits"].items():
        S = fit.sink_tokens
        assert fit.bytes == real_bytes(name, S, fit.capacity, geo) <= limit, name
        assert fit.next_bytes == real_bytes(name, S, fit.capacity + fit.step, geo) > limit, name
        assert fit.step == (1 if stream.WINDOWED[name][0].family == "bf16" else 64)
        assert fit.recent_tokens % fit.step == 0


def test_the_search_builds_no_cache(monkeypatch):
    """Sized from the storage's allocation on the meta device: no real cache, however large the budget."""
    def refuse(*a, **k):
        raise AssertionError("a real cache was built")
    monkeypatch.setattr(footprint, "SinkQuantCache", refuse)
    plan = stream.plan_memory(SMOLLM, memory.parse_memory_of("bf16:100000"), 4, 10**7)
    assert plan["budgets"][0]["fits"]["sinks + int4"].capacity > 300_000


def test_rows_compare_over_the_same_positions(monkeypatch):
    """Every row's after_fill is over positions >= the largest capacity of the run, whatever its own."""
    T = 1200
    nll = torch.linspace(0.5, 3.0, T - 1)  # the same per-token losses for every row: only the region differs
    monkeypatch.setattr(stream, "_nll", lambda *a, **k: nll.clone())
    cfg = types.SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64, hidden_size=576,
                                num_attention_heads=9)
    cfg.get_text_config = lambda decoder=True: cfg
    model = types.SimpleNamespace(config=cfg, dtype=torch.float32)
    plan = stream.plan_memory(SMOLLM, memory.parse_memory_of("bf16:128,256"), 4, T)
    r = stream.run_memory(model, torch.zeros(1, T, dtype=torch.long), plan, window=64)
    caps = [o["capacity"] for b in r["budgets"] for o in b["rows"]]
    assert r["after_fill_from"] == max(caps) and len(set(caps)) > 2
    want = nll[max(caps):].mean().exp().item()
    for b in r["budgets"]:
        for o in b["rows"]:
            assert o["after_fill"] == pytest.approx(want, rel=1e-6), o["config"]
            assert o["ppl"] == pytest.approx(nll.mean().exp().item(), rel=1e-6)
    assert r["full"]["after_fill"] == pytest.approx(want, rel=1e-6)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, default_model):
    out = tmp_path_factory.mktemp("memory-of")
    # bf16:128 on the default model: int4 holds 196 tokens, so 200 tokens leave 3 predictions after fill
    assert cli.main(["stream", "--tokens", "200", "--memory-of", "bf16:128", "--positions", "absolute",
                     "--window", "64", "--out", str(out), "--quiet"]) == 0
    return out, json.loads((out / "results.json").read_text())["stream"]


def test_memory_of_on_the_model(small_run):
    out, r = small_run
    assert (out / "stream.png").stat().st_size > 0 and not (out / "stream-memory.png").exists()  # one budget
    b, = r["budgets"]
    assert b["bytes"] == 128 * SMOLLM.bf16_bytes_per_token
    rows = {o["config"]: o for o in b["rows"]}
    assert list(rows) == list(stream.WINDOWED)
    assert {n: o["capacity"] for n, o in rows.items()} == {"window, no sinks": 128, "sinks + bf16 window": 128,
                                                           "sinks + int8": 68, "sinks + int4": 196}
    for o in rows.values():
        assert o["bytes"] == o["memory"]["bytes"] <= b["bytes"] < o["next_step_bytes"]
    assert r["after_fill_from"] == 196
    assert rows["sinks + bf16 window"]["gap_closed"] == 0.0
    assert rows["window, no sinks"]["after_fill"] > rows["sinks + bf16 window"]["after_fill"]
    md = (out / "report.md").read_text()
    assert "after fill (position >= 196), absolute" in md and "allocated bytes" in md and "ideal bytes" in md


@pytest.mark.parametrize("value,message", [
    ("fp8:256", "unknown dtype 'fp8'"),
    ("bf16:0", "a budget must be >= 1 token, got 0"),
    ("bf16:-256", "a budget must be >= 1 token, got -256"),
    ("bf16", "expected DTYPE:N[,N...]"),
    ("bf16:256,x", "'x' is not a whole number of tokens"),
    (":256", "expected DTYPE:N[,N...]"),
])
def test_bad_memory_of_exits_2_naming_the_flag(value, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("run() reached: the model would be loaded"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        cli.main(["stream", "--memory-of", value, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --memory-of" in err and message in err
    assert not out.exists()


@pytest.mark.parametrize("argv,message", [
    # int8's smallest cache (4 sinks + one quantized block + the bf16 filling block) is ~102 bf16 tokens
    (["--memory-of", "bf16:64"], "less than the smallest cache of 'sinks + int8'"),
    # 4 sinks + 1 recent token are more than 4 bf16 tokens whatever the model: refused before it loads
    (["--memory-of", "bf16:4"], "--sink-tokens 4: a cache with 4 sinks and one recent token is larger than "
                                "--memory-of bf16:4"),
    (["--memory-of", "bf16:512", "--tokens", "1000"], "must be at least"),
])
@pytest.mark.model  # refused once the model's geometry is known
def test_a_budget_no_cache_fits_exits_2_writing_nothing(argv, message, tmp_path, capsys, monkeypatch):
    from qsinkkv.eval import replay

    monkeypatch.setattr(replay, "token_logprobs", lambda *a, **k: pytest.fail("a replay ran"))
    out = tmp_path / "out"
    assert cli.main(["stream", *argv, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--memory-of" in err and message in err
    assert not out.exists()
