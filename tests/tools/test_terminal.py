"""What the commands print (dflash_lab/terminal.py): the progress protocol stages speak to
``dflash-lab run``, the pipeline's live line, readable stage logs, one line per log record and
dependencies' noise filtered unless DFLASH_DEBUG=1."""

from __future__ import annotations

import io
import json
import logging
import warnings

import pytest

from dflash_lab import terminal
from dflash_lab.pipeline import Live
from dflash_lab.terminal import PROGRESS_PREFIX, Bar, StageOutput, clock, emit


def line(**fields) -> bytes:
    return (PROGRESS_PREFIX + json.dumps(fields) + "\n").encode()


def test_emit_writes_one_json_line_on_stderr_only_when_asked(monkeypatch, capsys):
    monkeypatch.delenv(terminal.PROGRESS_ENV, raising=False)
    emit(unit="step", done=1, total=2)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(terminal.PROGRESS_ENV, "1")
    emit(unit="step", done=1, total=2, tau=1.5)
    err = capsys.readouterr().err
    assert err.startswith(PROGRESS_PREFIX) and err.endswith("\n")
    assert json.loads(err[len(PROGRESS_PREFIX):]) == {"unit": "step", "done": 1, "total": 2,
                                                      "tau": 1.5}


def test_bar_emits_its_count_and_the_last_state(monkeypatch, capsys):
    monkeypatch.setenv(terminal.PROGRESS_ENV, "1")
    for _ in Bar(range(3), desc="prompts", unit="prompt", mininterval=0):
        pass
    err = capsys.readouterr().err  # tqdm's own \r redraws come first on each line
    lines = [json.loads(ln.split(PROGRESS_PREFIX)[1]) for ln in err.split("\n")
             if PROGRESS_PREFIX in ln]
    assert lines[0]["done"] == 0 and lines[-1] == {"unit": "prompt", "done": 3, "total": 3,
                                                   "what": "prompts"}


def test_stage_log_gets_lines_not_progress_and_bars_as_states():
    log = io.StringIO()
    out = StageOutput(log, snapshot_s=3600)
    out.feed(b"loading\r\n  0%| 0/4\r 25%| 1/4")
    out.feed(line(unit="sample", done=1, total=4, what="capture"))  # after a bar's \r state
    out.feed(b"\r 50%| 2/4\r100%| 4/4\ndone\npartial")
    out.close()
    assert log.getvalue() == "loading\n100%| 4/4\ndone\npartial\n"
    assert PROGRESS_PREFIX not in log.getvalue() and "\r" not in log.getvalue()
    assert out.latest == {"unit": "sample", "done": 1, "total": 4, "what": "capture"}


def test_a_long_bar_leaves_snapshots_in_the_log():
    log = io.StringIO()
    out = StageOutput(log, snapshot_s=0)
    out.feed(b"\r1/3\r2/3\r3/3\n")
    assert log.getvalue() == "1/3\n2/3\n3/3\n"


def test_a_multibyte_character_split_across_reads_survives():
    log = io.StringIO()
    out = StageOutput(log)
    data = "tau \u2192 3.9\n".encode()
    out.feed(data[:5])
    out.feed(data[5:])
    assert log.getvalue() == "tau \u2192 3.9\n"


def test_status_line_shows_count_tau_elapsed_and_time_left():
    out = StageOutput(io.StringIO())
    assert out.status(5) == "0:05 elapsed"
    out.feed(line(unit="step", done=2, total=12, what="step"))
    t0 = out.first[0]
    out.feed(line(unit="step", done=4, total=12, what="step", tau=2.25))
    # 2 steps in 10 s since the first progress line -> 8 steps left = 40 s
    assert out.status(70, now=t0 + 10) == ("step 4/12 \u00b7 val tau 2.250 \u00b7 1:10 elapsed "
                                           "\u00b7 ~0:40 left")
    out.feed(line(unit="prompt", done=1, total=6, what="eval"))  # a new unit: a new rate
    assert out.status(3725, now=out.first[0]) == ("eval 1/6 \u00b7 val tau 2.250 \u00b7 "
                                                  "1:02:05 elapsed")
    out.feed(b"dflash-progress {not json\n")  # ignored, never fatal
    assert out.latest["what"] == "eval"
    assert clock(59) == "0:59" and clock(3600) == "1:00:00"


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_live_line_redraws_on_a_terminal_and_prints_rarely_elsewhere():
    out = StageOutput(io.StringIO())
    out.feed(line(unit="step", done=1, total=3, what="step"))
    tty = FakeStream(True)
    live = Live(stream=tty)
    live.show(out)
    live.show(out)
    live.clear()
    text = tty.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 0 and "step 1/3" in text
    plain = FakeStream(False)
    live = Live(stream=plain, every_s=3600)
    live.show(out)
    live.show(out)
    live.clear()
    assert plain.getvalue().count("\n") == 1 and "\r" not in plain.getvalue()


@pytest.mark.parametrize("debug", ["", "1"])
def test_noise_filtered_unless_debug(monkeypatch, debug):
    monkeypatch.setenv(terminal.DEBUG_ENV, debug)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    kept = logger.filters[:]
    logger.filters[:] = []  # an earlier setup() in this session (the pipeline's main) added one
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        terminal.setup()
        warnings.warn_explicit("Found 3 module(s) in eval mode at the start of training.",
                               UserWarning, "z.py", 1, module="lightning.z")
        warnings.warn_explicit("old api", DeprecationWarning, "x.py", 1, module="lightning.x")
        warnings.warn_explicit("ours", DeprecationWarning, "y.py", 1, module="dflash_lab.y")
    records: list[logging.LogRecord] = []
    collect = logging.Handler()
    collect.emit = records.append
    logger.addHandler(collect)
    level, logger.level = logger.level, logging.INFO
    try:
        logger.info("\U0001f4a1 Tip: For seamless cloud logging, try installing litlogger")
        logger.info("GPU available: False")
    finally:
        logger.filters[:] = kept
        logger.removeHandler(collect)
        logger.level = level
    messages = [str(w.message) for w in seen]
    logged = [r.getMessage() for r in records]
    assert "ours" in messages and "GPU available: False" in logged
    if debug:
        assert len(messages) == 3 and len(logged) == 2
    else:
        assert messages == ["ours"] and logged == ["GPU available: False"]


def test_lightning_lines_print_once_after_hydra_set_up_logging(capsys):
    root, pkg = logging.getLogger(), logging.getLogger("lightning")
    saved = (root.handlers[:], pkg.handlers[:], pkg.propagate, root.level)
    try:
        root.handlers[:] = [logging.StreamHandler()]  # Hydra's job logging
        root.setLevel(logging.INFO)
        pkg.handlers[:] = [logging.StreamHandler()]  # what `import lightning` adds
        pkg.propagate = True
        logging.getLogger("lightning.x").info("Restoring states")
        assert capsys.readouterr().err.count("Restoring states") == 2  # the bug
        terminal.one_handler()
        logging.getLogger("lightning.x").info("Restoring states")
        assert capsys.readouterr().err.count("Restoring states") == 1
    finally:
        root.handlers[:], pkg.handlers[:], pkg.propagate = saved[0], saved[1], saved[2]
        root.setLevel(saved[3])
