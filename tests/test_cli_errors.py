"""qsinkkv-eval's failure paths: bad --text and --out are refused before any work, and an
interrupted run (Ctrl-C, SIGTERM) leaves neither a hidden temp folder nor an --out it created.
No model is loaded: cli.run is replaced by a stub in every test."""
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
                          check=False)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_tune_budget_below_one_byte_is_printed_as_asked():
    """--budget 1.5 is 1.5 bytes/token (any plain number above 1): the messages say 1.5, not a rounded 2."""
    from qsinkkv import CacheConfig
    from qsinkkv.eval import footprint, frontier

    budget = frontier.Budget.parse("1.5")
    assert budget.bytes_per_token == 1.5
    geo = footprint.Geometry(2, 1, 16)
    with pytest.raises(ValueError) as e:
        frontier.check_budget([CacheConfig(sink_tokens=1, recent_tokens=15, bits=4, block_size=8,
                                           value_group_size=16)], budget, geo, 16)
    assert "no configuration of the grid fits 1.5 bytes/token" in str(e.value)
    best = dict(kl=0.01, ppl=10.0, delta_pct=1.0, memory=dict(bytes_per_token=1.0, bf16_fraction=0.001))
    r = dict(budget=dict(text="1.5", limit_bytes_per_token=1.5), capacity=16, within=1, considered=1,
             config_line="CacheConfig()", best=best, tokens=16, positions="absolute")
    assert report.tune_summary(r).startswith("budget 1.5: 1.5 bytes/token at capacity 16")
