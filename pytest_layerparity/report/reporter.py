"""The plugin's reporter: collects each layerparity test's properties (also from xdist
workers, through the reports) and writes the terminal summary and ``--parity-report``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from ..state import NODEID
from .entry import ReportEntry

if TYPE_CHECKING:
    from ..options import Settings


class LayerParityReporter:
    """Collects each layerparity test's properties (also from xdist workers, through the
    reports) for the terminal summary and ``--parity-report``."""

    def __init__(self, settings: Settings, header: list[str] | None = None) -> None:
        self.settings = settings
        self.header = header or []
        self.entries: list[ReportEntry] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.nodeid.startswith(f"{NODEID}::"):
            return
        if report.when == "call" or (report.when == "setup" and report.failed):
            self.entries.append(ReportEntry.of_test(report))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        from ..distributed.env import rank_info
        from ..selection import case_order
        from .text import summary_lines

        ordered = sorted(self.entries, key=lambda e: case_order(e.nodeid))
        lines = summary_lines(ordered)
        placements = sorted({e.placement for e in self.entries if e.placement})
        if lines:
            terminalreporter.write_sep("=", "layerparity summary")
            for placement in placements:
                terminalreporter.write_line(f"reference placement: {placement}")
            for note in sorted({e.decode_note for e in self.entries if e.decode_note}):
                terminalreporter.write_line(f"decode steps: {note}")
            for line in lines:
                terminalreporter.write_line(line)
        if self.settings.parity_report and rank_info().reports:
            from .files import write_reports

            paths = write_reports(self.settings.parity_report, ordered, header=self.header)
            terminalreporter.write_line(f"layerparity: reports written to {', '.join(str(p) for p in paths)}")
