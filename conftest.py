"""Reporting for the whole suite (the core's tests and every adapter's): a failing test is
named the moment it fails, not only in the summary at the end of a 20-minute run."""

from __future__ import annotations

import pytest

_reporter: list = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    _reporter[:] = [config.pluginmanager.get_plugin("terminalreporter")]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One line per failure as it happens: `FAILED node (setup|call|teardown)`."""
    if report.failed and _reporter and _reporter[0] is not None:
        reporter = _reporter[0]
        if reporter._tw.width_of_current_line:  # after -q's progress characters
            reporter.write("\n")
        reporter.write_line(f"FAILED {report.nodeid} ({report.when})", red=True)
