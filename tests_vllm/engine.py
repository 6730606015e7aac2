"""Run one vLLM engine (stock, or with the qsinkkv plugin) on token-id prompts, greedy; print one JSON
line. Run in the vLLM venv, one engine per process (vLLM keeps per-process state: plugins, backend
selection caches), by the tests in this folder and by ``benchmarks/vllm_serve.py``.

    python tests_vllm/engine.py '{"prompts": [[1, 2, 3]], "max_tokens": 8, "qsinkkv": {...} | null, ...}'
    python tests_vllm/engine.py @spec.json   # the same JSON in a file (a long spec)
    python tests_vllm/engine.py '{"engines": [spec, spec, ...]}'   # one after another in this one process: a list out

Keys: model (default: the embedded default model's safetensors folder), dtype ("float32"),
prompts (token ids), max_tokens, max_model_len (1024), qsinkkv (CacheConfig fields, or null for stock
vLLM), llm (extra ``vllm.LLM`` keyword arguments), warmup (a short generate first, not timed),
step (drive the engine step by step, in process, and record the real blocks each request holds),
capture (with step, bits 8/4: a file to which the first attention layer's every forward is saved -- its
packed q/k/v, query_start_loc, the tokens each row held, its sink page, and the output -- for a replay
into ``PagedCache``), capture_ranks (bits 8/4, workers in their own processes: the same, each forward of each
tensor-parallel rank to ``<capture_ranks>.rank<R>.<step>.pt``; ``capture_plugin/qsinkkv_capture.py``),
logprobs (N: also each token's top N candidates, ``logprobs``), backends (also the attention backend and impl
class of every attention layer of the model, ``backends``: [[backend, impl], ...], distinct, sorted),
refusals (each prompt added to the engine on its own: one that vLLM refuses at ``add_request`` -- e.g. a prompt
not shorter than max_model_len -- gets its message in ``refused`` and ``None`` in ``tokens``, the others run; without
it ``LLM.generate`` raises for the whole batch).
Output: tokens, seconds, tokens_per_s, kv_tokens (what vLLM's pool holds), max_concurrency (vLLM's count of the requests
of max_model_len tokens its pool holds at once, every KV cache group counted), block_size, prefix_caching (on or off),
held_blocks (per request: the most it held, and what it held at its end; the first KV cache group's), groups (with
step: each KV cache group's window and held blocks), with refusals ``refused`` ({index:
message}) and ``finish_reasons``, or error (the message of the exception that stopped the engine, at start or
mid-run).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# a test-only vLLM plugin that records the first attention layer in every worker (capture_ranks)
CAPTURE_PLUGIN = Path(__file__).parent / "capture_plugin"


def default_model() -> str:
    """The default model as the main venv converted it (``make test-vllm`` runs ``make_reference.py`` there
    first: transformers >= 5.24 is not in this venv)."""
    from qsinkkv.models import DEFAULT_MODEL, cache_dir
    return str(cache_dir() / DEFAULT_MODEL)


def _managers(llm) -> list:
    """Each KV cache group's manager in the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    return list(core.scheduler.kv_cache_manager.coordinator.single_type_managers)


def _manager(llm):
    """The first KV cache group's manager."""
    return _managers(llm)[0]


def _held(manager, request_id: str) -> int:
    null = manager._null_block
    return sum(b is not null for b in manager.req_to_blocks.get(request_id, ()))


def run(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool (else vLLM reserves most of the RAM)
    if spec.get("step") or spec.get("count_preemptions"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    preempted = []
    if spec.get("count_preemptions"):  # the scheduler, in this process: count the requests it preempts
        from vllm.v1.core.sched.scheduler import Scheduler
        preempt = Scheduler._preempt_request

        def counting(self, request, *args, **kwargs):
            preempted.append(request.request_id)
            return preempt(self, request, *args, **kwargs)

        Scheduler._preempt_request = counting
    captured = []
    if spec.get("capture"):
        _capture_first_layer(captured)
    if spec.get("capture_ranks"):  # the workers vLLM spawns load the recording plugin and write files (a spawned
        # worker starts from this process's sys.path, not PYTHONPATH's)
        os.environ["QSINKKV_CAPTURE"] = spec["capture_ranks"]
        sys.path.insert(0, str(CAPTURE_PLUGIN))

    kwargs = dict(model=spec.get("model") or default_model(), dtype=spec.get("dtype", "float32"), enforce_eager=True,
                  enable_prefix_caching=False, max_model_len=spec.get("max_model_len", 1024), seed=0)
    if spec.get("qsinkkv") is not None:
        kwargs["additional_config"] = {"qsinkkv": spec["qsinkkv"]}
    kwargs.update(spec.get("llm", {}))
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # what stopped the engine at start
        return {"error": f"{type(e).__name__}: {e}"}
    cache = llm.llm_engine.vllm_config.cache_config
    out = {"block_size": cache.block_size, "kv_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
           "prefix_caching": cache.enable_prefix_caching,
           # vLLM's own count (group-aware): requests of max_model_len tokens its pool holds at once
           "max_concurrency": getattr(cache, "kv_cache_max_concurrency", None)}
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if spec.get("warmup"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    try:
        _generate(llm, spec, prompts, params, out)
    except Exception as e:  # what stopped the engine mid-run (e.g. a value qsinkkv's checks refused)
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["seconds"] = time.perf_counter() - t0
    out["preemptions"] = len(preempted) if spec.get("count_preemptions") else None
    if spec.get("capture"):
        import torch
        torch.save(captured, spec["capture"])
        out["captured_steps"] = len(captured)
    kv = llm.llm_engine.vllm_config.cache_config
    out["num_blocks"] = kv.num_gpu_blocks
    out["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    if spec.get("step"):
        out["page_size_bytes"] = int(_manager(llm).kv_cache_spec.page_size_bytes)
    if spec.get("backends"):  # (each worker's model; the same classes in every rank)
        out["backends"] = sorted({tuple(pair) for rank in llm.apply_model(_attention_classes) for pair in rank})
    out["tokens_per_s"] = sum(len(t) for t in out["tokens"] if t is not None) / out["seconds"]
    try:  # stop the engine core (and its worker) before this process goes
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return out


def _generate(llm, spec: dict, prompts: list, params, out: dict) -> None:
    """Run the prompts (by ``spec``'s mode) into ``out``: tokens and the mode's extras."""
    if spec.get("step"):
        engine, managers = llm.llm_engine, _managers(llm)
        manager = managers[0]
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        most = [dict.fromkeys(ids, 0) for _ in managers]
        last, tokens = [dict.fromkeys(ids, 0) for _ in managers], {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            for g, m in enumerate(managers):
                for key in list(m.req_to_blocks):  # vLLM suffixes the ids it is given
                    rid = key if key in most[g] else key.rsplit("-", 1)[0]
                    if rid in most[g]:
                        n = _held(m, key)
                        most[g][rid], last[g][rid] = max(most[g][rid], n), n
        out["tokens"] = [tokens[r] for r in ids]
        out["held_blocks"] = {"most": [most[0][r] for r in ids], "at_end": [last[0][r] for r in ids]}
        # every KV cache group (a model with window layers has several): its window and what each request held
        out["groups"] = [{"sink_tokens": getattr(m.kv_cache_spec, "sink_tokens", None),
                          "recent_tokens": getattr(m.kv_cache_spec, "recent_tokens", None),
                          "block_size": m.block_size, "most": [most[g][r] for r in ids],
                          "at_end": [last[g][r] for r in ids]} for g, m in enumerate(managers)]
        out["free_blocks_after"] = manager.block_pool.get_num_free_blocks()
    elif spec.get("refusals"):
        engine, refused, done = llm.llm_engine, {}, {}
        for i, p in enumerate(prompts):
            try:
                engine.add_request(f"r{i}", p, params)
            except Exception as e:  # vLLM's own refusal, e.g. VLLMValidationError for a prompt over max_model_len
                refused[str(i)] = f"{type(e).__name__}: {e}"
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        out["tokens"] = [list(done[f"r{i}"].token_ids) if f"r{i}" in done else None for i in range(len(prompts))]
        out["finish_reasons"] = [done[f"r{i}"].finish_reason if f"r{i}" in done else None
                                 for i in range(len(prompts))]
        out["refused"] = refused
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        if spec.get("logprobs"):  # per token: the top candidates' (id, logprob), best first
            out["logprobs"] = [[sorted(((i, p.logprob) for i, p in step.items()), key=lambda x: -x[1])
                                for step in o.outputs[0].logprobs] for o in outs]


def _attention_classes(model) -> list[tuple[str, str]]:
    """(backend, impl) class names of each attention layer of ``model`` (run in the worker: plain strings back)."""
    from vllm.model_executor.layers.attention.attention import Attention
    return [(m.attn_backend.__name__, type(m.impl).__name__) for m in model.modules() if isinstance(m, Attention)]


def _capture_first_layer(captured: list) -> None:
    """Record every forward of the first attention layer (in this process: ``step`` runs the worker here)."""
    sys.path.insert(0, str(CAPTURE_PLUGIN))
    from qsinkkv_capture import record_first_layer
    record_first_layer(captured.append)


if __name__ == "__main__":
    arg = sys.argv[1]  # the spec's JSON, or @FILE holding it (a long spec passes the command line's limit)
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            arg = f.read()
    spec = json.loads(arg)
    # "engines": several specs, one after another in this one process (vLLM's per-process state shared)
    result = [run(one) for one in spec["engines"]] if "engines" in spec else run(spec)
    print("QSINKKV_RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's slow interpreter teardown; the engine core process goes with its parent
