"""``qsinkkv-eval frontier`` and ``tune``: bytes against error, for the cache a user would pick.

``frontier`` sweeps qsinkkv configurations (a grid over bits, block size, value group, residual
tokens and sink tokens, ``calibrate``'s recommendation among them) and the baselines, all on the
same text and at the same capacity C (default: the whole text), and reports for each point:

* ``memory``: the bytes its real cache holds at capacity C (``footprint.py``), per token and as
  a fraction of a bf16 cache of the same capacity;
* ``kl``: mean per-token KL from the bf16 cache that sees every token (one reference for every
  point, so points with other sinks or windows compare), and ``ppl``;
* ``pareto``: no other point has fewer-or-equal bytes and less-or-equal KL (one of them strictly).

``tune`` measures the grid's configurations whose bytes fit a budget and returns the one with the
least KL, as the ``CacheConfig`` line to paste.

Every point is one decode-time replay (``replay.py``); a qsinkkv configuration's stored values
come from a real ``SinkQuantCache`` of that configuration (``schemes.config_view``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from qsinkkv import CacheConfig

from . import footprint, replay
from .progress import bar
from .schemes import REFERENCE, Scheme, cache_config, config_view, schemes_for, store_of

CALIBRATE = "calibrate"  # in a grid's sinks: calibrate's recommended sink_tokens for the model and text
GRID_KEYS = dict(bits="bits", block="block_size", group="value_group_size", residual="residual_tokens",
                 sinks="sink_tokens")
PRESETS = {
    # the default: 2 x 2 x 2 x 3 x 2 = 48 grid configurations, plus the baselines
    "small": dict(bits=[8, 4], block=[32, 64], group=[32, 64], residual=[0, 64, 128], sinks=[CALIBRATE, 4]),
    "large": dict(bits=[8, 4], block=[16, 32, 64, 128], group=[16, 32, 64], residual=[0, 32, 64, 128, 256],
                  sinks=[0, CALIBRATE, 2, 4, 8]),
}
GRID_HELP = ("a preset (small: the default; large) or KEY=V1,V2 items with KEY in bits, block, group, residual, "
             f"sinks (the others from small), e.g. bits=4 block=32,64 sinks={CALIBRATE},4")


def parse_grid(items: list[str]) -> dict[str, list]:
    """``--grid``: one preset name, or ``KEY=V1,V2`` items (keys left out come from ``small``).
    Raises ValueError naming ``--grid``."""
    if len(items) == 1 and items[0] in PRESETS:
        return {k: list(v) for k, v in PRESETS[items[0]].items()}
    grid = {k: list(v) for k, v in PRESETS["small"].items()}
    seen = set()
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or key not in GRID_KEYS or not values:
            raise ValueError(f"--grid {item!r}: expected {GRID_HELP}")
        if key in seen:
            raise ValueError(f"--grid: {key} is given twice")
        seen.add(key)
        out = []
        for v in values.split(","):
            if key == "sinks" and v == CALIBRATE:
                out.append(CALIBRATE)
            elif re.fullmatch(r"\d+", v):
                out.append(int(v))
            else:
                raise ValueError(f"--grid {key}: {v!r} is not a non-negative int"
                                 + (f" (or {CALIBRATE})" if key == "sinks" else ""))
        grid[key] = list(dict.fromkeys(out))  # in order, once
    for b in grid["bits"]:
        if b not in (8, 4):
            raise ValueError(f"--grid bits must be 8 and/or 4, got {b}")
    for key in ("block", "group"):
        if 0 in grid[key]:
            raise ValueError(f"--grid {key} must be >= 1, got 0")
    return grid


def grid_configs(grid: dict[str, list], sinks: list[int], capacity: int, head_dim: int,
                 positions: str = "absolute") -> list[CacheConfig]:
    """Every configuration of ``grid`` at ``capacity`` (recent_tokens = capacity - sinks), with the
    grid's sinks resolved to ``sinks``. Raises ValueError naming ``--grid`` for one that cannot be."""
    out = []
    for S in sinks:
        if S >= capacity:
            raise ValueError(f"--grid sinks {S} must be < the capacity ({capacity})")
        for bits in grid["bits"]:
            for bs in grid["block"]:
                for g in grid["group"]:
                    for R in grid["residual"]:
                        if R > capacity - S:
                            raise ValueError(f"--grid residual {R} must be <= the recent tokens, capacity {capacity} "
                                             f"- sinks {S} = {capacity - S}")
                        try:
                            c = CacheConfig(sink_tokens=S, recent_tokens=capacity - S, bits=bits, block_size=bs,
                                            value_group_size=g, residual_tokens=R, positions=positions)
                            c.check_head_dim(head_dim)
                        except ValueError as e:
                            raise ValueError(f"--grid bits={bits} block={bs} group={g}: {e}") from None
                        out.append(c)
    return list(dict.fromkeys(out))


def config_name(c: CacheConfig) -> str:
    return f"int{c.bits} S{c.sink_tokens} b{c.block_size} g{c.value_group_size} r{c.residual_tokens}"


def config_line(c: CacheConfig) -> str:
    """The ``CacheConfig(...)`` to paste (fields at their defaults left out, sizes always written)."""
    keep = ("sink_tokens", "recent_tokens", "bits", "block_size", "value_group_size", "residual_tokens")
    args = [f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(c)
            if f.name in keep or getattr(c, f.name) != f.default]
    return f"CacheConfig({', '.join(args)})"


@dataclass(frozen=True)
class Candidate:
    """One point: a qsinkkv configuration (``config``; KIVI and ``group`` are ones too) or a baseline
    ``scheme`` that is not (bf16, per-tensor, bitsandbytes, quanto)."""
    name: str
    config: CacheConfig | None = None
    scheme: Scheme | None = None
    ours: bool = False      # a grid configuration (what tune chooses among)
    baseline: bool = False  # a scheme of the other tables that is not ours (bf16, per-tensor, bnb, kivi, ...)


def candidates(configs: list[CacheConfig], baselines: list[Scheme], sink_tokens: int, capacity: int,
               positions: str) -> list[Candidate]:
    """The grid's configurations and the baselines, each configuration once: a baseline that is a
    qsinkkv configuration of the grid keeps its scheme name and counts as ours."""
    out: dict = {}
    for s in baselines:
        c = cache_config(s, sink_tokens, capacity)
        if c is not None:
            c = dataclasses.replace(c, positions=positions)
        out[c if c is not None else s.name] = Candidate(s.name, c, None if c is not None else s,
                                                        baseline=s.family != "qsinkkv")
    for c in configs:
        prev = out.get(c)
        out[c] = dataclasses.replace(prev, ours=True) if prev else Candidate(config_name(c), c, ours=True)
    return list(out.values())


def measure(model, ids, points: list[Candidate], sink_tokens: int, capacity: int, positions: str,
            desc: str = "frontier") -> list[dict]:
    """KL (from the bf16 cache that sees every token, same contract), perplexity and bytes of every point."""
    from .ppl import _quanto_stream, quanto_skip

    T = ids.shape[1]
    geo = footprint.Geometry.of(model, tokens=T)
    rotary = replay.positions_rotary(model, positions)
    with replay.replay(store_of(REFERENCE), 0, T, rotary=rotary):
        ref_logp, _, ref_rows = replay.token_logprobs(model, ids, keep_rows=True)
    ref_nll = -ref_logp.mean().item()
    rows = []
    for p in bar(points, desc):
        row = dict(name=p.name, ours=p.ours, baseline=p.baseline,
                   config=None if p.config is None else _config_dict(p.config),
                   config_line=None if p.config is None else config_line(p.config))
        scheme = p.scheme
        if scheme is not None and not scheme.available():
            rows.append(dict(row, status=f"skipped: {scheme.requires} is not installed"))
            continue
        if scheme is not None and scheme.family == "quanto":
            skip = quanto_skip(capacity, T, rotary, geo)
            if skip:
                rows.append(dict(row, status=skip))
                continue
        if p.config is not None:
            c = p.config
            S, W = c.sink_tokens, c.recent_tokens
            memory = footprint.of_config(c, geo)
            def store(layer, k, v, sinks, c=c):  # sinks: 0 on a trained window layer
                return config_view(k, v, dataclasses.replace(c, sink_tokens=sinks))
        else:
            S, W = sink_tokens, capacity - sink_tokens  # the visible set; bf16_sinks says how the sinks are stored
            memory = footprint.of_scheme(scheme, geo, sink_tokens, capacity)
            store = store_of(scheme)
        if scheme is not None and scheme.family == "quanto":
            logp, kl = _quanto_stream(model, ids, ref_rows)
        elif scheme is not None and scheme.family == "bf16" and capacity >= T:
            logp, kl = ref_logp, ref_logp * 0  # the reference itself
        else:
            with replay.replay(store, S, W, rotary=rotary):
                logp, kl, _ = replay.token_logprobs(model, ids, ref_rows=ref_rows)
        nll = -logp.mean().item()
        rows.append(dict(row, status="ok", memory=memory.to_dict(), kl=kl.mean().item(), ppl=math.exp(nll),
                         delta_pct=100 * math.expm1(nll - ref_nll)))
    mark_pareto(rows)
    return rows


def _config_dict(c: CacheConfig) -> dict:
    return {f.name: getattr(c, f.name) if not f.name.endswith("dtype") else str(getattr(c, f.name))
            for f in dataclasses.fields(c)}


def bytes_of(row: dict) -> float:
    return row["memory"]["bytes_per_token"]


def mark_pareto(rows: list[dict]) -> None:
    """``row["pareto"]``: no other measured point has <= bytes and <= KL, one of them strictly."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["pareto"] = not any(bytes_of(o) <= bytes_of(r) and o["kl"] <= r["kl"]
                              and (bytes_of(o) < bytes_of(r) or o["kl"] < r["kl"]) for o in ok)


def at_equal_bytes(rows: list[dict]) -> list[dict]:
    """For each measured baseline (bf16 aside): the grid configuration with the least KL among those
    holding no more bytes than it, and the grid configuration closest to its bytes."""
    ours = [r for r in rows if r["status"] == "ok" and r["ours"]]
    out = []
    for b in rows:
        if b["status"] != "ok" or not b["baseline"] or b["name"] == REFERENCE.name:
            continue
        fits = [r for r in ours if bytes_of(r) <= bytes_of(b) and r is not b]
        best = min(fits, key=lambda r: (r["kl"], bytes_of(r))) if fits else None
        near = min((r for r in ours if r is not b), key=lambda r: (abs(bytes_of(r) - bytes_of(b)), r["kl"]),
                   default=None)
        out.append(dict(baseline=b["name"], bytes_per_token=bytes_of(b), kl=b["kl"], ppl=b["ppl"],
                        best=None if best is None else best["name"], best_bytes_per_token=best and bytes_of(best),
                        best_kl=best and best["kl"], best_ppl=best and best["ppl"],
                        nearest=None if near is None else near["name"], nearest_bytes_per_token=near and bytes_of(near),
                        nearest_kl=near and near["kl"], nearest_ppl=near and near["ppl"]))
    return out


def frontier_baselines(bits: list[int], only: list[str] | None) -> list[Scheme]:
    """bf16 and every scheme at ``bits`` (``only``: those names; bf16 always)."""
    return [REFERENCE] + [s for b in bits for s in schemes_for(b) if only is None or s.name in only]


# --- tune -----------------------------------------------------------------------------------------

def format_bytes(x: float) -> str:
    """Bytes as asked: ``6,912`` for a whole number, ``1.5`` for 1.5 (never rounded to a whole byte)."""
    return f"{x:,.6f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class Budget:
    """``--budget``: a fraction of the bf16 cache's bytes (``0.30``, ``30%``) or bytes per token
    (``7000``, ``7000B``: any plain number above 1)."""
    text: str
    fraction: float | None = None
    bytes_per_token: float | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|B)?\s*", text)
        expected = ("a fraction of the bf16 cache's bytes in (0, 1] (e.g. 0.30 or 30%) or bytes per token "
                    "above 1 (e.g. 7000 or 7000B)")
        if not m or float(m.group(1)) <= 0:
            raise ValueError(f"--budget must be {expected}, got {text!r}")
        value, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            if value > 100:
                raise ValueError(f"--budget must be {expected}, got {text!r} (more than the bf16 cache)")
            return cls(text, fraction=value / 100)
        if unit == "B" or value > 1:
            return cls(text, bytes_per_token=value)
        return cls(text, fraction=value)

    def limit(self, geo: footprint.Geometry) -> float:
        """Bytes per token allowed."""
        return self.bytes_per_token if self.fraction is None else self.fraction * geo.bf16_bytes_per_token

    def describe(self, geo: footprint.Geometry) -> str:
        limit = self.limit(geo)
        return f"{format_bytes(limit)} bytes/token ({limit / geo.bf16_bytes_per_token:.3f} of bf16)"

    def fits(self, memory: footprint.Footprint) -> bool:
        return memory.per_token <= self.bytes_per_token if self.fraction is None else \
            memory.fraction <= self.fraction


def check_budget(configs: list[CacheConfig], budget: Budget, geo: footprint.Geometry, capacity: int
                 ) -> list[CacheConfig]:
    """The configurations whose real cache fits ``budget``; a ValueError naming ``--budget`` when none does."""
    sized = [(c, footprint.of_config(c, geo)) for c in configs]
    within = [c for c, m in sized if budget.fits(m)]
    if not within:
        smallest_config, smallest = min(sized, key=lambda cm: cm[1].total)
        raise ValueError(f"--budget {budget.text}: no configuration of the grid fits {budget.describe(geo)} at "
                         f"capacity {capacity}; the smallest, {config_name(smallest_config)}, holds "
                         f"{smallest.per_token:,.0f} bytes/token ({smallest.fraction:.3f} of bf16): raise the "
                         "budget, widen --grid (e.g. bits=4, larger block and group, residual=0) or raise the "
                         "capacity (the bf16 filling block is a smaller share of a larger cache)")
    return within


def tune(model, ids, configs: list[CacheConfig], budget: Budget, capacity: int, positions: str) -> dict:
    """Measure the configurations whose bytes fit ``budget``; the least KL among them (ties: fewer bytes)."""
    geo = footprint.Geometry.of(model, tokens=int(ids.shape[1]))
    within = check_budget(configs, budget, geo, capacity)
    points = [Candidate(config_name(c), c, ours=True) for c in within]
    rows = measure(model, ids, points, 0, capacity, positions, desc="tune")
    ok = [r for r in rows if r["status"] == "ok"]
    best = min(ok, key=lambda r: (r["kl"], bytes_of(r)))
    return dict(budget=dict(text=budget.text, fraction=budget.fraction, bytes_per_token=budget.bytes_per_token,
                            limit_bytes_per_token=budget.limit(geo)),
                bf16_bytes_per_token=geo.bf16_bytes_per_token, considered=len(configs), within=len(within),
                best=best, config_line=best["config_line"], rows=rows)
