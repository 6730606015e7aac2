"""The engine's qsinkkv config as this process knows it (read from the current ``VllmConfig``)."""
from __future__ import annotations

from ...config import CacheConfig
from .config import parse_config, raw_config

_ACTIVE: dict = {}  # id(VllmConfig) -> (CacheConfig | None, in-flight tokens): the last engine config seen


def from_vllm_config(vllm_config) -> CacheConfig | None:
    """The CacheConfig of ``vllm_config`` (None: the engine runs stock vLLM), remembered for the backend's
    static hooks (``customize_spec``), which vLLM calls without a config."""
    if vllm_config is None:
        return None
    key = id(vllm_config)
    if key not in _ACTIVE:
        raw = raw_config(getattr(vllm_config, "additional_config", None))
        cfg = None if raw is None else parse_config(raw)
        try:
            in_flight = int(vllm_config.max_in_flight_tokens)
        except Exception:  # older configs: one step's token budget
            in_flight = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        _ACTIVE.clear()
        _ACTIVE[key] = (cfg, in_flight)
    return _ACTIVE[key][0]


def active() -> CacheConfig | None:
    from vllm.config import get_current_vllm_config_or_none
    current = get_current_vllm_config_or_none()
    if current is not None:
        return from_vllm_config(current)
    return next(iter(_ACTIVE.values()))[0] if _ACTIVE else None


def in_flight_tokens() -> int:
    active()
    return next(iter(_ACTIVE.values()))[1] if _ACTIVE else 0


def current_vllm_config():
    from vllm.config import get_current_vllm_config_or_none
    return get_current_vllm_config_or_none()


_RINGS: list = []  # this process's FloatRings (one engine per process): which float ring each request uses


def float_rings(capacity: int):
    """The process's ``engine_pages.FloatRings`` (made at the first call, with ``capacity`` rings)."""
    from ...engine_pages import FloatRings
    if not _RINGS:
        _RINGS.append(FloatRings(capacity))
    return _RINGS[0]


def release_rings(sink_pages: list[int]) -> None:
    """Requests with these sink pages ended (finished, or preempted: they restart on new blocks)."""
    if _RINGS and sink_pages:
        _RINGS[0].release(sink_pages)


def ended_sink_pages(scheduler_output, requests) -> list[int]:
    """The sink pages of the requests that end their float ring with this step's scheduler output: those that
    finished, and those preempted *in this step* (``preempted_req_ids``: the scheduler freed their blocks in the
    same call, and may give the sink page to a new request of this very step, whose ring the builder takes after
    this release). ``requests``: the worker's request states (``block_ids``: the pages they held, still the old
    ones here). Not on resume: by then vLLM may have given the old sink page to another request, whose ring a
    late release would free (issue 41, defect 1: the server died on ``FloatRings: rows ... hold tokens but no
    float ring``)."""
    ended = set(scheduler_output.finished_req_ids)
    ended |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    pages = []
    for req_id in sorted(ended):
        req = requests.get(req_id)
        if req is not None and req.block_ids and req.block_ids[0]:
            pages.append(int(req.block_ids[0][0]))
    return pages


def watch_request_ends() -> None:
    """Wrap the worker's ``GPUModelRunner._update_states`` (the CPU runner's too) once, so that the float rings
    of requests that finish or are preempted go back before the step's metadata is built (``ended_sink_pages``).
    vLLM's builder sees only the scheduled rows, never which requests ended; the scheduler output that this
    method receives says. (A private method of vLLM 0.32, gone from 0.34's runner: the float ring's move into
    vLLM's own pages, freed by vLLM's block pool with the rest, is what replaces this.)"""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    if getattr(GPUModelRunner, "_qsinkkv_watched", False):
        return
    update = GPUModelRunner._update_states

    def _update_states(self, scheduler_output):
        release_rings(ended_sink_pages(scheduler_output, self.requests))
        return update(self, scheduler_output)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._qsinkkv_watched = True
