"""Tensor-parallel generation with a QSinkKVCache: each rank holds only its own KV heads.

    torchrun --standalone --nproc-per-node 3 examples/tp_generate.py [--tokens 48] [--bits 4] [--json out.json]

transformers shards the model (``tp_plan="auto"``; on CPU the ranks talk over gloo); every
rank builds its own ``QSinkKVCache``, which sizes itself from the K/V it is handed (here 1 of
the default model's 3 KV heads per rank), so each rank holds a third of the cache bytes. The
stream runs past the cache's capacity. Rank 0 prints the tokens and every rank's bytes;
``--json`` writes them (used by the tests, which compare them with one process).
Run without torchrun it is the single-process reference. ``--model DIR``: another model folder (the tests run a
tiny Gemma 3, whose window layers keep their window on every rank).
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from qsinkkv import CacheConfig
from qsinkkv.hf import QSinkKVCache
from qsinkkv.models import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import option, save_json  # noqa: E402  (benchmarks/common.py: the shared option names, JSON output)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens (greedy)")
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    option(ap, "--sink-tokens", "--sinks", type=int, default=4, help="sink tokens S (default 4)")
    option(ap, "--recent-tokens", "--recent", type=int, default=28, help="recent tokens W (default 28)")
    ap.add_argument("--prompt", default="The history of the lighthouse begins")
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded default model); one with "
                                                  "trained window layers runs under QSinkKVCache's LayerPolicy")
    ap.add_argument("--json", help="write the tokens and every rank's bytes here")
    a = ap.parse_args()
    tp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    path = a.model or default_model_dir()  # converted once; under torchrun every rank finds it converted
    kw = dict(tp_plan="auto") if tp else {}
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="qsinkkv", **kw).eval()
    store = dict(sink_dtype=torch.float32, window_dtype=torch.float32) if a.bits == 16 else {}
    cfg = CacheConfig(sink_tokens=a.sink_tokens, recent_tokens=a.recent_tokens, bits=a.bits, block_size=4,
                      value_group_size=32, **store)
    cache = QSinkKVCache(cfg, model)  # the model itself: a degree that splits a KV head is refused by name
    ids = tok(a.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if tp else (0, 1)
    row = dict(rank=rank, kv_heads=cache.inner.num_kv_heads, bytes=cache.nbytes())
    rows = [None] * world
    if tp:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0:
        print(tok.decode(new))
        for r in rows:
            print(f"rank {r['rank']}: {r['kv_heads']} KV heads, {r['bytes']:,} cache bytes")
        save_json(a.json, dict(world=world, tokens=new, ranks=rows))
    if tp:
        dist.barrier()
        dist.destroy_process_group()  # a clean exit: no rank aborts on a live process group


if __name__ == "__main__":
    main()
