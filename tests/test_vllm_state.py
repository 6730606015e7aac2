"""The vLLM plugin's float-ring bookkeeping (``qsinkkv.integrations.vllm.state``, no vLLM import): which requests
give their float ring back at which step. Issue 41, defect 1: a preempted request's ring was released when it
*resumed*, by its old sink page, which vLLM had meanwhile given to a new request; the late release freed the new
owner's ring and the server died (``FloatRings: rows ... hold tokens but no float ring``)."""
import random
from types import SimpleNamespace

import torch

from qsinkkv.engine_pages import FloatRings
from qsinkkv.integrations.vllm.state import ended_sink_pages


def out(finished=(), preempted=(), resumed=()):
    """The fields of vLLM's ``SchedulerOutput`` that the wrap reads."""
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def test_the_probe_sequence_keeps_every_ring():
    """A on page 24; A preempted and, in the same step, page 24 given to a new B; A resumed on page 30; both run."""
    rings, requests = FloatRings(2), {}
    rings.rings(torch.tensor([24]), torch.tensor([0]))                       # A's first step
    requests["A"] = SimpleNamespace(block_ids=([24, 25],))
    rings.release(ended_sink_pages(out(preempted=["A"]), requests))          # A preempted: its ring goes back now
    rings.rings(torch.tensor([24]), torch.tensor([0]))                       # B, new, on A's old sink page
    requests["B"] = SimpleNamespace(block_ids=([24],))
    rings.release(ended_sink_pages(out(resumed=["A"]), requests))            # A resumes: nothing is released
    requests["A"] = SimpleNamespace(block_ids=([30],))
    rings.rings(torch.tensor([30]), torch.tensor([0]))
    assert rings.rings(torch.tensor([24, 30]), torch.tensor([100, 5])).unique().numel() == 2
    assert rings.in_use() == 2


def test_random_preemption_and_page_reuse_never_loses_a_ring():
    """A scheduler with a LIFO free list of sink pages (a freed page is the next one given), random arrivals,
    finishes and preemptions (a preempted request restarts from 0 on new pages, maybe in the same step): every
    running request keeps exactly one ring, and a finished or preempted one holds none."""
    for seed in range(20):
        rng = random.Random(seed)
        rings, requests = FloatRings(4), {}
        free = list(range(40, 0, -1))
        running, waiting, held, next_id = {}, [], {}, 0      # running: req -> sink page
        for _ in range(60):
            finished = [r for r in running if held[r] > 3 and rng.random() < 0.15]
            preempted = [r for r in running if r not in finished and rng.random() < 0.1]
            for r in finished + preempted:
                free.append(running.pop(r))
            waiting += preempted
            if len(waiting) + len(running) < 6 and rng.random() < 0.6:
                waiting.append(f"r{next_id}")
                next_id += 1
            resumed = []
            while waiting and len(running) < 4:
                r = waiting.pop(0)
                running[r], held[r] = free.pop(), 0
                resumed += [r] if r in requests else []
            rings.release(ended_sink_pages(out(finished, preempted, resumed), requests))
            for r in finished:
                requests.pop(r, None)
            for r, page in running.items():
                requests[r] = SimpleNamespace(block_ids=([page],))
            rows = list(running)
            if rows:
                got = rings.rings(torch.tensor([running[r] for r in rows]), torch.tensor([held[r] for r in rows]))
                assert got.unique().numel() == len(rows)
            for r in rows:
                held[r] += rng.randint(1, 5)
            assert rings.in_use() == len(running), seed
