"""The suite's time budget, kept by a rule: every test module has a budget of seconds in `tests/README.md`, the
budgets add up to no more than the suite's budget, and every run prints each module's measured seconds against its
budget (and writes them to `$MEGARL_SUITE_TIMES`, a JSON file, when that is set).

Seconds are a module's setup + call + teardown, as pytest reports them; a session fixture's start (the shared vLLM
fleet, the SLURM cluster) counts in the first module that asks for it. Machines differ, so an overrun is reported,
not failed, unless `MEGARL_SUITE_BUDGET=strict` (then the session fails). `tests/test_suite_budget.py` checks the
table itself: a module without a budget, a budget for a module that is gone, or budgets over the total fail at once.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

README = Path(__file__).with_name("README.md")
_ROW = re.compile(r"^\|\s*`?(test_\w+\.py)`?\s*\|\s*(\d+)\s*\|")
_TOTAL = re.compile(r"suite budget:\s*(\d+)\s*s", re.IGNORECASE)


def read_budgets(readme: Path = README) -> tuple[int, dict[str, int]]:
    """(the suite's budget in seconds, module file name -> budget in seconds) from the table in `readme`."""
    text = readme.read_text()
    total = _TOTAL.search(text)
    if total is None:
        raise ValueError(f"{readme} names no 'suite budget: N s'")
    budgets: dict[str, int] = {}
    for line in text.splitlines():
        if m := _ROW.match(line):
            if m.group(1) in budgets:
                raise ValueError(f"{readme}: {m.group(1)} has two budget rows")
            budgets[m.group(1)] = int(m.group(2))
    return int(total.group(1)), budgets


def overruns(times: dict[str, float], budgets: dict[str, int]) -> list[str]:
    """Modules whose measured seconds exceed their budget, and modules with no budget."""
    return [f"{m}: {s:.0f} s > {budgets[m]} s" if m in budgets else f"{m}: {s:.0f} s, no budget"
            for m, s in sorted(times.items()) if m not in budgets or s > budgets[m]]


class SuiteTimes:
    """Pytest plugin: sums each module's seconds and reports them against the budgets at the end of the run."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.times[Path(report.nodeid.split("::", 1)[0]).name] += report.duration

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.times:
            return
        if path := os.environ.get("MEGARL_SUITE_TIMES"):
            Path(path).write_text(json.dumps(dict(sorted(self.times.items())), indent=1))
        over = overruns(self.times, read_budgets()[1])
        if over and os.environ.get("MEGARL_SUITE_BUDGET") == "strict" and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:  # noqa: ANN001 - pytest's hook
        if not self.times:
            return
        total_budget, budgets = read_budgets()
        tr = terminalreporter
        tr.section("suite time against tests/README.md's budgets")
        for module, seconds in sorted(self.times.items(), key=lambda kv: -kv[1])[:15]:
            tr.write_line(f"{seconds:8.1f} s  of {budgets.get(module, 0):5d} s  {module}")
        tr.write_line(f"{sum(self.times.values()):8.1f} s  of {total_budget:5d} s  the whole run "
                      f"({len(self.times)} modules)")
        if over := overruns(self.times, budgets):
            tr.write_line("over budget (MEGARL_SUITE_BUDGET=strict fails the run on this): " + "; ".join(over))
