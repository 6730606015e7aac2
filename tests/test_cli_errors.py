"""qsinkkv-eval's command line (eval/cli.py) and its failure paths: bad arguments, --text and --out are refused
before any work, and an interrupted run (Ctrl-C, SIGTERM) leaves neither a hidden temp folder nor an --out it
created. No model is loaded: every refusal comes before cli.run, which is a stub wherever a test goes further."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from qsinkkv.eval import cli, data, report  # noqa: E402

RESULTS = {"command": "qsinkkv-eval ppl", "date": "2000-01-01", "seconds": 0.0, "device": "cpu",
           "dtype": "float32", "model": "stub", "text": "stub", "versions": {}, "ppl": {}}


@pytest.fixture
def no_run(monkeypatch):
    """The model must never be loaded: every check here comes before run()."""
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("run() reached: the model would be loaded"))


def leftovers(root: Path) -> list[Path]:
    return sorted(root.rglob(".qsinkkv-eval-*"))


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 64,             # binary: not UTF-8
    "café, naïve".encode("latin-1"),    # a legacy encoding: not UTF-8 either
    b"valid utf-8\x00\x00\x01 but binary",  # decodes, but NUL bytes are no text
], ids=["binary", "latin-1", "nul-bytes"])
def test_text_that_is_not_utf8_text_is_refused(content, tmp_path, capsys, no_run):
    text, out = tmp_path / "input.bin", tmp_path / "out"
    text.write_bytes(content)
    assert cli.main(["ppl", "--text", str(text), "--out", str(out)]) == 2
    assert f"qsinkkv-eval: error: --text {text}: " in capsys.readouterr().err
    assert not out.exists()


def test_utf8_text_with_a_bom_is_read_without_it(tmp_path):
    text = tmp_path / "bom.txt"
    text.write_bytes("\ufeffplain prose".encode())
    assert data.read_text(str(text)) == "plain prose"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_out_that_cannot_be_created_fails_before_any_work(capsys, no_run):
    """os.access lets root 'write' to /proc, where mkdir fails: only creating the folder tells."""
    out = "/proc/qsinkkv-eval-no-such-dir"
    assert cli.main(["ppl", "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"qsinkkv-eval: error: --out {out} is not writable" in err
    assert not os.path.exists(out)


def test_out_is_created_before_run_and_removed_when_run_fails(tmp_path, monkeypatch, capsys):
    out = tmp_path / "a" / "b"

    def run(args):
        assert out.is_dir() and not leftovers(out)  # created and probed up front, probe gone
        raise ValueError("--tokens=512: the text has only 3 tokens")
    monkeypatch.setattr(cli, "run", run)
    assert cli.main(["ppl", "--out", str(out)]) == 2
    assert "the text has only 3 tokens" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and tmp_path.exists()


def interrupt(*args):
    raise KeyboardInterrupt


def main_interrupted(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except KeyboardInterrupt:  # escaping, it would stop the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main()")


def test_ctrl_c_while_writing_removes_the_out_it_created(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run", lambda args: dict(RESULTS))
    monkeypatch.setitem(report.PLOTS, "ppl", interrupt)
    out = tmp_path / "new" / "out"
    assert main_interrupted(["ppl", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_ctrl_c_while_writing_keeps_an_existing_out_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda args: dict(RESULTS))
    monkeypatch.setitem(report.PLOTS, "ppl", interrupt)
    (tmp_path / "keep.txt").write_text("mine")
    (tmp_path / "results.json").write_text("{}")  # an earlier run's
    before = sorted(tmp_path.iterdir())
    assert main_interrupted(["ppl", "--out", str(tmp_path)]) == 130
    assert sorted(tmp_path.iterdir()) == before
    assert (tmp_path / "keep.txt").read_text() == "mine" and (tmp_path / "results.json").read_text() == "{}"


def test_sigterm_raises_and_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, cli.sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.slow
def test_sigterm_while_writing_cleans_up(tmp_path):
    """A real SIGTERM in a real process (by default it would kill it before any cleanup):
    the hidden temp folder and the --out folder the run created go, what was there stays."""
    (tmp_path / "keep.txt").write_text("mine")
    out = tmp_path / "created"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from qsinkkv.eval import cli, report

        def terminate(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the signal arrives here
        cli.run = lambda args: {RESULTS!r}
        report.PLOTS["ppl"] = terminate
        sys.exit(cli.main(["ppl", "--out", {str(out)!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          check=False, cwd=tmp_path)  # (the repo root, `-c`'s first path entry, holds kernels/)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "mine"


# --- bad arguments, refused before any work ------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["ppl", "--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
    (["ppl", "--bits", "3"], "--bits must be 8 and/or 4, got 3"),
    (["stream", "--capacity", "3", "--sink-tokens", "4"], "--capacity (3) must be larger than --sink-tokens (4)"),
    (["kv", "--schemes", "int3-magic"], "--schemes: unknown scheme 'int3-magic'"),
    (["kv", "--tokens", "100000"], "--tokens must be <= 4096"),
    (["stream", "--tokens", "300"], "--tokens (300) must exceed the capacity (512)"),
    (["ppl", "--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
    (["calibrate", "--recent-tokens", "0"], "--recent-tokens must be >= 1"),
    (["kv", "--tokens", "200", "--sink-tokens", "300"], "--sink-tokens must be >= 0 and < --tokens (200), got 300"),
    (["kv", "--bits", "8", "--schemes", "qsinkkv-int4"], "--schemes qsinkkv-int4 is not measured at --bits 8"),
    (["report", "--tokens", "100"], "4 x --tokens (the stream part) (400) must exceed the capacity (512)"),
])
def test_bad_arguments_fail_cleanly(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(argv + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # no partial report


def test_unwritable_out_fails_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert cli.main(["ppl", "--out", str(blocker / "sub")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["tune"], "the following arguments are required: --budget"),
    (["tune", "--budget", "cheap"], "--budget must be a fraction of the bf16 cache's bytes in (0, 1]"),
    (["tune", "--budget", "0"], "--budget must be a fraction"),
    (["tune", "--budget", "120%"], "more than the bf16 cache"),
    (["frontier", "--grid", "bits=3"], "--grid bits must be 8 and/or 4, got 3"),
    (["frontier", "--grid", "colour=4"], "--grid 'colour=4': expected a preset"),
    (["frontier", "--grid", "block=0"], "--grid block must be >= 1"),
    (["frontier", "--grid", "sinks=x"], "--grid sinks: 'x' is not a non-negative int (or calibrate)"),
    (["frontier", "--tokens", "64", "--grid", "residual=80", "sinks=1"], "--grid residual 80 must be <= the recent"),
    (["frontier", "--tokens", "64", "--grid", "sinks=64"], "--grid sinks 64 must be < the capacity (64)"),
    (["frontier", "--tokens", "64"], "--grid sinks=calibrate runs calibrate, which needs 81 <= --tokens"),
    (["frontier", "--capacity", "600"], "--capacity (600) must be <= --tokens (512)"),
    (["frontier", "--schemes", "none", "bf16"], "--schemes none excludes every baseline: give it alone"),
    (["frontier", "--grid", "bits=8", "--schemes", "qsinkkv-int4"], "--schemes qsinkkv-int4 is not measured"),
    (["ppl", "--positions", "relative"], "argument --positions: invalid choice: 'relative'"),
])
def test_bad_frontier_and_tune_arguments_fail_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("run() reached: the model would be loaded"))
    out = tmp_path / "out"
    try:
        code = cli.main(argv + ["--out", str(out)])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_memory_of_with_a_capacity_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("run() reached"))
    out = tmp_path / "out"
    assert cli.main(["stream", "--memory-of", "bf16:256", "--capacity", "256", "--out", str(out)]) == 2
    assert "--memory-of sets every scheme's capacity" in capsys.readouterr().err
    assert not out.exists()


# --- missing modules, and messages that name the flag to change ---------------------------

@pytest.mark.parametrize("argv,module,message", [
    (["ppl"], "matplotlib", "matplotlib (the plots)"),
    (["recall"], "tqdm", "tqdm (progress bars)"),
    (["ppl", "--schemes", "bnb-nf4"], "bitsandbytes", "--schemes bnb-nf4 needs bitsandbytes"),
    (["ppl", "--bits", "4", "--schemes", "quanto-int4"], "optimum.quanto", "quanto-int4 needs optimum.quanto"),
    (["ppl", "--model", "{tmp}/model.gguf"], "gguf", "gguf (to read --model {tmp}/model.gguf)"),
])
def test_a_missing_module_is_named_before_any_work(argv, module, message, tmp_path, capsys, monkeypatch, no_run):
    """A missing module once surfaced only when the report was written, after the whole run: now before any."""
    (tmp_path / "model.gguf").write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails, find_spec(module) is None
    out = tmp_path / "out"
    assert cli.main([a.format(tmp=tmp_path) for a in argv] + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "pip install 'qsinkkv[eval]'" in err
    assert not out.exists()


@pytest.mark.parametrize("argv,message", [
    (["recall", "--sink-tokens", "100000"], "--sink-tokens 100000: a cache with 100000 sinks and one recent token is "
                                            "larger than recall's default budget bf16:256"),
    (["recall", "--sink-tokens", "300", "--memory-of", "bf16:128,512"], "--sink-tokens 300: a cache with 300 sinks "
                                                                        "and one recent token is larger than "
                                                                        "--memory-of bf16:128"),
    (["stream", "--sink-tokens", "300", "--memory-of", "fp32:128"], "--sink-tokens 300: a cache with 300 sinks and "
                                                                    "one recent token is larger than --memory-of "
                                                                    "fp32:128 (the memory of 256 bf16 tokens)"),
])
def test_sinks_larger_than_the_budget_name_sink_tokens(argv, message, tmp_path, capsys, no_run):
    out = tmp_path / "out"
    assert cli.main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--memory-of bf16:256" not in err  # recall's default: not given, never blamed
    assert not out.exists()


def test_sinks_that_fit_the_budget_pass():
    assert cli.parse(["recall", "--sink-tokens", "255"]).sink_tokens == 255  # 255 sinks + 1 recent = 256 bf16 tokens
    assert cli.parse(["recall", "--sink-tokens", "300", "--schemes", "window"]).schemes == ["window"]  # no sinks kept


def test_text_that_is_a_directory_is_named_so(tmp_path, capsys, no_run):
    assert cli.main(["ppl", "--text", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"--text {tmp_path} is a directory: give a UTF-8 text file" in capsys.readouterr().err


class WordTokenizer:
    """One token per word: a 4-word text is 4 tokens."""

    def __call__(self, text, return_tensors=None):
        import torch
        return type("Encoded", (), dict(input_ids=torch.tensor([[len(w) for w in text.split()]])))


def test_stream_tokens_longer_than_the_text_name_tokens(tmp_path, capsys, monkeypatch):
    from qsinkkv.eval import stream

    text = tmp_path / "four.txt"
    text.write_text("four words of text")
    monkeypatch.setattr(data, "load", lambda *a: (None, WordTokenizer()))  # no model: refused before any is needed
    monkeypatch.setattr(stream, "run", lambda *a, **k: pytest.fail("the stream ran"))
    out = tmp_path / "out"
    assert cli.main(["stream", "--tokens", "5000", "--text", str(text), "--out", str(out), "--quiet"]) == 2
    assert "--tokens=5000: the text has only 4 tokens" in capsys.readouterr().err
    assert not out.exists()
