"""The progress bar: tqdm's redraws on a terminal, whole lines in a log or a pipe."""

import io
import os
import subprocess
import sys

import pytest

from metachunk.progress import bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def stderr(monkeypatch):
    def use(stream):
        monkeypatch.setattr(sys, "stderr", stream)
        return stream

    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    return use


def test_off_a_terminal_each_shown_state_is_one_whole_line(stderr, monkeypatch):
    log = stderr(io.StringIO())
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # every update shown
    with bar(total=3, desc="chunk ppl", unit="doc") as b:
        for _ in range(3):
            b.update(1)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # the close shows the last state again with the whole run's mean rate
    assert [line.split("|")[0] for line in lines] == [f"chunk ppl: {p:3d}%" for p in (0, 33, 67, 100, 100)]
    assert all(line.isascii() and "doc" in line for line in lines)
    assert "3/3" in lines[-1]


def test_off_a_terminal_lines_come_at_most_every_interval(stderr, monkeypatch):
    log = stderr(io.StringIO())
    with bar(total=1000, desc="check", unit="doc") as b:  # 30 s between lines by default
        for _ in range(1000):
            b.update(1)
    assert log.getvalue() == ""  # done within the interval: no line at all
    clock = iter(range(0, 10**6, 31))  # tqdm's clock, 31 s on at each reading
    monkeypatch.setattr("tqdm.std.time", lambda: float(next(clock)))
    with bar(total=1000, desc="check", unit="doc") as b:
        for _ in range(3):
            b.update(1)
    lines = log.getvalue().splitlines()
    assert lines and all(line.startswith("check:") for line in lines)


def test_on_a_terminal_it_is_tqdms_own_redrawn_bar(stderr):
    tty = stderr(Terminal())
    with bar(total=2, desc="x", mininterval=0) as b:
        b.update(2)
    assert tty.getvalue().startswith("\rx:")


def test_a_disabled_bar_writes_nothing(stderr):
    log = stderr(io.StringIO())
    with bar(total=2, desc="x", enabled=False) as b:
        b.update(2)
    assert log.getvalue() == ""


def test_tqdms_environment_still_decides():
    # tqdm reads TQDM_* when it is imported: a fresh interpreter
    code = "from metachunk.progress import bar\nwith bar(total=2, desc='x') as b: b.update(2)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TQDM_DISABLE": "1"},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stderr == ""


def test_off_a_terminal_two_open_bars_write_no_cursor_codes_and_a_long_line_is_whole(stderr, monkeypatch):
    log = stderr(io.StringIO())
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    tail = "0.9 req/s, 12 cached, 0 fallbacks, $0.1234" + ", and more" * 10
    with bar(total=3, desc="students") as first, bar(total=2, desc="chunk lumber") as second:  # tqdm's pos 1
        first.update(1)
        second.set_postfix_str(tail, refresh=False)
        second.update(2)
    text = log.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert any(line.endswith(tail + "]") for line in text.splitlines())  # not cut to a width


def test_a_notebook_keeps_tqdms_own_bar(stderr, monkeypatch):
    out = stderr(io.StringIO())  # a notebook's stream says it is no terminal
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    with bar(total=2, desc="x", mininterval=0) as b:
        b.update(2)
    assert out.getvalue().startswith("\rx:")
