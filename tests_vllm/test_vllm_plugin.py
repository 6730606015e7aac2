"""qsinkkv inside vLLM: stock parity within the capacity, qsinkkv's own reference past it (bits 16 and int4, whole
prompts and chunked prefill), one layer's int4/int8 forward bit for bit against PagedCache (also over chunked
prefill past the window), page bytes, refusals."""
from dataclasses import replace

import pytest
import torch
from conftest import run_engine

from qsinkkv.engine_pages import PageLayout, max_pages
from qsinkkv.integrations.vllm import parse_config
from qsinkkv.integrations.vllm.cpu_prefill import CpuAttnPrefill
from qsinkkv.layout import WindowLayout
from qsinkkv.paged import PagedCache, block_bytes

WIDE = {"sink_tokens": 4, "recent_tokens": 1020, "bits": 16, "block_size": 32,
        "sink_dtype": "float32", "window_dtype": "float32"}  # S + W = 1024 > every sequence here


def test_within_capacity_equals_stock_vllm(reference):
    """bits=16, S + W longer than every sequence: the plugin's greedy tokens are stock vLLM's, 8 x 64."""
    spec = {"prompts": reference["bits16"]["prompts"], "max_tokens": 64}
    stock = run_engine(spec)
    ours = run_engine({**spec, "qsinkkv": WIDE})
    assert "error" not in stock and "error" not in ours, (stock.get("error"), ours.get("error"))
    assert ours["block_size"] == 32 and stock["block_size"] != 32  # the plugin's engine really took our config
    assert ours["tokens"] == stock["tokens"]


# vLLM's chunked prefill: a prompt of more than 16 tokens is split over steps, beside the rows that decode
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 16}


@pytest.mark.parametrize("llm", [{}, CHUNKED], ids=["whole-prompts", "chunked-prefill"])
def test_past_capacity_follows_qsinkkv_reference(reference, llm):
    """bits=16 float32, S=4 W=60: every row streams past the capacity (64) and keeps qsinkkv's tokens
    (HF generate with QSinkKVCache, made in the main venv); the pool holds a constant block count. With
    chunked prefill too (the reference prefills each prompt whole)."""
    run = reference["bits16"]
    cfg, prompts, ref = run["config"], run["prompts"], run["tokens"]
    C = cfg["sink_tokens"] + cfg["recent_tokens"]
    out = run_engine({"prompts": prompts, "max_tokens": len(ref[0]), "qsinkkv": cfg, "step": True, "llm": llm})
    assert "error" not in out, out.get("error")
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out["tokens"])]
    for p, r, first in zip(prompts, ref, firsts):
        past = C - len(p)                      # generated tokens until the row reaches the capacity
        assert len(p) + len(r) > C + 32, "the reference must stream past the capacity"
        # a full-attention (or wrong-window) engine departs within a few tokens of the capacity
        assert first is None or first >= past + 32, f"rows depart from qsinkkv's reference at {firsts}"
    # float32 engines (vLLM's fused ops vs HF's) may part on a near-tie far past the window
    assert sum(f is None for f in firsts) >= 6, f"rows depart from qsinkkv's reference at {firsts}"
    bs = out["block_size"]
    bound = -(-cfg["sink_tokens"] // bs) + -(-cfg["recent_tokens"] // bs) + 1
    assert max(out["held_blocks"]["most"]) <= bound, out["held_blocks"]


def test_a_preempted_request_gives_the_tokens_it_gives_without_preemption(reference):
    """bits=16 float32, S=4 W=60, 4 of the reference's prompts x 96 tokens streaming past the capacity, in a pool
    of 10 blocks (a request holds up to 4): vLLM preempts requests and recomputes them from their prompts. Every
    request completes, and gives the tokens it gives in a pool with room for all."""
    run = reference["bits16"]
    spec = {"prompts": run["prompts"][:4], "max_tokens": 96, "qsinkkv": run["config"],
            "max_model_len": 256, "count_preemptions": True}
    roomy = run_engine(spec)
    tight = run_engine({**spec, "llm": {"num_gpu_blocks_override": 10}})
    assert "error" not in roomy and "error" not in tight, (roomy.get("error"), tight.get("error"))
    assert roomy["preemptions"] == 0 and tight["preemptions"] > 0, (roomy["preemptions"], tight["preemptions"])
    assert [len(t) for t in tight["tokens"]] == [96] * 4
    assert tight["tokens"] == roomy["tokens"]


def test_tensor_parallel_ranks_give_the_single_process_tokens(reference, monkeypatch):
    """``tensor_parallel_size=3`` on the CPU (the default model's 3 KV heads, one a rank; three CPU workers on one
    NUMA node start only with ``VLLM_CPU_OMP_THREADS_BIND=nobind``): bits=16 float32, S=4 W=60, 4 prompts x 48
    tokens streaming past the capacity give exactly the tokens of one process (each rank holds its head's sinks and
    window; the all-reduce of the heads' outputs is the only new sum). About 3 minutes on 2 cores."""
    run = reference["bits16"]
    spec = {"prompts": run["prompts"][:4], "max_tokens": 48, "qsinkkv": run["config"], "max_model_len": 256}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    alone = run_engine(spec)
    ranks = run_engine({**spec, "llm": {"tensor_parallel_size": 3}}, timeout=600)
    assert "error" not in alone and "error" not in ranks, (alone.get("error"), ranks.get("error"))
    C = run["config"]["sink_tokens"] + run["config"]["recent_tokens"]
    assert all(len(p) + 48 > C for p in spec["prompts"])  # (past the capacity)
    assert ranks["tokens"] == alone["tokens"]


def test_tensor_parallel_int4_ranks_equal_paged_cache_over_their_heads(reference, monkeypatch, tmp_path):
    """int4 under ``tensor_parallel_size=3``: each rank holds one KV head's int4 pages, and every forward of its first
    attention layer (recorded in the rank's own process: ``capture_ranks``) equals ``PagedCache`` over that head fed
    the same K/V, bit for bit, past the capacity. Tokens are not asserted equal to one process's: the all-reduce sums
    the heads' outputs in another order, and a last-bit change in a key can move a code of its int4 block (the
    closing note of 2026-12-05 says what it did in this run)."""
    run = reference["int4"]
    cfg = parse_config(run["config"])
    spec = {"prompts": run["prompts"][:4], "max_tokens": 48, "qsinkkv": run["config"], "max_model_len": 256,
            "llm": {"tensor_parallel_size": 3}, "capture_ranks": str(tmp_path / "layer0")}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    ranks = run_engine(spec, timeout=600)
    assert "error" not in ranks, ranks.get("error")
    assert [len(t) for t in ranks["tokens"]] == [48] * 4
    assert all(len(p) + 48 > cfg.capacity for p in spec["prompts"])  # (past the capacity)
    for rank in range(3):
        steps = [torch.load(f) for f in sorted(tmp_path.glob(f"layer0.rank{rank}.*.pt"))]
        assert steps and steps[0]["k"].shape[1] == 1 and steps[0]["out"].shape[1] == 3, rank  # one KV head, 3 q heads
        assert _replay_into_paged_cache(steps, cfg) == len(steps) >= 48, rank


def test_pipeline_parallel_ranks_give_the_single_process_tokens(reference, monkeypatch):
    """``pipeline_parallel_size=2`` on the CPU (two workers, 15 layers and their pages each): int4 float32, 4 prompts
    x 48 tokens streaming past the capacity give exactly the tokens of one process. vllm-cpu 0.32 runs PP only
    compiled: under ``enforce_eager`` its model runner skips the warm-up run that makes the later rank's buffers for
    the hidden states it receives (``sync_and_gather_intermediate_tensors`` asserts), stock vLLM alike; both engines
    here run compiled (``enforce_eager=False``). About 2 minutes on 2 cores."""
    run = reference["int4"]
    spec = {"prompts": run["prompts"][:4], "max_tokens": 48, "qsinkkv": run["config"], "max_model_len": 256,
            "llm": {"enforce_eager": False}}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    alone = run_engine(spec, timeout=600)
    stages = run_engine({**spec, "llm": {**spec["llm"], "pipeline_parallel_size": 2,
                                         "distributed_executor_backend": "mp"}}, timeout=600)
    assert "error" not in alone and "error" not in stages, (alone.get("error"), stages.get("error"))
    C = run["config"]["sink_tokens"] + run["config"]["recent_tokens"]
    assert all(len(p) + 48 > C for p in spec["prompts"])  # (past the capacity)
    assert stages["tokens"] == alone["tokens"]


def test_max_model_len_past_the_models_positions_is_refused_at_start(monkeypatch):
    """``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` lets vLLM take a ``max_model_len`` past the model's 8,192 positions; past
    them vLLM's rotary embedding reads beyond its cos/sin table and the keys are undefined (tried here: once |k| ~
    1e37, which qsinkkv's value checks refused mid-run; once finite garbage, stored and attended to). The plugin
    refuses such an engine at start, naming max_model_len; up to the positions, it runs."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    cfg = {"sink_tokens": 4, "recent_tokens": 252, "bits": 4, "block_size": 32, "value_group_size": 32}
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 4, "qsinkkv": cfg, "max_model_len": 65536}, timeout=240)
    assert "error" in out and "max_model_len=65536 is past the model's 8192 positions" in out["error"], out


def _replay_into_paged_cache(steps: list, cfg) -> int:
    """Feed one layer's captured vLLM forwards (``engine.py`` capture) to ``PagedCache`` in the engine's row order;
    every output must be the same bits. A request is its sink page; one that starts on a page takes a new
    sequence. The cache's fresh-prompt prefill is the kernel the engine's ran (on vLLM's CPU build: vLLM's own,
    ``cpu_prefill.py``, tested against a float64 oracle in test_vllm_cpu_prefill.py). Returns the steps compared."""
    Hkv, D = steps[0]["k"].shape[1:]
    layout = WindowLayout(cfg)
    cache = PagedCache(cfg, 1, Hkv, D, max_seqs=32, float_blocks=32 * layout.float_slots,
                       quant_blocks=32 * layout.quant_slots, dtype=torch.float32, backend=steps[0]["backend"])
    assert steps[0]["prefill_causal"] == "vllm_cpu", steps[0]["prefill_causal"]
    H = steps[0]["out"].shape[1]
    cache.ops = replace(cache.ops, prefill_causal=CpuAttnPrefill(H, Hkv, D, torch.float32),
                        kernels={**cache.ops.kernels, "prefill_causal": "vllm_cpu"})
    seq_of_page = {}
    for i, step in enumerate(steps):
        held, pages, qsl = step["held"], step["sink_pages"].tolist(), step["qsl"]
        for b, page in enumerate(pages):
            if held[b] == 0:
                if page in seq_of_page:
                    cache.release(seq_of_page.pop(page))
                seq_of_page[page] = cache.admit()
        ids = [seq_of_page[p] for p in pages]
        rest = [r for r, s in enumerate(cache.seq_ids) if s not in ids]
        cache.select_batch([cache.seq_ids.index(s) for s in ids] + rest)   # the engine's rows first, in its order
        assert cache.seq_lens()[:len(ids)].tolist() == held.tolist(), f"step {i}: lengths differ"
        lens = torch.cat((qsl[1:] - qsl[:-1], torch.zeros(len(rest), dtype=torch.int64)))
        out = cache.attend_packed(0, step["q"].view(step["out"].shape), step["k"], step["v"],
                                  torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))))
        assert torch.equal(out, step["out"]), f"step {i}: max diff {(out - step['out']).abs().max()}"
    return len(steps)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_layer_equals_paged_cache_and_follows_qsinkkv(reference, bits, tmp_path):
    """int4/int8 pages (vLLM's own blocks holding qsinkkv's codes): the first layer's every forward equals
    ``PagedCache`` fed the same K/V, bit for bit; a page is PagedCache's quantized block; each request holds a
    constant number of blocks; int4's greedy tokens keep qsinkkv's (HF + QSinkKVCache int4) past the window."""
    run = reference["int4"]
    raw = {**run["config"], "bits": bits}
    cfg = parse_config(raw)
    prompts, ref = run["prompts"], run["tokens"]
    out = run_engine({"prompts": prompts, "max_tokens": len(ref[0]), "qsinkkv": raw, "step": True,
                      "capture": str(tmp_path / "layer0.pt")})
    assert "error" not in out, out.get("error")
    steps = torch.load(tmp_path / "layer0.pt")
    assert steps[0]["backend"] == "c"  # the C decode where it compiles (CI's machine has cc), over vLLM's pages
    assert _replay_into_paged_cache(steps, cfg) == out["captured_steps"] >= len(ref[0])
    Hkv, D = steps[0]["k"].shape[1:]
    sizes = block_bytes(cfg, Hkv, D)
    assert out["page_size_bytes"] == PageLayout.of(cfg, Hkv, D).page_bytes == max(sizes["quant"], sizes["sink"])
    layout, pinned = WindowLayout(cfg), PageLayout.of(cfg, Hkv, D).pinned
    assert max(out["held_blocks"]["most"]) <= max_pages(layout, pinned, 1 + max(map(len, prompts)))
    # the sink page, the float ring's pages and a window's blocks
    assert out["held_blocks"]["at_end"] == [pinned + layout.quant_slots] * len(prompts)
    if bits == 4:
        C = cfg.capacity
        firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out["tokens"])]
        for p, first in zip(prompts, firsts):
            # a wrong window or broken blocks depart at the first quantized block or the capacity
            assert first is None or first >= C - len(p) + 16, f"rows depart from qsinkkv's int4 reference at {firsts}"
        assert sum(f is None for f in firsts) >= 6, f"rows depart from qsinkkv's int4 reference at {firsts}"


def test_chunked_prefill_past_the_window_equals_paged_cache(reference, tmp_path):
    """int4 with vLLM's chunked prefill over prompts longer than S + W (77-100 tokens, capacity 64): chunks of
    at most 16 tokens that complete blocks and push tokens out of the window, beside decoding rows; the first
    layer's every forward equals ``PagedCache`` fed the same chunks, bit for bit."""
    run = reference["int4"]
    cfg = parse_config(run["config"])
    prompts = [p + r[:60] for p, r in zip(run["prompts"], run["tokens"])]
    assert min(map(len, prompts)) > cfg.capacity
    out = run_engine({"prompts": prompts, "max_tokens": 24, "qsinkkv": run["config"], "step": True,
                      "capture": str(tmp_path / "layer0.pt"), "llm": CHUNKED})
    assert "error" not in out, out.get("error")
    steps = torch.load(tmp_path / "layer0.pt")
    lens = [s["qsl"][1:] - s["qsl"][:-1] for s in steps]
    # chunks that continue a prompt (held > 0, more than one token), some past the capacity
    assert any(bool(((n > 1) & (s["held"] > 0)).any()) for n, s in zip(lens, steps))
    assert any(bool(((n > 1) & (s["held"] >= cfg.capacity)).any()) for n, s in zip(lens, steps))
    assert max(int(n.sum()) for n in lens) <= 16
    assert _replay_into_paged_cache(steps, cfg) == out["captured_steps"]
    assert all(len(t) == 24 for t in out["tokens"])


@pytest.mark.parametrize("bad, field", [({"bits": 3}, "bits"), ({"sink_tokens": 4, "windw": 8}, "windw"),
                                        ({"bits": 16, "block_size": 24}, "block_size"),
                                        ({"bits": 4, "residual_tokens": 8}, "residual_tokens"),
                                        ({"bits": 4, "decode_variant": "fast"}, "decode_variant"),
                                        # the CPU's C decode has one body: refused in the front end
                                        ({"bits": 4, "decode_variant": "fp16"}, "decode_variant='fp16' picks a body")])
def test_bad_config_stops_the_engine_naming_the_field(bad, field):
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": bad}, timeout=240)
    assert "error" in out and field in out["error"], out


def test_prefix_caching_asked_for_is_refused_and_left_unset_is_turned_off():
    """vLLM's default (prefix caching on) just works: left unset, the plugin turns it off; asked for, it stops the
    engine at start, naming the field."""
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": WIDE,
                      "llm": {"enable_prefix_caching": True}}, timeout=240)
    assert "error" in out and "enable_prefix_caching" in out["error"], out
    out = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": WIDE,
                      "llm": {"enable_prefix_caching": None}}, timeout=240)  # (engine.py's LLM() as a new user's)
    assert "error" not in out and out["prefix_caching"] is False and len(out["tokens"][0]) == 2, out
    stock = run_engine({"prompts": [[1, 2, 3]], "max_tokens": 2, "qsinkkv": None,
                        "llm": {"enable_prefix_caching": None}}, timeout=240)
    assert "error" not in stock and stock["prefix_caching"] is True, stock  # (a stock engine keeps vLLM's default)
