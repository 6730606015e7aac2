"""A model step's plan: what every layer of the step needs to know, from the lengths alone, made once a step.

A step gives row b ``lens[b]`` new tokens after the ``held[b]`` it holds, either packed (vLLM's layout: q, k, v
``[N, heads, D]``, row b's tokens at ``[query_start_loc[b], query_start_loc[b+1])``) or as a padded chunk
(``[B, heads, T, D]``, row b's in its first ``lens[b]`` columns). The plan says how the step runs on every
layer (``step.run``, the one function that runs it):

* which rows decode (``one``: one new token) and which prefill (``multi``: more), rows with none sitting out;
* whether the prefilling rows see just the causal mask (``causal``: they hold and bring at most S + W tokens
  in all, so no token they see has left the window) and whether any holds a token already (``multi_held``);
* where every new token is written (``write``: ``write.WritePlan`` over the step's tokens as ``step.tokens``
  lays them out: the sink rows, the float-ring rows, the blocks that complete);
* whether it is a plain decode step (``decoding``: every row one new token past its sinks; an engine's fused
  step kernel serves it, ``Ops.engine_decode``) and which rows start a sequence (``starting``: an engine zeroes
  their pages first).

The plan holds no layer's tensor and no block table: those are the storage records' (a cache's block manager
fills every layer's with the same tables; an engine's are ``engine_pages.step_tables``, made once a step), read
by the ops. A pure function of ints, memoized as ``write.plan`` is: a cache asks at every layer of a step and
gets the plan its first layer made; an engine makes one per step (``engine_pages.EngineStep``).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import write
from .layout import WindowLayout


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's plan (see the module): host values only, shared by every layer and every caller that asks with
    the same lengths -- read-only (``held`` and ``query_start_loc`` are never written in place)."""
    held: Tensor                    # [B] host int64: tokens each row holds before the step
    lens: tuple[int, ...]           # [B] new tokens per row
    query_start_loc: Tensor | None  # [B + 1] host int64: a packed step's row offsets (None: a padded chunk)
    chunk_tokens: int | None        # T of a padded chunk (None: a packed step)
    one: list[int]                  # the rows with one new token (they decode), ascending
    multi: list[int]                # the rows with more (they prefill), ascending
    write: write.WritePlan          # where every new token goes, over the tokens as ``step.tokens`` lays them out
    causal: bool                    # every row of ``multi`` holds and brings at most S + W tokens in all
    multi_held: bool                # some row of ``multi`` already holds a token (its prefill reads stored ones)
    decoding: bool                  # every row one new token, past its sinks
    starting: list[int]             # the rows that hold no token before the step

    @property
    def packed(self) -> bool:
        return self.query_start_loc is not None

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @property
    def uniform(self) -> bool:
        """A padded chunk whose every row brings all its T columns (its values checked a tensor at a time)."""
        return not self.packed and all(t == self.chunk_tokens for t in self.lens)

    @property
    def multi_lens(self) -> list[int]:
        """The new tokens of each row of ``multi``."""
        return [self.lens[b] for b in self.multi]


def packed(layout: WindowLayout, held: Tensor, lens: list[int] | tuple[int, ...]) -> StepPlan:
    """The plan of a packed step: ``held [B]`` host int64, ``lens`` B ints (row b's tokens follow row b-1's)."""
    return _plan(layout, tuple(held.tolist()), tuple(lens), None)


def padded(layout: WindowLayout, held: Tensor, lens: list[int] | tuple[int, ...], chunk_tokens: int) -> StepPlan:
    """The plan of a padded chunk of ``chunk_tokens`` columns: ``held [B]`` host int64, ``lens`` B ints."""
    return _plan(layout, tuple(held.tolist()), tuple(lens), chunk_tokens)


@functools.lru_cache(maxsize=16)
def _plan(layout: WindowLayout, held: tuple[int, ...], lens: tuple[int, ...], chunk_tokens: int | None) -> StepPlan:
    one = [b for b, t in enumerate(lens) if t == 1]
    multi = [b for b, t in enumerate(lens) if t > 1]
    if chunk_tokens is None:  # the tokens where they lie: rows in token order, each at its offset
        offsets = list(itertools.accumulate(lens, initial=0))
        qsl = torch.tensor(offsets, dtype=torch.int64)
        rows = [b for b, t in enumerate(lens) if t]
        starts = [offsets[b] for b in rows]
    else:  # the one-token rows' tokens, then the longer rows padded to their longest (step.tokens)
        qsl = None
        longest = max((lens[b] for b in multi), default=0)
        rows = one + multi
        starts = list(range(len(one))) + [len(one) + i * longest for i in range(len(multi))]
    S = layout.sink_tokens
    return StepPlan(
        held=torch.tensor(held, dtype=torch.int64), lens=lens, query_start_loc=qsl, chunk_tokens=chunk_tokens,
        one=one, multi=multi,
        write=write.plan(layout, tuple(held[b] for b in rows), tuple(lens[b] for b in rows), tuple(starts),
                         tuple(rows)),
        causal=all(held[b] + lens[b] <= S + layout.recent_tokens for b in multi),
        multi_held=any(held[b] for b in multi),
        decoding=all(t == 1 for t in lens) and all(n >= max(S, 1) for n in held),
        starting=[b for b, n in enumerate(held) if not n])
