"""Plain helpers shared by the test files (fixtures live in conftest.py; the float64 oracle in oracle.py).

State:     ``snapshot`` / ``assert_unchanged`` (a refused call changes nothing), ``visible_rows`` /
           ``assert_same_state`` (two caches hold the same visible tokens, bit for bit).
Errors:    ``rel`` (relative norm, a zero reference allowed), ``rel_rms`` (relative norm), ``rel_max``
           (max abs over max abs).
Builders:  ``make`` (a float32 cache), ``draw`` / ``run_rows`` (random q, k, v), ``filled_layer`` /
           ``random_storage_layer`` (one layer's storage), ``scattered_pool`` (a paged pool whose blocks are
           scattered), ``run_stream`` (a cache through a stream, against the float64 oracle), ``save_tiny_gemma3``
           (a tiny random Gemma 3 with the default model's tokenizer, as a model folder).
"""
from __future__ import annotations

import torch
from oracle import attention_oracle, bf16_exact, stored_history

from qsinkkv import CacheConfig, SinkQuantCache, gather, visible_mask

# The small shapes of the cache tests: HKV KV heads, G query heads per KV head, head_dim D
HKV, G, D = 2, 2, 8


# --- state --------------------------------------------------------------------------------------------

def snapshot(cache):
    """Everything a refused call must leave as it was: a pool's sequence ids and free blocks (None for a
    cache that has none), and per layer its lengths, block tables and tensors."""
    ids = cache.seq_ids[:] if hasattr(cache, "seq_ids") else None
    free = {k: v[:] for k, v in cache.blocks.free.items()} if hasattr(cache.blocks, "free") else None
    return (ids, free,
            [(layer.seq_lens.clone(), layer.sink_table.clone(), layer.float_table.clone(), layer.quant_table.clone(),
              {n: t.clone() for n, t in layer.tensors().items()}) for layer in cache.layers])


def assert_unchanged(cache, snap):
    ids, free, layers = snap
    assert (cache.seq_ids[:] if hasattr(cache, "seq_ids") else None) == ids
    assert ({k: v[:] for k, v in cache.blocks.free.items()} if hasattr(cache.blocks, "free") else None) == free
    assert len(cache.layers) == len(layers)
    for layer, (lens, st_, ft, qt, tensors) in zip(cache.layers, layers):
        assert torch.equal(layer.seq_lens, lens)
        assert torch.equal(layer.sink_table, st_) and torch.equal(layer.float_table, ft)
        assert torch.equal(layer.quant_table, qt)
        for name, t in layer.tensors().items():
            assert torch.equal(t, tensors[name]), name


def visible_rows(cache, layer=0):
    """Per sequence: its visible (positions, k, v), sorted by position."""
    storage = cache.layers[layer]
    k, v, pos = gather(storage, torch.float32)
    n = storage.seq_lens
    seen = visible_mask((n - 1).unsqueeze(1), pos, cache.config.sink_tokens, cache.config.recent_tokens)[:, 0]
    out = []
    for b in range(len(n)):
        order = torch.argsort(torch.where(seen[b], pos[b], pos[b].max() + 1))[: int(seen[b].sum())]
        out.append((pos[b, order], k[b][:, order], v[b][:, order]))
    return out


def assert_same_state(a, b):
    """Every layer, every sequence: the same length and the same visible (positions, k, v), bit for bit."""
    assert len(a.layers) == len(b.layers)
    for layer in range(len(a.layers)):
        assert torch.equal(a.layers[layer].seq_lens, b.layers[layer].seq_lens), f"layer {layer}'s lengths"
        for row, (x, y) in enumerate(zip(visible_rows(a, layer), visible_rows(b, layer))):
            assert all(torch.equal(s, t) for s, t in zip(x, y)), f"layer {layer}, sequence {row}"


# --- errors ---------------------------------------------------------------------------------------------

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rel_max(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


# --- data ----------------------------------------------------------------------------------------------

# The layouts every decode path is tested on (test_kernels.py: the Triton kernel; test_decode.py: the CPU paths)
CASES = [
    # bits, S, W, bs, group, residual, Hkv, G, lengths
    (4, 4, 20, 4, 8, 0, 2, 3, [57, 57]),           # ring wrapped many times
    (8, 4, 20, 4, 8, 0, 1, 8, [1, 3, 9, 24, 25, 200]),  # per-sequence lengths: inside sinks, filling, wrapped
    (16, 2, 13, 4, 8, 0, 2, 4, [14, 40, 7]),
    (4, 0, 16, 8, 4, 0, 3, 1, [5, 16, 17, 99]),    # no sinks: a plain sliding window; MHA
    (8, 3, 11, 5, 16, 4, 2, 3, [30, 12]),          # odd window and block, residual
    (4, 1, 9, 1, 2, 0, 1, 4, [33, 4]),             # one token per block
]


# --- builders -------------------------------------------------------------------------------------------

def make(cfg, layers=1, B=1, Hkv=1, D=8, dtype=torch.float32, **kwargs):
    """A cache of ``layers`` layers, ``B`` sequences of ``Hkv`` KV heads of ``head_dim=D``."""
    return SinkQuantCache(cfg, layers, B, Hkv, D, dtype=dtype, **kwargs)


def draw(g, B, T, dtype=torch.float32):
    """Fresh random q, k, v ``[B, H, T, D]`` (HKV * G query heads, HKV KV heads) from generator ``g``."""
    return tuple(torch.randn(B, h, T, D, generator=g).to(dtype) for h in (HKV * G, HKV, HKV))


def run_rows(cfg, B=3, seed=0):
    """A function ``draw(T=1)`` giving fresh random q, k, v ``[B, H, T, D]`` for B sequences, from a generator
    of its own (``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return lambda T=1: tuple(torch.randn(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))


def filled_layer(cfg, lengths, Hkv, seed=0, rotary=None, D=16):
    """A batch whose sequences hold ``lengths`` tokens: each sequence is streamed through its own
    single-sequence cache (prefill + decode steps), then the storages are stacked."""
    g = torch.Generator().manual_seed(seed)
    singles = []
    for n in lengths:
        c = SinkQuantCache(cfg, 1, 1, Hkv, D, dtype=torch.float32, rotary=rotary, backend="torch")
        first = max(n - 5, 1)
        c.append(0, torch.randn(1, Hkv, first, D, generator=g), torch.randn(1, Hkv, first, D, generator=g))
        for _ in range(n - first):
            c.append(0, torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g))
        singles.append(c.layers[0])
    batch = SinkQuantCache(cfg, 1, len(lengths), Hkv, D, dtype=torch.float32, rotary=rotary, backend="torch").layers[0]
    for name, t in batch.tensors().items():
        t.copy_(torch.cat([s.tensors()[name] for s in singles], dim=1))  # pools are [Hkv, blocks, ...]
    batch.seq_lens.copy_(torch.tensor(lengths))
    return batch, singles


def random_storage_layer(cfg, B, Hkv, seed=0, D=16):
    """A layer whose every storage tensor holds fresh random data (codes, positive scales, floats):
    which slots are live is a function of the lengths alone, so any length can be tested without
    streaming that many tokens."""
    g = torch.Generator().manual_seed(seed)
    layer = SinkQuantCache(cfg, 1, B, Hkv, D, dtype=torch.float32, backend="torch").layers[0]
    for name, t in layer.tensors().items():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g))
        elif "scale" in name:
            t.copy_(torch.rand(t.shape, generator=g) * 0.1 + 0.01)
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return layer


def scattered_pool(bits, backend, device="cpu"):
    """A one-layer pool of 3 sequences (HKV KV heads, head_dim 16) whose blocks are scattered: a sequence
    admitted and released between others, then ragged prefill chunks and decode steps (a row idle).
    Returns the pool and ``draw(B, T)``, fresh random q, k, v ``[B, H, T, 16]`` on ``device``."""
    from qsinkkv.paged import PagedCache
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=bits, block_size=4, value_group_size=8)
    pool = PagedCache(cfg, 1, HKV, 16, max_seqs=4, float_blocks=12, quant_blocks=12, dtype=torch.float32,
                      device=device, backend=backend)
    g = torch.Generator().manual_seed(bits)
    draw = lambda B, T: tuple(torch.randn(B, h, T, 16, generator=g).to(device) for h in (HKV * G, HKV, HKV))  # noqa
    ids = [pool.admit() for _ in range(3)]
    pool.attend(0, *draw(3, 9), [9, 2, 5])
    pool.release(ids[0])
    pool.admit()
    for lens in ([7, 3, 13], [1, 1, 1], [0, 1, 1]):
        out = pool.attend(0, *draw(3, max(lens)), lens)
        assert torch.isfinite(out).all()
    layer = pool.layers[0]
    table = (layer.quant_table if bits != 16 else layer.float_table).flatten().tolist()
    assert not layer.dense and len(set(table) - {-1}) > 3 and table != sorted(table)  # scattered blocks
    return pool, draw


def run_stream(cfg, *, B=2, Hkv=2, G=3, D=16, schedule=None, rotary=None, sink_logits=None, seed=0,
               backend="torch", device="cpu"):
    """Drive a cache through ``schedule`` (chunk sizes); return (max rel error vs the oracle on
    stored K/V, relative RMS error vs full-precision attention)."""
    schedule = schedule or [50] + [1] * 120 + [7] + [1] * 120
    N = sum(schedule)
    g = torch.Generator().manual_seed(seed)
    k, v, q = (bf16_exact(B, h, N, D, generator=g) for h in (Hkv, Hkv, Hkv * G))
    cache = SinkQuantCache(cfg, 1, B, Hkv, D, dtype=torch.float32, rotary=rotary, backend=backend, device=device)
    logits = None if sink_logits is None else sink_logits.to(device)
    S, W = cfg.sink_tokens, cfg.recent_tokens
    worst, outs, n = 0.0, [], 0
    for T in schedule:
        out = cache.attend(0, *(x[:, :, n:n + T].to(device) for x in (q, k, v)), sink_logits=logits).cpu()
        if T == 1:
            stored = stored_history(k, v, n + 1, cfg)
            source = lambda i: stored  # noqa: E731
        else:
            prior = stored_history(k, v, n, cfg)
            full = (torch.cat((prior[0], k[:, :, n:n + T].double()), 2),
                    torch.cat((prior[1], v[:, :, n:n + T].double()), 2))
            source = lambda i: full  # noqa: E731
        ref = attention_oracle(q[:, :, n:n + T], source, S, W, range(n, n + T), rotary, sink_logits)
        worst = max(worst, rel_max(out, ref))
        outs.append(out)
        n += T
    assert cache.seq_length == N
    exact = attention_oracle(q, lambda i: (k.double(), v.double()), S, W, range(N), rotary, sink_logits)
    got = torch.cat(outs, dim=2).double()
    rms = ((got - exact).norm() / exact.norm()).item()
    return worst, rms


def outlier_qkv(seed: int, B: int = 1, H: int = 6, Hkv: int = 2, T: int = 97, D: int = 16):
    """Fresh random ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` shaped like a model's: keys with channel
    outliers and a loud first token (like a sink's key)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g) * torch.linspace(0.5, 3, D)  # channel outliers
    v = torch.randn(B, Hkv, T, D, generator=g)
    k[:, :, 0] *= 6  # a loud first token, like a sink's key
    return q, k, v


def save_tiny_gemma3(out, tokenizer_dir, **config):
    """A tiny random Gemma 3 (seeded; layers 2 and 5 global, the rest a trained window of 32, head_dim 64: the eval's
    groups of 64) with the tokenizer files of ``tokenizer_dir`` (the default model's), saved as a model folder
    ``out``; ``config``: Gemma3TextConfig fields over those."""
    import shutil

    import transformers

    torch.manual_seed(0)
    types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    cfg = transformers.Gemma3TextConfig(**{**dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, num_hidden_layers=6, layer_types=types, sliding_window=32, max_position_embeddings=4096),
        **config})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out
