"""Runs the smoke checks (`megarl.smoke.checks.CHECKS`) on this node, one line each, and writes `smoke.json`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from megarl.smoke.checks import CHECKS
from megarl.smoke.registry import CheckFailed, Node, Outcome


def run(work: Path, node: Node | None = None, only: list[str] | None = None,
        report: Callable[[Outcome], None] = lambda o: print(o.line(), flush=True)) -> list[Outcome]:
    """Run every registered check (or those named in `only`) in order on `node` (default: this one), reporting each
    outcome as it ends; a check that raises anything but `CheckFailed` fails with its exception named."""
    node = node or Node.here()
    unknown = sorted(set(only or []) - {c.name for c in CHECKS})
    if unknown:
        names = ", ".join(c.name for c in CHECKS)
        raise ValueError(f"unknown smoke check(s) {', '.join(unknown)}: choose from {names}")
    outcomes = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        start = time.monotonic()
        reason = check.needs.missing(node)
        if reason is not None:
            outcome = Outcome(check.name, "skipped", f"{check.what}: {reason}")
        else:
            (work / check.name).mkdir(parents=True, exist_ok=True)
            try:
                outcome = Outcome(check.name, "pass", check.run(work / check.name))
            except CheckFailed as err:
                outcome = Outcome(check.name, "fail", str(err), err.next_step)
            except Exception as err:  # noqa: BLE001 - one line per check, whatever broke
                outcome = Outcome(check.name, "fail", f"{type(err).__name__}: {err}".splitlines()[0],
                                  f"see {work / check.name}; report it with this line and `pip list`")
        outcome = Outcome(**{**asdict(outcome), "seconds": round(time.monotonic() - start, 1)})
        report(outcome)
        outcomes.append(outcome)
    (work / "smoke.json").write_text(json.dumps({"node": asdict(node), "checks": [asdict(o) for o in outcomes]},
                                                indent=1))
    return outcomes
