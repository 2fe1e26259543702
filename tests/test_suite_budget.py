"""The budget table of `tests/README.md` (read by `tests/suite_budget.py`) covers exactly the suite's modules and
fits the suite's budget, so a new test module must claim its seconds, and seconds added somewhere are taken from
somewhere else."""

from pathlib import Path

import pytest

from tests.suite_budget import overruns, read_budgets

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_budget_and_every_budget_a_module():
    _, budgets = read_budgets()
    modules = {p.name for p in TESTS.glob("test_*.py")}
    assert sorted(modules - budgets.keys()) == [], "test modules with no budget row in tests/README.md"
    assert sorted(budgets.keys() - modules) == [], "budget rows in tests/README.md for modules that do not exist"


def test_budgets_fit_the_suite_budget():
    total, budgets = read_budgets()
    assert sum(budgets.values()) <= total, f"module budgets add up to {sum(budgets.values())} s > {total} s"


def test_the_table_reader_and_the_overrun_rule(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("Suite budget: 100 s\n\n| module | budget s |\n|---|---|\n"
                      "| `test_a.py` | 60 |\n| test_b.py | 30 |\n")
    assert read_budgets(readme) == (100, {"test_a.py": 60, "test_b.py": 30})
    assert overruns({"test_a.py": 61.0, "test_b.py": 30.0, "test_c.py": 0.5}, {"test_a.py": 60, "test_b.py": 30}) == [
        "test_a.py: 61 s > 60 s", "test_c.py: 0 s, no budget"]
    readme.write_text("| test_a.py | 1 |\n")
    with pytest.raises(ValueError, match="suite budget"):
        read_budgets(readme)
    readme.write_text("suite budget: 5 s\n| test_a.py | 1 |\n| test_a.py | 2 |\n")
    with pytest.raises(ValueError, match="two budget rows"):
        read_budgets(readme)
