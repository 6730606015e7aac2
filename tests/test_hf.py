"""The transformers integration (qsinkkv/integrations/transformers.py, ``qsinkkv.hf``) on the real default model
(SmolLM2-135M-Instruct, float32 and float64, CPU), one model load for the file."""
import copy
import os
import pydoc_data.topics
from pathlib import Path

import pytest
import torch
from oracle import attention_oracle
from transformers import AttentionInterface, DynamicCache
from transformers.configuration_utils import PretrainedConfig

from qsinkkv import CacheConfig, sink_window_attention
from qsinkkv.hf import QSinkKVCache, rotary_from_config

F32 = dict(sink_dtype=torch.float32, window_dtype=torch.float32)  # lossless storage for exactness tests


MODEL_ATTN = None  # conftest.py's model_tok: load_model(dtype=float32), transformers' default attention


@pytest.fixture(scope="module")
def lm(model_tok):
    """The model, its tokenizer and 20000 characters of pydoc's topics as token ids."""
    model, tok = model_tok
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text[:20000], return_tensors="pt").input_ids
    return model, tok, ids


def use(model, impl):
    model.set_attn_implementation(impl)
    return model


def stream_logits(model, ids, cache, prefill=8):
    """Teacher-forced: a prefill chunk, then one token per forward."""
    out = [model(ids[:, :prefill], cache=cache, use_cache=True).logits]
    for i in range(prefill, ids.shape[1]):
        out.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


# --- references -----------------------------------------------------------------------------------

S, W = 4, 28  # capacity 32: the streams below run past 3x the capacity


def dense_sink_window(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One dense forward of the whole sequence under the sink + window mask (no cache)."""
    pos = torch.arange(query.shape[2])
    out = sink_window_attention(query, key, value, pos, pos, sink_tokens=S, recent_tokens=W, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def streaming_llm_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """StreamingLLM by definition: with a DynamicCache holding the whole history, undo the model's
    RoPE and re-rotate every query and key by its index among the query's visible tokens (float64)."""
    rot = rotary_from_config(module.config)
    n, T = key.shape[2], query.shape[2]
    k_pre = rot.rotate(key.double(), -torch.arange(n), scaled=False)
    q_pre = rot.rotate(query.double(), -torch.arange(n - T, n), scaled=False)
    out = attention_oracle(q_pre, lambda i: (k_pre, value.double()), S, W, range(n - T, n), rotary=rot, scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_dense_sink_window", dense_sink_window)
AttentionInterface.register("test_streaming_llm", streaming_llm_reference)


# --- exactness (bits=16, lossless storage) --------------------------------------------------------

@pytest.mark.parametrize("impl,prefill", [("qsinkkv", 8), ("qsinkkv", 50), ("sdpa", 8)])
def test_absolute_stream_matches_dense_masked_forward(lm, impl, prefill):
    model, _, ids = lm
    ids = ids[:, :100]
    with torch.no_grad():
        ref = use(model, "test_dense_sink_window")(ids, use_cache=False).logits
        cache = QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=16, **F32), model)
        got = stream_logits(use(model, impl), ids, cache, prefill=prefill)
    assert cache.get_seq_length() == 100
    assert (got - ref).abs().max().item() <= 1e-3


def test_cache_index_matches_streaming_llm(lm):
    model, _, ids = lm
    ids = ids[:, :100]
    with torch.no_grad():
        ref = stream_logits(use(model, "test_streaming_llm"), ids, DynamicCache(config=model.config))
        cache = QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=16, positions="cache_index", **F32),
                             model.config)
        got = stream_logits(use(model, "qsinkkv"), ids, cache)
        absolute = stream_logits(model, ids, QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=16, **F32),
                                                          model.config))
    assert (got - ref).abs().max().item() <= 1e-3
    # the contract matters: past the capacity, absolute positions give different logits
    assert (absolute[:, 40:] - ref[:, 40:]).abs().max().item() > 1e-2


# --- quantized: generation past the capacity, constant memory, bounded error --------------------

# Max |logit| difference vs bits=16 over a 100-token teacher-forced stream (capacity 32,
# block 16, value group 32, default bf16 storage). Measured 0.14 (int8) and 2.16 (int4) on
# 2026-11-30; the bounds leave ~2.5x headroom.
LOGIT_BOUND = {8: 0.4, 4: 5.0}


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_generate_and_memory(lm, bits):
    model, tok, ids = lm
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=16, value_group_size=32)
    cache = QSinkKVCache(cfg, model.config)
    prompt = ids[:, :10]
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, max_new_tokens=2 * cfg.capacity - 10, do_sample=False)
        at_2x = cache.nbytes()
        out = model.generate(out, cache=cache, max_new_tokens=2 * cfg.capacity, do_sample=False)
    assert out.shape[1] == 4 * cfg.capacity and cache.get_seq_length() >= 4 * cfg.capacity - 1
    assert cache.nbytes() == at_2x > 0
    with torch.no_grad():
        q = stream_logits(model, ids[:, :100], QSinkKVCache(cfg, model.config))
        ref = stream_logits(model, ids[:, :100], QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=16),
                                                              model.config))
    assert 0 < (q - ref).abs().max().item() <= LOGIT_BOUND[bits]


def test_sinks_lower_perplexity_past_the_window(lm):
    """A real property of the model: evicting the first tokens hurts once the window slides."""
    model, _, ids = lm
    ids = ids[:, :400]
    use(model, "qsinkkv")
    ppl = {}
    with torch.no_grad():
        for sinks in (0, 4):
            cache = QSinkKVCache(CacheConfig(sink_tokens=sinks, recent_tokens=64 - sinks, bits=16), model.config)
            logits = model(ids, cache=cache, use_cache=True).logits  # one chunk: exact sink + window mask
            nll = torch.nn.functional.cross_entropy(logits[0, 64:-1], ids[0, 65:])
            ppl[sinks] = nll.exp().item()
    assert ppl[4] < 0.8 * ppl[0], ppl


def test_batch_of_equal_lengths_and_beam_search(lm):
    model, _, ids = lm
    use(model, "qsinkkv")
    prompts = torch.stack([ids[0, :12], ids[0, 40:52]])
    cfg = CacheConfig(sink_tokens=4, recent_tokens=60, bits=16, **F32)
    with torch.no_grad():
        both = model.generate(prompts, cache=QSinkKVCache(cfg, model.config), max_new_tokens=10, do_sample=False)
        for b in range(2):
            alone = model.generate(prompts[b:b + 1], cache=QSinkKVCache(cfg, model.config), max_new_tokens=10,
                                   do_sample=False)
            assert torch.equal(both[b], alone[0])
        # beam search reorders the cache; within the capacity it matches a DynamicCache
        beams = model.generate(prompts[:1], cache=QSinkKVCache(cfg, model.config), max_new_tokens=8, num_beams=3,
                               do_sample=False)
        ref = model.generate(prompts[:1], max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(beams, ref)


def test_crop_within_the_window(lm):
    model, _, ids = lm
    use(model, "qsinkkv")
    cache = QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=4, block_size=8, value_group_size=32),
                         model.config)
    with torch.no_grad():
        model(ids[:, :45], cache=cache, use_cache=True)
        before = model(ids[:, 45:46], cache=cache, use_cache=True).logits
        cache.crop(-1)                                     # the newest token sits in the filling block
        assert cache.get_seq_length() == 45
        again = model(ids[:, 45:46], cache=cache, use_cache=True).logits
        assert torch.equal(before, again)
        snapshot = [t.clone() for t in cache.inner.layers[0].tensors().values()]
        with pytest.raises(ValueError, match="already quantized|evicted"):
            cache.crop(-20)                                # past the retained window
        assert cache.get_seq_length() == 46
        assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.inner.layers[0].tensors().values()))


# --- bad use ---------------------------------------------------------------------------------------

def _left_padded(tok, prompts):
    """generate's own batch: pad on the left, the mask marks the real tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.eos_token_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask


@pytest.fixture(scope="module")
def lm64(lm):
    """The model in float64: a batch and a single prompt then give K/V equal to ~1e-16, so the int4
    codes of a row are bit-identical to its codes alone (in float32, batched matmuls round differently
    from batch-1 ones, and ~1 int4 code in 10^5 flips: the greedy tokens then part at a near-tie)."""
    model, tok, ids = lm
    return copy.deepcopy(model).double(), tok, ids


@pytest.fixture(scope="module")
def lm64_left(lm64):
    """The float64 model with a tokenizer of its own that pads on the left (as generate's batches are)."""
    model, tok, _ = lm64
    model.set_attn_implementation("qsinkkv")
    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok

@pytest.mark.parametrize("positions", ["absolute", "cache_index"])
@pytest.mark.parametrize("bits", [16, 4])
def test_left_padded_batch_equals_each_prompt_alone(lm, lm64, bits, positions):
    """Prompts of different lengths, left-padded, streamed past the capacity (S + W = 32): every row
    gives the greedy tokens of its prompt run alone, and logits within 1e-4 (bits=16 on a float32
    cache, float32 model) or 1e-6 (int4 with bf16 sinks and window, float64 model)."""
    model, tok, ids = lm if bits == 16 else lm64
    use(model, "qsinkkv")
    store = F32 if bits == 16 else {}
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=4, value_group_size=32,
                      positions=positions, **store)
    prompts = [ids[0, 100:105], ids[0, 200:219], ids[0, 300:311]]
    batch, mask = _left_padded(tok, prompts)
    run = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        got = model.generate(batch, attention_mask=mask, cache=QSinkKVCache(cfg, model.config), **run)
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], cache=QSinkKVCache(cfg, model.config), **run)
            assert torch.equal(got.sequences[b, batch.shape[1]:], alone.sequences[0, len(p):]), f"row {b}"
            diff = max((x[b] - y[0]).abs().max().item() for x, y in zip(got.logits, alone.logits))
            assert diff < (1e-4 if bits == 16 else 1e-6), f"row {b}: {diff:.2e}"


def test_right_padded_chunk_and_idle_rows(lm64):
    """A mask with pads at the end of a row, and a row with no real token: only the real tokens are
    stored, each row at its own positions, and each row's logits are its own."""
    model, tok, ids = lm64
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=4, block_size=4, value_group_size=32)
    a, b = ids[:, :9], ids[:, 40:46]
    pad = torch.full((1, 3), tok.eos_token_id)
    batch = torch.cat((a, torch.cat((b, pad), dim=1), torch.full((1, 9), tok.eos_token_id)))
    mask = torch.ones_like(batch)
    mask[1, 6:] = 0
    mask[2] = 0
    cache = QSinkKVCache(cfg, model.config)
    with torch.no_grad():
        out = model(batch, attention_mask=mask, cache=cache, use_cache=True).logits
        ref_a = model(a, cache=QSinkKVCache(cfg, model.config), use_cache=True).logits
        ref_b = model(b, cache=QSinkKVCache(cfg, model.config), use_cache=True).logits
    assert cache.inner.seq_lens().tolist() == [9, 6, 0]
    assert (out[0] - ref_a[0]).abs().max() < 1e-9
    assert (out[1, :6] - ref_b[0]).abs().max() < 1e-9


def test_portable_mode_limits(lm):
    model, _, ids = lm
    use(model, "sdpa")
    small = CacheConfig(sink_tokens=2, recent_tokens=14, bits=16)
    with pytest.raises(ValueError, match="exceeds the capacity 16 in the portable mode"):
        model(ids[:, :20], cache=QSinkKVCache(small, model.config), use_cache=True)
    with pytest.raises(ValueError, match="portable mode takes batch size 1"):
        model(ids[:, :4].repeat(2, 1), cache=QSinkKVCache(small, model.config), use_cache=True)
    with pytest.raises(ValueError, match="positions='cache_index' needs attn_implementation='qsinkkv'"):
        model(ids[:, :4], cache=QSinkKVCache(CacheConfig(sink_tokens=2, recent_tokens=14, bits=16,
                                                         positions="cache_index"), model.config), use_cache=True)


def test_bad_model_config(lm):
    model, _, _ = lm
    with pytest.raises(ValueError, match=r"lacks \['num_hidden_layers'"):
        QSinkKVCache(CacheConfig(), PretrainedConfig())
    with pytest.raises(TypeError, match="model_config must be a transformers PretrainedConfig"):
        QSinkKVCache(CacheConfig(), {"num_hidden_layers": 2})
    with pytest.raises(TypeError, match="config must be a qsinkkv CacheConfig"):
        QSinkKVCache(model.config, model.config)
    dynamic = copy.deepcopy(model.config)
    dynamic.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100000.0}
    with pytest.raises(ValueError, match="rope_type='dynamic' changes its frequencies"):
        QSinkKVCache(CacheConfig(positions="cache_index"), dynamic)
    sliding = copy.deepcopy(model.config)
    sliding.layer_types = ["sliding_attention"] * sliding.num_hidden_layers
    with pytest.raises(ValueError, match="llama model has sliding_attention layers but sliding_window=None"):
        QSinkKVCache(CacheConfig(), sliding)  # (window layers are served, each keeping its window: which?)


# --- refusals that leave the layers in step; crop and reset as transformers does -------------

def test_portable_mode_refuses_a_left_padded_prompt(lm):
    """Pads would become sinks once the stream passes the capacity (a silent wrong answer before)."""
    model, tok, _ = lm
    use(model, "sdpa")
    ids = tok("Hi there, my name is", return_tensors="pt").input_ids
    prompt = torch.cat((torch.full((1, 3), tok.eos_token_id), ids), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)), dim=1)
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=8, bits=16), model.config)
    with pytest.raises(ValueError, match="left-padded prompt"):
        model.generate(prompt, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("pad_id", ["eos", 1234])
def test_portable_mode_refuses_a_padded_mask_without_position_ids(lm, pad_id):
    """A left-padded prompt fed by hand (no position_ids: the model numbers the columns, as the
    cache does) with its mask: the pads would become sinks past the capacity, the logits moving with the
    pad id. Refused at the prompt, nothing stored; the same run unpadded streams past the capacity."""
    model, tok, ids = lm
    use(model, "sdpa")
    pad = tok.eos_token_id if pad_id == "eos" else pad_id
    cfg = CacheConfig(sink_tokens=4, recent_tokens=12, bits=16)
    prompt = torch.cat((torch.full((1, 3), pad), ids[:, :9]), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)), dim=1)
    cache = QSinkKVCache(cfg, model)
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask has pads"):
        model(prompt, attention_mask=mask, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.inner.layer_lengths() == [0] * model.config.num_hidden_layers
    with torch.no_grad():  # an all-ones mask is no padding: the stream goes on past the capacity (16)
        mask = torch.ones(1, 9, dtype=torch.long)
        model(ids[:, :9], attention_mask=mask, cache=cache, use_cache=True)
        for i in range(9, 30):
            mask = torch.cat((mask, torch.ones(1, 1, dtype=torch.long)), dim=1)
            model(ids[:, i:i + 1], attention_mask=mask, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 30


def test_portable_mode_built_from_the_config_stops_at_the_capacity(lm):
    """Built with model.config the cache cannot see the masks, so it cannot rule out pads: within the
    capacity it runs (the model's own mask is exact there), past it the step is refused in layer 0."""
    model, _, ids = lm
    use(model, "sdpa")
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=12, bits=16), model.config)
    with torch.no_grad():
        model(ids[:, :16], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"QSinkKVCache\(config, model\)"):
            model(ids[:, 16:17], cache=cache, use_cache=True)
    assert cache.get_seq_length() == 16 and cache.inner.layer_lengths() == [16] * model.config.num_hidden_layers


def test_pool_backed_cache_refuses_beam_search_by_name(lm):
    """Generate(num_beams=2) over a pool-backed cache gets the README's message, not a shape error."""
    from qsinkkv.paged import PagedCache
    model, _, ids = lm
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=12, bits=16)
    text = model.config
    pool = PagedCache(cfg, text.num_hidden_layers, text.num_key_value_heads, 64, max_seqs=2, float_blocks=4,
                      quant_blocks=4, dtype=torch.float32)
    pool.admit()
    cache = QSinkKVCache(cfg, model, pool=pool)
    with torch.no_grad(), pytest.raises(ValueError, match="cannot repeat sequences.*without pool="):
        model.generate(ids[:, :6], cache=cache, num_beams=2, max_new_tokens=3, do_sample=False)
    assert pool.seq_lens().tolist() == [0]


@pytest.mark.parametrize("rope", [None, {}, {"rope_type": "default"}])
def test_cache_index_without_rope_theta_names_it(lm, rope):
    """Rope_parameters with no rope_theta: a KeyError before."""
    model, _, _ = lm
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = rope
    if hasattr(cfg, "rope_theta"):
        del cfg.rope_theta
    with pytest.raises(ValueError, match="rope_theta"):
        QSinkKVCache(CacheConfig(positions="cache_index"), cfg)


def _blow_up_keys(factor):
    def hook(module, args, out):
        return out * factor
    return hook


@pytest.mark.parametrize("impl", ["qsinkkv", "sdpa"])
@pytest.mark.parametrize("factor", [1e5, float("nan")], ids=["scale-overflow", "nan"])
def test_refusal_in_layer_5_rolls_back_the_step(lm, impl, factor):
    """Layer 5's keys overflow the fp16 scale (or are NaN) for one decode step: layers 0-4 had already
    stored the token. After the refusal every layer holds the same stream, and the cache goes on exactly
    as one that never saw the step."""
    model, _, ids = lm
    use(model, impl)
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=1, value_group_size=32)
    cache, twin = QSinkKVCache(cfg, model), QSinkKVCache(cfg, model)
    with torch.no_grad():
        for c in (cache, twin):
            model(ids[:, :8], cache=c, use_cache=True)
        handle = model.model.layers[5].self_attn.k_proj.register_forward_hook(_blow_up_keys(factor))
        try:
            with pytest.raises(ValueError, match="scale_dtype|NaN"):
                model(ids[:, 8:9], cache=cache, use_cache=True)
        finally:
            handle.remove()
        assert cache.inner.layer_lengths() == [8] * model.config.num_hidden_layers
        for i in range(8, 12):
            a = model(ids[:, i:i + 1], cache=cache, use_cache=True).logits
            b = model(ids[:, i:i + 1], cache=twin, use_cache=True).logits
            assert torch.equal(a, b)


class _Interrupt(Exception):
    pass


def test_forward_interrupted_between_layers_is_refused_until_crop(lm):
    """An error outside the cache (here in layer 5's MLP) stops a forward after layers 0-5 stored the
    token: the next forward must not run on layers out of step."""
    model, _, ids = lm
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=8, value_group_size=32)
    cache, twin = QSinkKVCache(cfg, model.config), QSinkKVCache(cfg, model.config)

    def interrupt(module, args):
        raise _Interrupt()

    with torch.no_grad():
        for c in (cache, twin):
            model(ids[:, :10], cache=c, use_cache=True)
        handle = model.model.layers[5].mlp.register_forward_pre_hook(interrupt)
        try:
            with pytest.raises(_Interrupt):
                model(ids[:, 10:11], cache=cache, use_cache=True)
        finally:
            handle.remove()
        with pytest.raises(RuntimeError, match=r"out of step .*cache.crop\(10\) or cache.reset\(\)"):
            model(ids[:, 10:11], cache=cache, use_cache=True)
        cache.crop(10)
        a = model(ids[:, 10:11], cache=cache, use_cache=True).logits
        b = model(ids[:, 10:11], cache=twin, use_cache=True).logits
        assert torch.equal(a, b)


def test_crop_follows_transformers(lm):
    model, _, ids = lm
    use(model, "qsinkkv")
    cache = QSinkKVCache(CacheConfig(sink_tokens=S, recent_tokens=W, bits=4, block_size=8, value_group_size=32),
                         model.config)
    with torch.no_grad():
        model(ids[:, :13], cache=cache, use_cache=True)
    for bad in (True, 2.5, "3", None):
        with pytest.raises(ValueError, match="max_length must be an int"):
            cache.crop(bad)
    with pytest.raises(ValueError, match="cannot remove 14 tokens from a cache of 13 tokens"):
        cache.crop(-14)
    cache.crop(13 + 5)  # longer than the cache: nothing to do, as DynamicCache
    assert cache.get_seq_length() == 13
    cache.crop(12)
    assert cache.get_seq_length() == 12


def test_reset_takes_a_new_batch_size(lm):
    model, _, ids = lm
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=12, bits=8, block_size=4, value_group_size=32)
    cache = QSinkKVCache(cfg, model.config)
    prompts = torch.stack([ids[0, :6], ids[0, 30:36]])
    with torch.no_grad():
        model.generate(prompts[:1], cache=cache, max_new_tokens=3, do_sample=False)
        cache.reset()
        got = model.generate(prompts, cache=cache, max_new_tokens=20, do_sample=False)
        ref = model.generate(prompts, cache=QSinkKVCache(cfg, model.config), max_new_tokens=20, do_sample=False)
    assert torch.equal(got, ref)


# --- padded batches in float64 (from the review of the per-sequence-lengths work) -----------------

PROMPTS = ["Once upon a time there was", "The capital of France is Paris and the capital of Italy is"]
HF_CFG = CacheConfig(sink_tokens=4, recent_tokens=12, bits=4, block_size=4, value_group_size=32)


# A defect the review found, now fixed: QSinkKVCache.get_seq_length returned the longest row's stored tokens,
# which is the batch's width only when some row has no padding; transformers reads it as the columns already
# cached. With every row padded (padding="max_length"), continuing a generation with the same cache re-fed the
# last columns, storing those tokens a second time.
def test_continuing_generate_when_every_row_is_padded(lm64_left):
    from qsinkkv.hf import QSinkKVCache
    model, tok = lm64_left
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


def test_left_padded_beam_search_equals_each_prompt_alone(lm64_left):
    """num_beams=2 over a left-padded batch, past the capacity (16) with int4 blocks: each row's
    sequence and beam score equal its prompt run alone (model in float64)."""
    from qsinkkv.hf import QSinkKVCache
    model, tok = lm64_left
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, num_beams=2, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(**batch, cache=QSinkKVCache(HF_CFG, model.config), **kw)
        for i, p in enumerate(PROMPTS):
            ids = tok(p, return_tensors="pt").input_ids
            own = model.generate(ids, cache=QSinkKVCache(HF_CFG, model.config), **kw)
            assert out.sequences[i, -12:].tolist() == own.sequences[0, -12:].tolist(), i
            torch.testing.assert_close(out.sequences_scores[i], own.sequences_scores[0], rtol=1e-6, atol=1e-6)


# --- tensor parallel ------------------------------------------------------------------------------

@pytest.mark.model  # each rank loads the default model
def test_tensor_parallel_three_ranks_equal_one_process(tmp_path):
    """torchrun, 3 ranks on CPU (gloo), the default model sharded with tp_plan="auto": each rank's
    cache holds 1 of the 3 KV heads (a third of the bytes), and a lossless stream past the capacity
    gives the tokens of one process; every rank exits cleanly."""
    import json
    import subprocess
    import sys
    script = [str(Path(__file__).parents[1] / "examples" / "tp_generate.py"), "--bits", "16", "--tokens", "40"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *script, "--json", str(tmp_path / "one.json")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    tp = subprocess.run([*torchrun, *script, "--json", str(tmp_path / "tp.json")], env=env, capture_output=True,
                        text=True, timeout=600)
    assert tp.returncode == 0, tp.stderr[-2000:]
    assert "terminate called" not in tp.stderr
    one, tp = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp"))
    assert tp["world"] == 3 and tp["tokens"] == one["tokens"]
    assert [r["kv_heads"] for r in tp["ranks"]] == [1, 1, 1] and one["ranks"][0]["kv_heads"] == 3
    assert [3 * r["bytes"] for r in tp["ranks"]] == [one["ranks"][0]["bytes"]] * 3


def test_tensor_parallel_degree_must_divide_the_kv_heads(lm):
    model, _, _ = lm

    class Sharded(torch.nn.Module):  # what from_pretrained(tp_plan="auto") gives on 4 ranks
        config, tp_size = model.config, 4

    with pytest.raises(ValueError, match="tp_size=4 ranks but has num_key_value_heads=3"):
        QSinkKVCache(CacheConfig(), Sharded())
    QSinkKVCache(CacheConfig(), model)  # tp_size None: one process


def test_triton_backend_generate_equals_torch_backend():
    """generate on the Triton backend (the prefill and decode kernels; Triton's interpreter on a CPU) gives
    the torch backend's greedy tokens and logits: a tiny random Llama, a left-padded batch of prompts of
    different lengths, one longer than the capacity, lossless float32 storage. (Both contracts of both
    kernels against the float64 oracle: tests/test_attention.py, tests/test_kernels.py.)"""
    from conftest import DEVICE, KERNEL_TOL
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(DEVICE).eval()
    use(model, "qsinkkv")
    cfg = CacheConfig(sink_tokens=2, recent_tokens=14, block_size=4, bits=16, **F32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (5, 19, 11)]
    batch, mask = _left_padded(type("Tok", (), {"eos_token_id": 0}), prompts)
    run = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    out = {}
    with torch.no_grad():
        for backend in ("torch", "triton"):
            out[backend] = model.generate(batch.to(DEVICE), attention_mask=mask.to(DEVICE),
                                          cache=QSinkKVCache(cfg, model.config, backend=backend), **run)
    assert torch.equal(out["torch"].sequences, out["triton"].sequences)
    diff = max((x - y).abs().max().item() for x, y in zip(out["torch"].logits, out["triton"].logits))
    scale = max(x.abs().max().item() for x in out["torch"].logits)
    assert diff < 10 * KERNEL_TOL * scale, f"{diff:.2e}"
