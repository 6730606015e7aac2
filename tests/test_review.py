"""From a review of the per-sequence-lengths work (issue 10): probes of the write/rollback path,
ragged prefill/decode, select_batch/reset/crop, the decode workspace and layout memo, and the
transformers integration.

``test_regression_*`` failed on the reviewed code and pin the three defects it found (now fixed);
the other tests pin behaviour the rest of the suite did not check directly.
"""
import pytest
import torch
from test_ragged import rel, visible_rows

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.decode import decode_attention_reference

HKV, G, D = 2, 2, 8


def draw(g, B, T, dtype=torch.float32):
    return tuple(torch.randn(B, h, T, D, generator=g).to(dtype) for h in (HKV * G, HKV, HKV))


def assert_same_visible(a, b):
    """Every layer, every row: the same visible (positions, k, v), bit for bit."""
    assert torch.equal(a.seq_lens(), b.seq_lens()) and a.layer_lengths() == b.layer_lengths()
    for layer in range(a.num_layers):
        for row, (x, y) in enumerate(zip(visible_rows(a, layer), visible_rows(b, layer))):
            assert all(torch.equal(s, t) for s, t in zip(x, y)), f"layer {layer}, sequence {row}"


def feed(caches, layers, q, k, v, lens=None):
    for layer in range(layers):
        for c in caches:
            c.attend(layer, q, k, v, lens)


# ==================================================================================================
# Regression 1 (fixed). write._append_one_token: a ragged decode step (rows at different lengths, one indexed write)
# with block_size=1 and a window that is wholly unquantized (bits=16, or residual_tokens ==
# recent_tokens) writes the new token into the float-ring row that holds the oldest token the
# shorter stream still sees (the ring then has exactly W rows), but saves that row in the Undo
# record only for rows that complete a *visible* block, which never happens with this layout. A
# step refused in a later layer then "rolls back" layer 0 to a state whose oldest visible token
# holds the refused step's K/V. (The uniform path, write._plan/_commit, saves those rows:
# `p.m1 - F > p.q0 * bs`.) A decode step right after the rollback evicts that token, but a legal
# crop brings it back into view: here a row at exactly the capacity (m == W, which crop_refusal
# allows to shorten) reads the refused step's key/value as its oldest recent token.
# ==================================================================================================

@pytest.mark.parametrize("cfg", [
    CacheConfig(sink_tokens=1, recent_tokens=3, bits=16, block_size=1),
    CacheConfig(sink_tokens=1, recent_tokens=3, bits=8, block_size=1, residual_tokens=3, value_group_size=4),
], ids=["bits16", "int8-residual=W"])
def test_regression_refused_ragged_decode_step_rolls_back_with_block_size_1(cfg):
    g = torch.Generator().manual_seed(0)
    a, twin = (SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32) for _ in range(2))
    feed((a, twin), 2, *draw(g, 2, 6), [4, 6])          # row 0 exactly at the capacity 4, row 1 past it
    q, k, v = draw(g, 2, 1)
    a.attend(0, q, k, v)                                # layer 0 takes the decode step (ragged write)
    bad = k.clone()
    bad[1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="k contains NaN"):
        a.attend(1, q, bad, v)                          # layer 1 refuses it: layer 0 must roll back
    assert a.in_step() and torch.equal(a.seq_lens(), twin.seq_lens())
    for c in (a, twin):
        c.crop([1, 0])                                  # allowed: row 0 holds 4 tokens, none evicted
    for layer in range(2):                              # row 0's query now sees its position-1 token again
        q, k, v = draw(g, 2, 1)
        out, ref = a.attend(layer, q, k, v), twin.attend(layer, q, k, v)
        assert torch.equal(out, ref), f"layer {layer}: max |diff| {(out - ref).abs().max().item():.3g}"
    assert_same_visible(a, twin)


# ==================================================================================================
# Regression 2 (fixed). prefill.prefill_attention_reference: padding keys are masked from the scores, but the
# padding *values* still enter `probs @ v` (inside sink_window_attention), so a NaN/Inf value in a
# row's padding (which the cache deliberately accepts: it is "never stored or seen") turns every
# real query of that row into NaN (0 * NaN = NaN). The row alone gives finite outputs.
# ==================================================================================================

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_regression_nonfinite_value_in_padding_poisons_the_rows_prefill(value):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    batch = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32)
    alone = SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    q, k, v = draw(g, 2, 4)
    v[1, :, 3] = value                                  # row 1 holds 2 tokens: slot 3 is padding
    out = batch.attend(0, q, k, v, [4, 2])              # accepted (padding is not checked), but:
    own = alone.attend(0, q[1:, :, :2], k[1:, :, :2], v[1:, :, :2])
    assert torch.isfinite(out).all()
    assert rel(out[1:, :, :2], own) < 1e-5


# ==================================================================================================
# Regression 3 (fixed). integrations/transformers.py QSinkKVCache.get_seq_length: it returns the longest row's
# stored tokens, which is the batch's width only when some row has no padding. transformers reads it
# as the number of columns already cached (generate's initial cache_position, DynamicCache.crop's
# max_length). With every row padded (e.g. padding="max_length"), continuing a generation with the
# same cache re-feeds the last (min padding) columns, storing those tokens a second time: the rows'
# lengths and tokens differ from one uninterrupted generate (a DynamicCache gives equal tokens).
# ==================================================================================================

@pytest.fixture(scope="module")
def lm64():
    from qsinkkv.hf import QSinkKVCache  # noqa: F401  (registers attn_implementation="qsinkkv")
    from qsinkkv.models import load_model
    model, tok = load_model(dtype=torch.float64)
    model.set_attn_implementation("qsinkkv")
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


PROMPTS = ["Once upon a time there was", "The capital of France is Paris and the capital of Italy is"]
HF_CFG = CacheConfig(sink_tokens=4, recent_tokens=12, bits=4, block_size=4, value_group_size=32)


def test_regression_continuing_generate_when_every_row_is_padded(lm64):
    from qsinkkv.hf import QSinkKVCache
    model, tok = lm64
    cfg = CacheConfig(sink_tokens=4, recent_tokens=12, bits=16, block_size=4)
    batch = tok(PROMPTS, return_tensors="pt", padding="max_length", max_length=16)  # both rows padded
    with torch.no_grad():
        whole = model.generate(**batch, cache=QSinkKVCache(cfg, model.config), max_new_tokens=8, do_sample=False)
        cache = QSinkKVCache(cfg, model.config)
        half = model.generate(**batch, cache=cache, max_new_tokens=4, do_sample=False)
        width = cache.get_seq_length()                  # transformers reads this as the columns cached
        mask = torch.cat((batch.attention_mask, torch.ones(2, 4, dtype=torch.long)), dim=1)
        rest = model.generate(half, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
    assert rest[:, -4:].tolist() == whole[:, -4:].tolist()                     # the continued tokens
    assert cache.inner.seq_lens().tolist() == (batch.attention_mask.sum(1) + 7).tolist()  # nothing stored twice
    assert width == half.shape[1] - 1, "get_seq_length() is not the batch's width"


# ==================================================================================================
# Coverage: probes that found no defect.
# ==================================================================================================

def test_refused_ragged_step_after_block_completion_with_residual():
    """Rows at different lengths in one decode step: one completes a block whose first token sits in
    the float row the new token overwrites (residual 1, block 2: the Undo's float-row save), one does
    not, one is still filling its sinks; the last layer refuses; every layer equals a twin, then and
    after more steps."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(7)
    a, twin = (SinkQuantCache(cfg, 3, 3, HKV, D, dtype=torch.float32) for _ in range(2))
    feed((a, twin), 3, *draw(g, 3, 10), [5, 6, 0])      # recent r = 4 (completes a block), 5, and a sink row
    for _ in range(6):
        q, k, v = draw(g, 3, 1)
        for layer in range(2):
            a.attend(layer, q, k, v)
        bad = k.clone()
        bad[2, 1, 0, 3] = float("nan")
        with pytest.raises(ValueError):
            a.attend(2, q, bad, v)
        assert_same_visible(a, twin)
        feed((a, twin), 3, q, k, v)                     # the step, accepted this time, on both
        assert_same_visible(a, twin)


def test_select_batch_with_repeats_then_ragged_steps():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=7, bits=4, block_size=3, value_group_size=4, residual_tokens=2)
    g = torch.Generator().manual_seed(2)
    batch = SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32)
    rows = [SinkQuantCache(cfg, 2, 1, HKV, D, dtype=torch.float32) for _ in range(3)]
    q, k, v = draw(g, 2, 9)
    for layer in range(2):
        batch.attend(layer, q, k, v, [9, 4])
        for r, (b, t) in zip(rows, [(1, 4), (0, 9), (1, 4)]):
            r.attend(layer, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
    batch.select_batch([1, 0, 1])                       # row 1 twice
    for step in range(18):
        T = 1 if step % 3 else 3
        q, k, v = draw(g, 3, T)
        lens = [T, 1, 0] if T > 1 else None
        for layer in range(2):
            out = batch.attend(layer, q, k, v, lens)
            for b in range(3):
                t = T if lens is None else lens[b]
                if t:
                    own = rows[b].attend(layer, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
                    assert rel(out[b:b + 1, :, :t], own) < 1e-5, (step, layer, b)


def test_reset_row_then_ragged_decode():
    cfg = CacheConfig(sink_tokens=3, recent_tokens=5, bits=8, block_size=2, value_group_size=4)
    g = torch.Generator().manual_seed(3)
    batch = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    batch.attend(0, *draw(g, 3, 12), [12, 7, 10])
    batch.reset([1])
    alone = SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32)
    for step in range(12):                              # row 1 goes through its sinks, the others wrap
        q, k, v = draw(g, 3, 1)
        out = batch.attend(0, q, k, v)
        own = alone.attend(0, q[1:2], k[1:2], v[1:2])
        assert rel(out[1:2], own) < 1e-5, step


def test_two_caches_alternate_decode_workspace_and_memo():
    """decode.py's module-level workspace and each layout's visible_bias memo, with caches of equal
    shapes and lengths but different configs called in turn: each equals the dequantizing reference."""
    g = torch.Generator().manual_seed(4)
    cfgs = [CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4),
            CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=2),
            CacheConfig(sink_tokens=3, recent_tokens=5, bits=4, block_size=2, value_group_size=4),
            CacheConfig(sink_tokens=1, recent_tokens=9, bits=8, block_size=2, value_group_size=4)]
    caches = [SinkQuantCache(c, 1, 2, HKV, D, dtype=torch.float32, backend="torch") for c in cfgs]
    for step in range(16):
        for c in caches:
            q, k, v = draw(g, 2, 1)
            out = c.attend(0, q, k, v)
            ref = decode_attention_reference(q[:, :, 0], c.layers[0]).unsqueeze(2)
            assert rel(out, ref) < 1e-5, (step, c.config)


def test_float64_ragged_rows_equal_each_row_alone():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(5)
    batch = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float64)
    alone = [SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float64) for _ in range(2)]
    for step in range(15):
        T, lens = (5, [5, 3]) if step == 0 else (1, None)
        q, k, v = draw(g, 2, T, torch.float64)
        out = batch.attend(0, q, k, v, lens)
        assert out.dtype == torch.float64
        for b in range(2):
            t = T if lens is None else lens[b]
            own = alone[b].attend(0, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
            assert rel(out[b:b + 1, :, :t], own) < 1e-12, (step, b)


@pytest.mark.parametrize("variant", ["dequantize", "folded"])
def test_triton_ragged_decode_with_an_empty_row(variant):
    """The decode kernel (Triton interpreter on the CPU) on ragged rows, one of them empty and idle,
    and chunks with a one-token row: equal to the torch backend."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=5, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(6)
    tri = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32, backend="triton", decode_variant=variant)
    ref = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32, backend="torch")
    for T, lens in [(4, [4, 1, 0]), (1, [1, 1, 0]), (3, [3, 1, 0]), (1, [1, 0, 0]), (1, [1, 1, 0]), (1, [1, 1, 0])]:
        q, k, v = draw(g, 3, T)
        a, b = tri.attend(0, q, k, v, lens), ref.attend(0, q, k, v, lens)
        assert torch.isfinite(a).all() and rel(a, b) < 1e-5, (T, lens)


def test_left_padded_beam_search_equals_each_prompt_alone(lm64):
    """num_beams=2 over a left-padded batch, past the capacity (16) with int4 blocks: each row's
    sequence and beam score equal its prompt run alone (model in float64)."""
    from qsinkkv.hf import QSinkKVCache
    model, tok = lm64
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, num_beams=2, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(**batch, cache=QSinkKVCache(HF_CFG, model.config), **kw)
        for i, p in enumerate(PROMPTS):
            ids = tok(p, return_tensors="pt").input_ids
            own = model.generate(ids, cache=QSinkKVCache(HF_CFG, model.config), **kw)
            assert out.sequences[i, -12:].tolist() == own.sequences[0, -12:].tolist(), i
            torch.testing.assert_close(out.sequences_scores[i], own.sequences_scores[0], rtol=1e-6, atol=1e-6)
