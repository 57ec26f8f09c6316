"""Progress bars: a terminal redraws often; a log (stderr not a TTY) gets few updates."""

import io
import sys

from tkv.calibrate.progress import LOG_INTERVAL_S, bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_updates_rarely_when_stderr_is_a_log(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with bar(1000, "log") as b:
        assert b.mininterval == LOG_INTERVAL_S
        for _ in range(1000):
            b.update(1)
    # one opening line and the closing redraw at most; no redraw per update
    assert log.getvalue().count("\r") <= 3


def test_bar_redraws_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Tty())
    with bar(10, "tty") as b:
        assert b.mininterval == 0.1


def test_bar_disabled_writes_nothing(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with bar(10, "off", enabled=False) as b:
        b.update(10)
    assert log.getvalue() == ""
