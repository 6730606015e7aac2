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


MEMORY_HEAD = ["bytes/token", "x bf16"]


def _kl(x) -> str:
    """KL per token: 4 decimals, or 2 significant digits below 1e-3 (int8's 4e-5 is not 0.0000)."""
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def _memory(m: dict | None) -> list[str]:
    """Bytes per token and the fraction of bf16's, from a ``footprint.Footprint.to_dict()``."""
    if not m:
        return ["-", "-"]
    return [f"{m['bytes_per_token']:,.0f}", f"{m['bf16_fraction']:.3f}"]


def _memory_note(capacity: int) -> str:
    return (f"Bytes per token: what each scheme's real cache holds for {capacity} tokens (sinks, codes, scales, "
            "bf16 filling block and residual, all layers; `footprint.py`) divided by those tokens; x bf16: the "
            "same against a bf16 cache of the same tokens.")


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
            rows.append([f"`{o['scheme']}`", str(o["bits"]), "-", "-", "-", "-", "-", o["status"]])
            continue
        rows.append([f"`{o['scheme']}`", str(o["bits"]), *_memory(o.get("memory")), _f(o["ppl"], "{:.3f}"),
                     _f(o["delta_pct"], "{:+.2f}%"), _kl(o["kl"]), o["description"]])
    window = "the whole text visible" if r["sink_tokens"] + r["recent_tokens"] >= r["tokens"] else \
        f"{r['sink_tokens']} sinks + {r['recent_tokens']} recent visible"
    return (f"Perplexity over {r['tokens']} tokens ({window}; positions {r.get('positions', 'absolute')}), each "
            f"token decoded from its scheme's cache. {_memory_note(r.get('capacity', r['tokens']))}\n\n"
            + _table(head, rows))


def stream_markdown(r: dict) -> str:
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
            "StreamingLLM's). Bytes per token: each configuration's real cache (the full cache holds the whole "
            "text, the others the capacity) over the tokens it holds.\n\n" + _table(head, rows))


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
        head = ["baseline", "bytes/token", "KL", "best grid config within its bytes", "bytes/token", "KL",
                "grid config nearest its bytes", "bytes/token", "KL"]
        rows = [[f"`{e['baseline']}`", f"{e['bytes_per_token']:,.0f}", _kl(e["kl"]),
                 f"`{e['best']}`" if e["best"] else "none fits",
                 _f(e["best_bytes_per_token"], "{:,.0f}"), _kl(e["best_kl"]),
                 f"`{e['nearest']}`" if e["nearest"] else "-", _f(e["nearest_bytes_per_token"], "{:,.0f}"),
                 _kl(e["nearest_kl"])] for e in r["equal_bytes"]]
        lines += ["\nAt equal bytes: each baseline against the grid's configurations.\n", _table(head, rows)]
    return "\n".join(lines)


def tune_summary(r: dict) -> str:
    b, m = r["best"], r["best"]["memory"]
    return (f"budget {r['budget']['text']}: {r['budget']['limit_bytes_per_token']:,.0f} bytes/token at capacity "
            f"{r['capacity']}; {r['within']} of {r['considered']} configurations fit, least KL:\n"
            f"    {r['config_line']}\n"
            f"    {m['bytes_per_token']:,.0f} bytes/token ({m['bf16_fraction']:.3f} of bf16), KL {_kl(b['kl'])} "
            f"nats/token, perplexity {b['ppl']:.3f} ({b['delta_pct']:+.2f}% vs bf16), on {r['tokens']} tokens, "
            f"positions {r['positions']}")


def tune_markdown(r: dict) -> str:
    return "\n".join([
        f"Budget `{r['budget']['text']}`: {r['budget']['limit_bytes_per_token']:,.0f} bytes/token. "
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
    ax.set(xlabel=f"bytes per token at capacity {r['capacity']} (all layers)",
           ylabel="mean KL from the bf16 cache (nats/token)", yscale="log",
           title=f"bytes vs error, {r['tokens']} tokens, positions {r['positions']} (KL 0 drawn at {floor:.1e})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tune(r: dict, path: Path) -> None:
    plot_frontier(r, path, budget=r["budget"]["limit_bytes_per_token"])


MARKDOWN = dict(kv=kv_markdown, ppl=ppl_markdown, stream=stream_markdown, calibrate=calibrate_markdown,
                frontier=frontier_markdown, tune=tune_markdown)
PLOTS = dict(kv=plot_kv, ppl=plot_ppl, stream=plot_stream, calibrate=plot_calibrate, frontier=plot_frontier,
             tune=plot_tune)
TITLES = dict(kv="Per-layer error (kv)", ppl="Perplexity (ppl)", stream="Streaming (stream)",
              calibrate="Sinks (calibrate)", frontier="Bytes against error (frontier)",
              tune="The configuration for a budget (tune)")
