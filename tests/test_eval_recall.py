"""qsinkkv-eval recall: the pass-key prompts put the key exactly ``distance`` tokens before the end, the
counting rule, the sizes at equal memory, the command's argument errors (exit 2, nothing written) and a tiny run on
the real model."""
import json

import pytest
import torch

pytest.importorskip("transformers")
from qsinkkv.eval import cli, footprint, memory, passkey, recall  # noqa: E402
from qsinkkv.eval.stream import WINDOWED  # noqa: E402
from qsinkkv.layout import visible_mask  # noqa: E402

SMOLLM = footprint.Geometry(30, 3, 64)


class CharTokenizer:
    """One token per character (ids = code points), no chat template: every position is predictable."""
    chat_template = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def real_tokenizer(default_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model)


HAYSTACK = [1000 + (7 * i) % 5000 for i in range(4000)]  # ids no tokenizer gives a key digit: easy to tell apart


@pytest.mark.parametrize("which", ["chars", "real"])
def test_the_key_sits_exactly_distance_tokens_before_the_end(which, request):
    tok = CharTokenizer() if which == "chars" else request.getfixturevalue("real_tokenizer")
    pk = passkey.Passkey.of(tok)
    lowest = pk.min_distance()
    for d in (lowest, lowest + 1, 100, 257, 1000):
        p = pk.build(HAYSTACK, d, passkey.trial_rng(0, d, 0))
        T = len(p.ids)
        assert T - p.key_pos == d == p.distance
        assert T == pk.length(d)
        # the token at the key's position holds its first digit; the one before holds none of it
        assert tok.decode(p.ids[p.key_pos:]).lstrip().startswith(p.key)
        assert tok.decode(p.ids[p.key_pos:p.key_pos + 1]).strip()[:1] == p.key[0]
        assert tok.decode(p.ids[:p.key_pos]).rstrip().endswith("The pass key is")
        assert not any(ch.isdigit() for ch in tok.decode(p.ids[p.key_pos - 1:p.key_pos]))
        # the distance is the cache's: a window of d recent tokens shows the key's first token to the prompt's last
        # query, one of d - 1 does not (no sinks; with S sinks the same holds for W = d, d - 1 while key_pos >= S)
        last = torch.tensor([T - 1])
        for S in (0, 4):
            assert visible_mask(last, torch.tensor([p.key_pos]), S, d).item()
            assert not visible_mask(last, torch.tensor([p.key_pos]), S, d - 1).item()
        # the key is stated twice, then filler, then the question at the very end
        assert tok.decode(p.ids).count(p.key) == 2
        assert p.ids[-len(pk.tail):] == pk.tail and p.ids[:len(pk.head)] == pk.head


def test_the_lead_and_filler_are_one_slice_of_the_text():
    tok = CharTokenizer()
    pk = passkey.Passkey.of(tok)
    p = pk.build(HAYSTACK, 300, passkey.trial_rng(3, 300, 1))
    sentence, first = pk.key_ids(p.key)
    lead = p.ids[len(pk.head):len(pk.head) + passkey.LEAD_TOKENS]
    start = len(pk.head) + passkey.LEAD_TOKENS + len(sentence)
    rest = p.ids[start:len(p.ids) - len(pk.tail)]
    assert lead + rest == HAYSTACK[p.offset:p.offset + len(lead) + len(rest)]
    assert p.key_pos == len(pk.head) + passkey.LEAD_TOKENS + first


def test_prompts_are_the_same_for_a_seed_and_differ_between_trials():
    tok = CharTokenizer()
    a = recall.prompts(tok, HAYSTACK, [120, 400], 3, seed=5)
    b = recall.prompts(tok, HAYSTACK, [120, 400], 3, seed=5)
    assert a == b
    keys = {p.key for ps in a.values() for p in ps}
    assert len(keys) == 6  # fresh keys (5 digits: a collision among 6 is ~1e-4, and the seed is fixed)
    assert recall.prompts(tok, HAYSTACK, [120], 1, seed=6)[120] != a[120][:1]
    # a distance's prompts do not depend on which other distances the run measures
    assert recall.prompts(tok, HAYSTACK, [400], 3, seed=5)[400] == a[400]


def test_too_short_a_distance_or_text_is_refused_by_name():
    pk = passkey.Passkey.of(CharTokenizer())
    with pytest.raises(ValueError, match=f"distance {pk.min_distance() - 1} is shorter than the key and the question"):
        pk.build(HAYSTACK, pk.min_distance() - 1, passkey.trial_rng(0, 0, 0))
    with pytest.raises(ValueError, match="needs 4,[0-9]{3} tokens of text, the text has 4,000"):
        pk.build(HAYSTACK, 4100, passkey.trial_rng(0, 0, 0))


@pytest.mark.parametrize("answer,key,ok", [
    (" 60494.", "60494", True), ("The key: 60494", "60494", True), ("60494", "60494", True),
    (" 604949", "60494", False), ("160494", "60494", False), (" 6049", "60494", False), (" 60 494", "60494", False),
])
def test_an_answer_counts_when_it_holds_the_key_as_a_whole_number(answer, key, ok):
    assert passkey.correct(answer, key) is ok


def cells(accuracies, distances=(100, 200, 300, 400)):
    return [dict(distance=d, accuracy=a) for d, a in zip(distances, accuracies, strict=True)]


@pytest.mark.parametrize("mine,full,expected", [
    ([1, 1, 1, 1], [1, 1, 1, 1], 400),
    ([1, 0.8, 0.5, 0.5], [1, 1, 1, 1], 200),       # 0.8 of the full cache still counts, 0.5 does not
    ([1, 1, 0, 0], [1, 1, 0, 0], 200),             # where the full cache never answers, nobody is farther
    ([1, 0.5, 1, 1], [1, 1, 1, 1], 100),           # a dip ends the run: later matches do not count
    ([0.5, 1, 1, 1], [1, 1, 1, 1], None),
    ([0, 0, 0, 0], [0, 0, 0, 0], None),
])
def test_farthest_recall(mine, full, expected):
    assert recall.farthest(cells(mine), cells(full)) == expected


def test_rows_at_equal_memory_are_the_largest_fits():
    names = list(recall.SCHEME_NAMES.values())
    budgets = memory.parse_memory_of("bf16:128,256")
    plans = recall.plan(SMOLLM, 4, names, budgets)
    assert [p["text"] for p in plans] == ["bf16:128", "bf16:256"]
    for p, b in zip(plans, budgets, strict=True):
        assert p["bytes"] == b.nbytes(SMOLLM)
        for row in p["rows"]:
            scheme, sinks = WINDOWED[row.config]
            fit = memory.largest_fit(p["bytes"], scheme, 4 if sinks else 0, SMOLLM)
            assert (row.capacity, row.bytes, row.sink_tokens) == (fit.capacity, fit.bytes, fit.sink_tokens)
            assert row.bytes <= p["bytes"] < fit.next_bytes
            config = row.cache_config("absolute")
            assert (config.sink_tokens, config.recent_tokens) == (row.sink_tokens, row.recent_tokens)
            assert config.bits == scheme.bits
    at256 = {r.config: r.capacity for r in plans[1]["rows"]}
    assert at256["sinks + int4"] > at256["sinks + int8"] > at256["sinks + bf16 window"] == at256["window, no sinks"]
    assert recall.default_distances(plans) == sorted({round(f * at256["sinks + int4"])
                                                      for f in recall.DISTANCE_FACTORS})
    one, = recall.plan(SMOLLM, 4, names, capacity=300)
    for row in one["rows"]:
        scheme, sinks = WINDOWED[row.config]
        assert row.capacity == 300
        assert row.bytes == footprint.of_scheme(scheme, SMOLLM, row.sink_tokens, 300).total


# --- the command line --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--distances", "abc"], "argument --distances: 'abc': 'abc' is not a whole number of tokens"),
    (["--distances", "100,0"], "argument --distances: '100,0': a distance must be >= 1 token, got 0"),
    (["--trials", "0"], "argument --trials: expected a whole number >= 1, got 0"),
    (["--trials", "many"], "argument --trials: expected a whole number >= 1, got 'many'"),
    (["--schemes", "int3"], "argument --schemes: invalid choice: 'int3'"),
    (["--memory-of", "bf16:x"], "argument --memory-of: 'bf16:x': 'x' is not a whole number"),
    (["--memory-of", "bf16:256", "--capacity", "300"], "--memory-of sets every scheme's capacity from the budget: "
                                                       "drop --capacity"),
    (["--capacity", "4"], "--capacity (4) must be larger than --sink-tokens (4)"),
    (["--recent-tokens", "0"], "--recent-tokens must be >= 1, got 0"),
    (["--sink-tokens", "-1"], "--sink-tokens must be >= 0, got -1"),
    (["--tokens", "512"], "unrecognized arguments: --tokens 512"),
    (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
])
def test_bad_arguments_exit_2_naming_the_flag_and_write_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("run() reached: the model would be loaded"))
    out = tmp_path / "out"
    try:
        code = cli.main(["recall", *argv, "--out", str(out)])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_default_is_the_memory_of_256_bf16_tokens():
    args = cli.parse(["recall"])
    assert memory.text_of(args.memory_of) == "bf16:256"
    assert args.trials == 20 and args.distances is None and args.schemes == list(recall.SCHEME_NAMES)


@pytest.mark.model
@pytest.mark.parametrize("argv,message", [
    (["--distances", "5"], "--distances: 5 is shorter than the key and the question: the shortest distance is"),
    (["--distances", "9000"], "--distances: a prompt at distance 9000 is"),
    (["--memory-of", "bf16:8"], "--memory-of bf16:8: "),
])
def test_sizes_refused_once_the_model_is_known_exit_2_and_write_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["recall", *argv, "--trials", "1", "--quiet", "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.model
def test_greedy_is_generate_for_the_full_and_a_qsinkkv_cache(real_tokenizer):
    """The eval's decoding loop gives transformers' own greedy ``generate`` tokens, through both kinds of cache."""
    from qsinkkv import CacheConfig
    from qsinkkv.hf import QSinkKVCache
    from qsinkkv.models import load_model

    model, tok = load_model(attn_implementation="sdpa")
    text = tok(" ".join(["the cat sat on the mat and then"] * 20), add_special_tokens=False)["input_ids"]
    prompt = passkey.Passkey.of(tok).build(text, 90, passkey.trial_rng(0, 90, 0))
    stop = recall.stop_tokens(model, tok)
    for attn, make in (("sdpa", lambda: None),
                       ("qsinkkv", lambda: QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=60, bits=4,
                                                                    block_size=16, value_group_size=16), model))):
        model.set_attn_implementation(attn)
        ours = recall.greedy(model, prompt.ids, make(), 8, stop)
        kwargs = {} if attn == "sdpa" else dict(cache=make())
        theirs = model.generate(torch.tensor([prompt.ids]), max_new_tokens=8, do_sample=False, **kwargs)
        theirs = theirs[0, len(prompt.ids):].tolist()
        assert ours == theirs[:len(ours)] and (len(ours) == 8 or ours[-1] in stop), (attn, ours, theirs)


@pytest.mark.model
def test_a_tiny_run_on_the_real_model(tmp_path):
    out = tmp_path / "out"
    assert cli.main(["recall", "--capacity", "100", "--distances", "60,150", "--trials", "2", "--quiet",
                     "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["recall.png", "report.md", "results.json"]
    r = json.loads((out / "results.json").read_text())["recall"]
    assert r["distances"] == [60, 150] and r["trials"] == 2
    budget, = r["budgets"]
    assert [o["config"] for o in budget["rows"]] == list(recall.SCHEME_NAMES.values())
    for o in [r["full"], *budget["rows"]]:
        for c in o["by_distance"]:
            assert c["trials"] == 2 == len(c["answers"]) and 0 <= c["correct"] <= 2
            assert c["accuracy"] == c["correct"] / 2
            assert {"capacity", "bytes", "bits", "sink_tokens"} <= set(c)
    for o in budget["rows"]:
        assert o["capacity"] == 100 and all(c["capacity"] == 100 for c in o["by_distance"])
    # the full cache holds every prompt; at 60 tokens back the model finds its key (2/2 when this was written)
    assert [c["capacity"] for c in r["full"]["by_distance"]] == [r["prompt_tokens"][str(d)] for d in (60, 150)]
    assert r["full"]["by_distance"][0]["correct"] >= 1
    report = (out / "report.md").read_text()
    assert "| full cache |" in report and "| 4 sinks + int4 window | 100 |" in report
