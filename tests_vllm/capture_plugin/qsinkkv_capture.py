"""Test-only: record every forward of the first attention layer of qsinkkv's quantized backend, for a replay into
``PagedCache`` (tests_vllm/test_vllm_plugin.py).

In one process ``engine.py`` calls ``record_first_layer`` with a list. A worker that vLLM starts for a rank (tensor
or pipeline parallel: the CPU platform spawns them, so a patch made in the parent does not reach them) loads this
module as a vLLM general plugin -- ``engine.py`` puts this folder, which holds the plugin's ``.dist-info`` with its
entry point, on its ``sys.path``, which a spawned worker starts from -- and ``register`` records into files:
``$QSINKKV_CAPTURE.rank<R>.<step>.pt``, one a forward, R the tensor-parallel rank."""
from __future__ import annotations

import os
from collections.abc import Callable


def record_first_layer(sink: Callable[[dict], None]) -> None:
    """Hand ``sink`` each forward of the first attention layer: its backend and fresh-prefill kernel, the packed
    q/k/v, query_start_loc, the tokens each row held, its sink pages, and the output."""
    from qsinkkv.integrations.vllm.quantized import QuantImpl
    forward = QuantImpl.forward
    first = []

    def recording(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None:
            if not first:
                first.append(layer.layer_name)
            if layer.layer_name == first[0]:
                n, step_plan = attn_metadata.num_actual_tokens, attn_metadata.step.plan
                sink({"backend": self.ops.backend, "prefill_causal": self.ops.served_by().get("prefill_causal"),
                      "q": query[:n].clone(), "k": key[:n].clone(), "v": value[:n].clone(),
                      "qsl": step_plan.query_start_loc.clone(), "held": step_plan.held.clone(),
                      "sink_pages": attn_metadata.step.tables[0].clone(),
                      "out": output[:n].view(n, -1, query.shape[-1]).clone()})
        return result

    QuantImpl.forward = recording


def register() -> None:
    prefix = os.environ.get("QSINKKV_CAPTURE")
    if not prefix:
        return
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank
    steps = [0]

    def to_file(step: dict) -> None:
        torch.save(step, f"{prefix}.rank{get_tensor_model_parallel_rank()}.{steps[0]:05d}.pt")
        steps[0] += 1

    record_first_layer(to_file)
