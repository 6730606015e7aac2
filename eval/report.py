"""Markdown tables and PNG plots of the subcommands' results (``results.json`` holds every number)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path


def _f(x, fmt="{:.4f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# allocated: what the real cache holds (ring slots, the bf16 filling block); ideal: exactly the tokens held in
# the cache's formats (footprint.py); x bf16: allocated against a bf16 cache of the same tokens
MEMORY_HEAD = ["allocated bytes/token", "ideal bytes/token", "x bf16 (allocated)"]


def _kl(x) -> str:
    """KL per token: 4 decimals, or 2 significant digits below 1e-3 (int8's 4e-5 is not 0.0000)."""
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def _memory(m: dict | None) -> list[str]:
    """Allocated and ideal bytes per token and the allocated fraction of bf16's, from a
    ``footprint.Footprint.to_dict()``."""
    if not m:
        return ["-"] * len(MEMORY_HEAD)
    return [f"{m['bytes_per_token']:,.0f}", f"{m.get('ideal_bytes_per_token', m['bytes_per_token']):,.0f}",
            f"{m['bf16_fraction']:.3f}"]


MEMORY_WORDS = ("Allocated bytes/token: what each scheme's real cache allocates for {held} (sinks, codes, "
                "scales, and the bf16 float ring in whole blocks: the filling block and any residual; all layers; "
                "`footprint.py`) divided by those tokens. Ideal bytes/token: exactly those tokens in the scheme's "
                "formats, no ring slack and no filling block (equal to allocated for the schemes that store each "
                "token as it comes: bf16, per-tensor, bitsandbytes, quanto). x bf16 (allocated): allocated against "
                "a bf16 cache of the same tokens.")


def _memory_note(capacity) -> str:
    """``capacity``: the tokens held (an int) or words saying which."""
    return MEMORY_WORDS.format(held=f"{capacity} tokens" if isinstance(capacity, int) else capacity)


def kv_markdown(r: dict) -> str:
    head = ["scheme", *MEMORY_HEAD, "K rel err", "V rel err", "sink V rel err", "attn out rel err", "attn KL",
            "sink mass", "sink mass shift"]
    rows = [[f"`{o['scheme']}`", *_memory(o.get("memory")), _f(o["k_err"]), _f(o["v_err"]), _f(o["sink_v_err"]),
             _f(o["out_err"]), _f(o["kl"], "{:.5f}"), _f(o["sink_mass"], "{:.3f}"), _f(o["sink_shift"], "{:+.4f}")]
            for o in r["overall"]]
    window = "every earlier token" if r["recent_tokens"] >= r["tokens"] else \
        f"{r['sink_tokens']} sinks + {r['recent_tokens']} recent"
    text = (f"Per-layer error on the model's real q/k/v ({r['tokens']} tokens, queries see {window}; "
            f"first {r['sink_tokens']} tokens are the sinks; positions {r.get('positions', 'absolute')}), "
            f"averaged over layers. {_memory_note(r.get('capacity', r['tokens']))}\n\n" + _table(head, rows))
    if r["skipped"]:
        text += "\n\n" + "\n".join(f"- `{s['scheme']}`: {s['status']}" for s in r["skipped"])
    return text


def ppl_markdown(r: dict) -> str:
    head = ["scheme", "bits", *MEMORY_HEAD, "perplexity", "vs bf16", "mean KL (nats/token)", "what it stores"]
    rows = []
    for o in r["rows"]:
        if o["status"] != "ok":
            rows.append([f"`{o['scheme']}`", str(o["bits"]), *["-"] * (len(MEMORY_HEAD) + 3), o["status"]])
            continue
        rows.append([f"`{o['scheme']}`", str(o["bits"]), *_memory(o.get("memory")), _f(o["ppl"], "{:.3f}"),
                     _f(o["delta_pct"], "{:+.2f}%"), _kl(o["kl"]), o["description"]])
    window = "the whole text visible" if r["sink_tokens"] + r["recent_tokens"] >= r["tokens"] else \
        f"{r['sink_tokens']} sinks + {r['recent_tokens']} recent visible"
    return (f"Perplexity over {r['tokens']} tokens ({window}; positions {r.get('positions', 'absolute')}), each "
            f"token decoded from its scheme's cache. {_memory_note(r.get('capacity', r['tokens']))}\n\n"
            + _table(head, rows))


def stream_markdown(r: dict) -> str:
    if r.get("mode") == "memory_of":
        return memory_markdown(r)
    contracts = r.get("positions", ["absolute"])
    head = ["configuration", *MEMORY_HEAD]
    for c in contracts:
        head += [f"perplexity (all), {c}", f"after the cache fills (position >= {r['capacity']}), {c}"]
    rows = []
    for o in r["rows"]:
        by = o.get("by_positions", {contracts[0]: o})
        row = [o["config"], *_memory(o.get("memory"))]
        for c in contracts:
            row += [_f(by[c]["ppl"], "{:.2f}"), _f(by[c]["after_fill"], "{:.2f}")]
        rows.append(row)
    return (f"{r['tokens']} tokens, capacity {r['capacity']} = {r['sink_tokens']} sinks + {r['recent_tokens']} "
            f"recent (the plain window keeps the newest {r['capacity']}), under the position contract(s) "
            f"{', '.join(contracts)} (cache_index: keys stored pre-RoPE and rotated by their index in the cache, "
            "StreamingLLM's). " + _memory_note("the tokens it holds (the full cache: the whole text; the others: the "
                                                 "capacity)") + "\n\n" + _table(head, rows))


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def memory_budget_table(r: dict, b: dict) -> str:
    """One budget's rows (and the full cache): capacity, bytes, perplexity, gap closed."""
    contracts, F = r["positions"], r["after_fill_from"]
    head = ["configuration", "capacity (sinks + recent)", "allocated bytes", "of the budget",
            "one more block (token) would allocate", "ideal bytes", "allocated bytes/token"]
    for c in contracts:
        head += [f"perplexity (all), {c}", f"after fill (position >= {F}), {c}", f"gap closed (all), {c}",
                 f"gap closed (after fill), {c}"]
    full = r["full"]
    fm = full["memory"]
    cells = ["full cache", f"{full['capacity']:,} (the text)", f"{fm['bytes']:,}", f"{fm['bytes'] / b['bytes']:.3f}",
             "-", f"{fm.get('ideal_bytes', fm['bytes']):,.0f}", f"{fm['bytes_per_token']:,.0f}"]
    for c in contracts:
        cells += [_f(full["by_positions"][c]["ppl"], "{:.2f}"), _f(full["by_positions"][c]["after_fill"], "{:.2f}"),
                  "100%", "100%"]
    rows = [cells]
    for o in b["rows"]:
        m = o["memory"]
        unit = "block" if o["step"] > 1 else "token"
        cells = [o["config"], f"{o['capacity']:,} ({o['sink_tokens']} + {o['recent_tokens']:,})", f"{o['bytes']:,}",
                 f"{o['budget_fraction']:.3f}", f"{o['next_step_bytes']:,} (+1 {unit})",
                 f"{m['ideal_bytes']:,.0f}", f"{m['bytes_per_token']:,.0f}"]
        for c in contracts:
            x = o["by_positions"][c]
            cells += [_f(x["ppl"], "{:.2f}"), _f(x["after_fill"], "{:.2f}"), _pct(x["gap_closed"]),
                      _pct(x["gap_closed_after_fill"])]
        rows.append(cells)
    return _table(head, rows)


def memory_markdown(r: dict) -> str:
    """``stream --memory-of``: one table per budget, then the memory curve (several budgets)."""
    F, T = r["after_fill_from"], r["tokens"]
    block = max(o["step"] for b in r["budgets"] for o in b["rows"])
    lines = [f"Every configuration at the largest capacity whose **allocated** bytes fit each budget "
             f"(`--memory-of {r['memory_of']}`: the K and V of that many tokens in that dtype, all layers), "
             f"{T:,} tokens, {r['sink_tokens']} sinks, positions {', '.join(r['positions'])}. Allocated bytes: "
             "what the real cache allocates at that capacity, read off the storage's own allocation on the meta "
             "device and checked against a real cache's `nbytes()`: for sinks + int8/int4, qsinkkv's ring "
             f"(block {block}: the recent window steps in whole blocks, the bf16 filling block included); for the bf16 "
             "windows, a bf16 K/V tensor of exactly the capacity (transformers' `DynamicLayer`), which steps in "
             "tokens. Ideal bytes: exactly the capacity's tokens in the cache's formats, no ring slack and no "
             "filling block. \"One more block (token)\" is what the next capacity step would allocate: over the "
             f"budget. Perplexity (all): every prediction of the text. **After fill: the predictions at positions "
             f">= {F:,}, the largest capacity of any row of this run, so every row, at every budget, is scored on "
             f"the same {T - 1 - F:,} predictions with its cache full.** Gap closed: of the perplexity gap between "
             f"`{r['gap_base']}` at the same memory and the full cache, the share a row closes (negative: worse "
             "than that window). The full cache holds the whole text: its bytes are given against the budget."]
    for b in r["budgets"]:
        ring = b.get("bf16_ring")
        note = "" if not ring else (f" qsinkkv's own bf16 ring (`bits=16`, block {ring['step']}: whole blocks plus the "
                                    f"filling block) would fit capacity {ring['capacity']:,} ({ring['bytes']:,} "
                                    "bytes) in this budget.")
        lines += [f"\n**At the memory of `{b['text']}`: {b['bytes']:,} bytes ({b['bytes'] / 1e6:.2f} MB).**{note}\n",
                  memory_budget_table(r, b)]
    if len(r["budgets"]) > 1:
        for c in r["positions"]:
            names = [o["config"] for o in r["budgets"][0]["rows"]]
            head = ["budget", "bytes"] + [f"{n}: capacity, after fill" for n in names]
            rows = [[f"`{b['text']}`", f"{b['bytes']:,}"]
                    + [f"{o['capacity']:,}, {_f(o['by_positions'][c]['after_fill'], '{:.2f}')}" for o in b["rows"]]
                    for b in r["budgets"]]
            full = r["full"]["by_positions"][c]["after_fill"]
            lines += [f"\nThe memory curve, {c} (after fill: positions >= {F:,}; the full cache: {full:.2f} at "
                      f"{r['full']['memory']['bytes']:,} bytes):\n", _table(head, rows)]
        lines.append("\n![memory curve](stream-memory.png)")
    return "\n".join(lines)


def calibrate_markdown(r: dict) -> str:
    lines = [f"Recommended `sink_tokens`: **{r['recommended_sink_tokens']}** (sink positions: "
             f"{r['sink_positions'] or 'none'}; a sink draws >= 10x a uniform share of the mass, "
             f"{r['uniform_share']:.4f}, averaged over layers and heads, from queries at {r['positions']} or later)."]
    head = ["first k positions", "1", "2", "4", "8", "16"]
    cm = r["cumulative_mass"]
    lines.append("\n" + _table(head, [["mean attention mass"] + [f"{cm[k - 1]:.3f}" for k in (1, 2, 4, 8, 16)]]))
    vr = r["value_norm_ratio"]
    med = statistics.median(x[0] for x in vr)
    lines.append(f"\nValue norm of position 0 / the layer's median value norm: median over layers {med:.2f} "
                 f"(min {min(x[0] for x in vr):.2f}, max {max(x[0] for x in vr):.2f}).")
    hh = r["heavy_hitters"]
    if hh:
        by_pos: dict[int, list] = {}
        for h in hh:
            by_pos.setdefault(h["position"], []).append(h)
        lines.append(f"\n{len(hh)} heads park >= 0.1 of their mass on a later position more than on the sinks "
                     "(a windowed cache will evict it):\n")
        lines.append(_table(["position", "token", "heads (layer.head)", "max mass"], [
            [str(p), f"`{(hs[0]['token'] or '').strip() or repr(hs[0]['token'])}`",
             ", ".join(f"{h['layer']}.{h['head']}" for h in hs[:12]) + (" ..." if len(hs) > 12 else ""),
             f"{max(h['mass'] for h in hs):.3f}"] for p, hs in sorted(by_pos.items())]))
    else:
        lines.append("\nNo head parks its mass on a later position instead of the sinks.")
    lines += [f"\n**Warning:** {w}" for w in r["warnings"]]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_kv(r: dict, path: Path) -> None:
    plt = _plt()
    bits = sorted({o["bits"] for o in r["overall"] if o["bits"] != 16}, reverse=True)
    fig, axes = plt.subplots(2, len(bits), figsize=(6 * len(bits), 7), squeeze=False)
    for c, b in enumerate(bits):
        for o in r["overall"]:
            if o["bits"] != b:
                continue
            layer = r["per_layer"][o["scheme"]]
            style = "-" if o["scheme"].startswith(("qsinkkv", "group")) else "--"
            axes[0][c].plot(layer["out_err"], style, label=o["scheme"])
            axes[1][c].plot(layer["sink_shift"], style, label=o["scheme"])
        axes[0][c].set(title=f"int{b}: attention-output relative error", xlabel="layer", yscale="log")
        axes[1][c].set(title=f"int{b}: shift of attention mass on the sinks", xlabel="layer")
        axes[0][c].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ppl(r: dict, path: Path) -> None:
    plt = _plt()
    ok = [o for o in r["rows"] if o["status"] == "ok" and o["scheme"] != "bf16"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(ok) + 1.5))
    ax.barh([o["scheme"] for o in ok], [o["delta_pct"] for o in ok],
            color=["tab:green" if o["scheme"].startswith("qsinkkv") else "tab:gray" for o in ok])
    ax.set_xscale("symlog", linthresh=1)
    ax.invert_yaxis()
    ax.set(xlabel="perplexity vs the bf16 cache (%)", title=f"perplexity increase, {r['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stream(r: dict, path: Path) -> None:
    if r.get("mode") == "memory_of":
        plot_memory(r, path)
        if len(r["budgets"]) > 1:
            plot_memory_curve(r, path.with_name("stream-memory.png"))
        return
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in r["curves"].items():
        ax.plot(c["position"], c["ppl"], "--" if name.endswith("]") else "-", label=name)
    ax.axvline(r["capacity"], color="k", lw=0.6, ls=":")
    ax.set(xlabel="position", ylabel=f"perplexity over {r['window']}-token windows", yscale="log",
           title=f"streaming with capacity {r['capacity']} ({r['sink_tokens']} sinks + {r['recent_tokens']} recent)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panels(plt, n: int):
    """(figure, axes [rows, cols]) for ``n`` panels, two a row."""
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    return plt.subplots(rows, cols, figsize=(8 * cols, 4.8 * rows), squeeze=False)


def _save_panels(fig, axes, n: int, path: Path) -> None:
    """The first ``n`` panels drawn, the rest blank; written to ``path``."""
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def plot_memory(r: dict, path: Path) -> None:
    """Perplexity against position at equal memory: one panel per budget."""
    plt = _plt()
    n = len(r["budgets"])
    fig, axes = _panels(plt, n)
    for ax, b in zip(axes.flat, r["budgets"]):
        for c in r["positions"]:
            ls = "-" if c == r["positions"][0] else "--"
            curve = r["full"]["curves"][c]
            ax.plot(curve["position"], curve["ppl"], ls, color="k", lw=1, label=f"full cache [{c}]")
            for i, o in enumerate(b["rows"]):
                curve = o["curves"][c]
                ax.plot(curve["position"], curve["ppl"], ls, color=f"C{i}",
                        label=f"{o['config']}, capacity {o['capacity']:,} [{c}]")
        ax.axvline(r["after_fill_from"], color="k", lw=0.6, ls=":")
        ax.set(xlabel="position", ylabel=f"perplexity over {r['window']}-token windows", yscale="log",
               title=f"at the memory of {b['text']} ({b['bytes'] / 1e6:.2f} MB); after fill from "
                     f"{r['after_fill_from']:,} (dotted)")
        ax.legend(fontsize=7)
    _save_panels(fig, axes, n, path)


def plot_memory_curve(r: dict, path: Path) -> None:
    """Quality against memory per sequence, per configuration; the full cache as a line."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    names = [o["config"] for o in r["budgets"][0]["rows"]]
    for ax, key, what in ((axes[0], "ppl", "perplexity (all predictions)"),
                          (axes[1], "after_fill", f"perplexity after fill (positions >= {r['after_fill_from']:,})")):
        for c in r["positions"]:
            ls = "-" if c == r["positions"][0] else "--"
            for i, name in enumerate(names):
                rows = [next(o for o in b["rows"] if o["config"] == name) for b in r["budgets"]]
                ax.plot([o["bytes"] / 1e6 for o in rows], [o["by_positions"][c][key] for o in rows], ls, marker="o",
                        color=f"C{i}", label=f"{name} [{c}]")
            full = r["full"]
            ax.axhline(full["by_positions"][c][key], color="k", lw=1, ls=ls,
                       label=f"full cache, {full['memory']['bytes'] / 1e6:.0f} MB [{c}]")
        ax.set(xscale="log", yscale="log", xlabel="allocated KV bytes per sequence (MB, all layers)", ylabel=what,
               title=f"{what} against memory, {r['tokens']:,} tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_calibrate(r: dict, path: Path) -> None:
    plt = _plt()
    import numpy as np

    mass = np.array(r["first_mass"]).mean(1)  # [L, F] over heads
    fig, ax = plt.subplots(figsize=(8, 6))
    im = ax.imshow(mass, aspect="auto", cmap="viridis")
    ax.set(xlabel="position", ylabel="layer", title="mean attention mass on the first positions (over heads)")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- frontier and tune ---------------------------------------------------------------------------

def _config_cells(o: dict) -> list[str]:
    c = o.get("config")
    if not c:
        return ["-"] * 5
    return [str(c["bits"]), str(c["sink_tokens"]), str(c["block_size"]), str(c["value_group_size"]),
            str(c["residual_tokens"])]


def _point_rows(rows: list[dict], mark: bool = True) -> list[list[str]]:
    out = []
    ok = sorted((o for o in rows if o["status"] == "ok"), key=lambda o: (o["memory"]["bytes_per_token"], o["kl"]))
    for o in ok:
        name = f"`{o['name']}`" + (" (= a grid config)" if o["ours"] and o["baseline"] else "")
        out.append([f"**{name}**" if mark and o.get("pareto") else name, *_config_cells(o), *_memory(o["memory"]),
                    _kl(o["kl"]), _f(o["ppl"], "{:.3f}"), _f(o["delta_pct"], "{:+.2f}%"),
                    "yes" if o.get("pareto") else ""])
    return out


POINT_HEAD = ["configuration", "bits", "sinks", "block", "group", "residual", *MEMORY_HEAD, "KL (nats/token)",
              "perplexity", "vs bf16", "on the frontier"]


def _setting(r: dict) -> str:
    visible = "every token visible" if r["capacity"] >= r["tokens"] else f"capacity {r['capacity']}"
    cal = "" if r.get("calibrated_sink_tokens") is None else \
        f"; `calibrate` recommends sink_tokens={r['calibrated_sink_tokens']}"
    return (f"{r['tokens']} tokens, {visible}, positions {r['positions']}{cal}. KL: mean per-token KL from the bf16 "
            f"cache that sees every token. A bf16 cache holds {r['bf16_bytes_per_token']:,} bytes/token. "
            f"{_memory_note(r['capacity'])}")


def frontier_markdown(r: dict) -> str:
    lines = [_setting(r) + " Sorted by bytes; in bold, the points on the Pareto frontier (no other point has "
             "fewer-or-equal bytes and less-or-equal KL). Configurations are named int{bits} S{sinks} b{block} "
             "g{group} r{residual}.\n", _table(POINT_HEAD, _point_rows(r["rows"]))]
    skipped = [o for o in r["rows"] if o["status"] != "ok"]
    if skipped:
        lines.append("\n" + "\n".join(f"- `{o['name']}`: {o['status']}" for o in skipped))
    if r.get("equal_bytes"):
        head = ["baseline", "allocated bytes/token", "KL", "best grid config within its allocated bytes",
                "allocated bytes/token", "KL", "grid config nearest its allocated bytes", "allocated bytes/token", "KL"]
        rows = [[f"`{e['baseline']}`", f"{e['bytes_per_token']:,.0f}", _kl(e["kl"]),
                 f"`{e['best']}`" if e["best"] else "none fits",
                 _f(e["best_bytes_per_token"], "{:,.0f}"), _kl(e["best_kl"]),
                 f"`{e['nearest']}`" if e["nearest"] else "-", _f(e["nearest_bytes_per_token"], "{:,.0f}"),
                 _kl(e["nearest_kl"])] for e in r["equal_bytes"]]
        lines += ["\nAt equal bytes: each baseline against the grid's configurations.\n", _table(head, rows)]
    return "\n".join(lines)


def tune_summary(r: dict) -> str:
    b, m = r["best"], r["best"]["memory"]
    from .frontier import format_bytes

    limit = format_bytes(r["budget"]["limit_bytes_per_token"])
    return (f"budget {r['budget']['text']}: {limit} bytes/token at capacity "
            f"{r['capacity']}; {r['within']} of {r['considered']} configurations fit, least KL:\n"
            f"    {r['config_line']}\n"
            f"    {m['bytes_per_token']:,.0f} bytes/token ({m['bf16_fraction']:.3f} of bf16), KL {_kl(b['kl'])} "
            f"nats/token, perplexity {b['ppl']:.3f} ({b['delta_pct']:+.2f}% vs bf16), on {r['tokens']} tokens, "
            f"positions {r['positions']}")


def tune_markdown(r: dict) -> str:
    from .frontier import format_bytes

    return "\n".join([
        f"Budget `{r['budget']['text']}`: {format_bytes(r['budget']['limit_bytes_per_token'])} bytes/token. "
        f"{r['within']} of the grid's {r['considered']} configurations fit it and were measured. " + _setting(r),
        "\nThe least KL within the budget (paste):\n", "```python", r["config_line"], "```\n",
        _table(POINT_HEAD, _point_rows(r["rows"], mark=False))])


def plot_frontier(r: dict, path: Path, budget: float | None = None) -> None:
    plt = _plt()
    ok = [o for o in r["rows"] if o["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    floor = min([o["kl"] for o in ok if o["kl"] > 0] or [1e-6]) / 3  # KL 0 (bf16 itself) drawn at the floor
    for ours, color, marker, label in ((True, "tab:green", "o", "qsinkkv configurations"),
                                       (False, "tab:gray", "s", "baselines")):
        pts = [o for o in ok if o["ours"] == ours]
        ax.scatter([o["memory"]["bytes_per_token"] for o in pts], [max(o["kl"], floor) for o in pts], c=color,
                   marker=marker, s=22, alpha=0.75, label=label)
    front = sorted((o for o in ok if o.get("pareto")), key=lambda o: o["memory"]["bytes_per_token"])
    ax.step([o["memory"]["bytes_per_token"] for o in front], [max(o["kl"], floor) for o in front], "k-", lw=1,
            where="post", label="Pareto frontier")
    for o in front:
        ax.annotate(o["name"], (o["memory"]["bytes_per_token"], max(o["kl"], floor)), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    if budget is not None:
        ax.axvline(budget, color="tab:red", ls=":", label="budget")
    ax.set(xlabel=f"allocated bytes per token at capacity {r['capacity']} (all layers)",
           ylabel="mean KL from the bf16 cache (nats/token)", yscale="log",
           title=f"bytes vs error, {r['tokens']} tokens, positions {r['positions']} (KL 0 drawn at {floor:.1e})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tune(r: dict, path: Path) -> None:
    plot_frontier(r, path, budget=r["budget"]["limit_bytes_per_token"])


# --- recall ----------------------------------------------------------------------------------------------------

def _row_name(o: dict) -> str:
    names = {"window, no sinks": "window, no sinks", "sinks + bf16 window": "{S} sinks + bf16 window",
             "sinks + int8": "{S} sinks + int8 window", "sinks + int4": "{S} sinks + int4 window"}
    return names.get(o["config"], o["config"]).format(S=o["sink_tokens"])


def _hits(cell: dict) -> str:
    return f"{cell['correct']}/{cell['trials']}"


def _far(d) -> str:
    return "-" if d is None else f"{d:,}"


def recall_budget_table(r: dict, b: dict) -> str:
    """One budget: every row's capacity, bytes and correct answers per distance."""
    ds = r["distances"]
    head = ["configuration", "capacity", "allocated KV bytes", *[f"d={d:,}" for d in ds], "farthest recall"]
    full = r["full"]
    longest = full["by_distance"][-1]  # the full cache holds each prompt: its largest
    rows = [["full cache", f"the prompt (<= {longest['capacity']:,})", f"<= {longest['bytes']:,}",
             *[_hits(c) for c in full["by_distance"]], _far(full["farthest"])]]
    for o in b["rows"]:
        rows.append([_row_name(o), f"{o['capacity']:,}", f"{o['bytes']:,}", *[_hits(c) for c in o["by_distance"]],
                     _far(o["farthest"])])
    return _table(head, rows)


def recall_markdown(r: dict) -> str:
    match = f"{r['match']:.0%}"
    out = [f"Pass-key recall: a random {r['digits']}-digit key, stated twice, hidden in the text at each distance "
           f"before the question (distance: tokens from the key's first token to the end of the prompt; prompts of "
           + ", ".join(f"{t:,}" for t in r["prompt_tokens"].values()) + " tokens), "
           f"{r['trials']} prompts per distance, the same for every row; greedy decoding of {r['answer_tokens']} "
           "tokens after one prefill through the real cache; an answer is correct when it contains the key. "
           f"Positions: {r['positions']}. Farthest recall: the largest distance at which the full cache answers and "
           f"the row answers at least {match} as often, as it does at every shorter distance.", ""]
    for b in r["budgets"]:
        what = f"At the memory of {b['text']} ({b['bytes']:,} bytes)" if b["bytes"] else f"At {b['text']}"
        out += [f"**{what}**: correct answers out of {r['trials']}", "", recall_budget_table(r, b), ""]
    if len(r["budgets"]) > 1:
        names = [o["config"] for o in r["budgets"][0]["rows"]]
        head = ["configuration", *[b["text"] for b in r["budgets"]]]
        rows = []
        for name in names:
            cells = []
            for b in r["budgets"]:
                o = next(o for o in b["rows"] if o["config"] == name)
                cells.append(f"{_far(o['farthest'])} (C {o['capacity']:,}, {o['bytes'] / 1e6:.2f} MB)")
            rows.append([_row_name(dict(config=name, sink_tokens=r["sink_tokens"])), *cells])
        out += ["**Farthest recall per budget** (capacity and allocated bytes in brackets); the full cache: "
                f"{_far(r['full']['farthest'])}", "", _table(head, rows), ""]
    return "\n".join(out)


def plot_recall(r: dict, path: Path) -> None:
    """Accuracy against distance, one panel per budget, a dotted line at each row's capacity; with several
    budgets, a last panel: the farthest recall against bytes (the memory curve)."""
    plt = _plt()
    n = len(r["budgets"]) + (len(r["budgets"]) > 1)
    fig, axes = _panels(plt, n)
    ds = r["distances"]
    for ax, b in zip(axes.flat, r["budgets"]):
        ax.plot(ds, [c["accuracy"] for c in r["full"]["by_distance"]], "-o", color="k", lw=1, label="full cache")
        for i, o in enumerate(b["rows"]):
            ax.plot(ds, [c["accuracy"] for c in o["by_distance"]], "-o", color=f"C{i}",
                    label=f"{_row_name(o)}, capacity {o['capacity']:,}")
            ax.axvline(o["capacity"], color=f"C{i}", lw=0.8, ls=":")
        what = f"at the memory of {b['text']} ({b['bytes'] / 1e6:.2f} MB)" if b["bytes"] else b["text"]
        ax.set(xlabel="distance of the key (tokens before the end of the prompt)", ylabel="accuracy",
               ylim=(-0.03, 1.03), title=f"pass-key recall {what}; dotted: each capacity")
        ax.legend(fontsize=7)
    if len(r["budgets"]) > 1:
        ax = list(axes.flat)[len(r["budgets"])]
        for i, name in enumerate(o["config"] for o in r["budgets"][0]["rows"]):
            rows = [next(o for o in b["rows"] if o["config"] == name) for b in r["budgets"]]
            ax.plot([o["bytes"] / 1e6 for o in rows], [o["farthest"] or 0 for o in rows], "-o", color=f"C{i}",
                    label=_row_name(rows[0]))
        if r["full"]["farthest"]:
            ax.axhline(r["full"]["farthest"], color="k", lw=1, label="full cache")
        ax.set(xlabel="allocated KV bytes per sequence (MB, all layers)", ylabel="farthest recall (tokens)",
               title=f"farthest distance answered >= {r['match']:.0%} as often as the full cache (0: none)")
        ax.legend(fontsize=7)
    _save_panels(fig, axes, n, path)


MARKDOWN = dict(kv=kv_markdown, ppl=ppl_markdown, stream=stream_markdown, calibrate=calibrate_markdown,
                frontier=frontier_markdown, tune=tune_markdown, recall=recall_markdown)
PLOTS = dict(kv=plot_kv, ppl=plot_ppl, stream=plot_stream, calibrate=plot_calibrate, frontier=plot_frontier,
             tune=plot_tune, recall=plot_recall)
TITLES = dict(kv="Per-layer error (kv)", ppl="Perplexity (ppl)", stream="Streaming (stream)",
              calibrate="Sinks (calibrate)", frontier="Bytes against error (frontier)",
              tune="The configuration for a budget (tune)", recall="Pass-key recall (recall)")
