"""The progress bars' plumbing (report.progress): silent unless asked, written past capture."""

from __future__ import annotations

import contextlib
import io
import sys
from types import SimpleNamespace

from pytest_layerparity.report.progress import SILENT, Progress, TerminalStream, for_pytest


def test_silent_bars_write_nothing(capsys):
    with SILENT.bar(3, "x") as bar:
        bar.update(3)
    assert capsys.readouterr() == ("", "")


def test_bars_write_through_the_stream_with_capture_suspended(monkeypatch):
    calls = []
    out = io.StringIO()

    @contextlib.contextmanager
    def suspend():
        calls.append("suspend")
        yield

    monkeypatch.setattr(sys, "stderr", out)
    with Progress(True, TerminalStream(suspend)).bar(4, "layerparity: reference forward") as bar:
        bar.update(2)
    assert calls and "layerparity: reference forward" in out.getvalue()


def config(verbosity=0, worker=False, capman=True):
    plugins = {
        "capturemanager": SimpleNamespace(global_and_fixture_disabled=contextlib.nullcontext) if capman else None
    }
    cfg = SimpleNamespace(pluginmanager=SimpleNamespace(getplugin=plugins.get), get_verbosity=lambda: verbosity)
    if worker:
        cfg.workerinput = {}
    return cfg


def test_progress_is_quiet_under_q_on_workers_and_off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert for_pytest(config()).enabled
    assert for_pytest(config(verbosity=-1)) is SILENT
    assert for_pytest(config(worker=True)) is SILENT
    assert for_pytest(config(capman=False)) is SILENT
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert for_pytest(config()) is SILENT
