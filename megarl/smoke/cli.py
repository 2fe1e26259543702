"""`megarl smoke --gpu` (registered by `megarl.cli`, imported only when run): `megarl.smoke`'s checks, one line each."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser("smoke", help="the checks to run on one GPU node before a large job (docs/gpu.md)",
                              description="Run on one GPU node before a large job: library contracts, the layer "
                              "spec, a distributed-optimizer checkpoint round trip, TE's packed bf16 step, a vLLM GPU "
                              "fleet's pushes, the NCCL sync, routing replay. One line per check: PASS, FAIL with "
                              "what to do next, or SKIPPED with what it needs. Exit 1 if any check failed.")
    c.add_argument("--gpu", action="store_true", help="the GPU job's checks (the only set today; on a machine "
                   "without a GPU the GPU-only checks print SKIPPED)")
    c.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names as printed)")
    c.add_argument("--out", type=Path, help="where each check's files and smoke.json go (default: a new temporary "
                   "directory, printed)")


def run(args: argparse.Namespace) -> int:
    from megarl.smoke.runner import run as run_checks

    out = args.out or Path(tempfile.mkdtemp(prefix="megarl-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"megarl smoke: files in {out}", flush=True)
    try:
        outcomes = run_checks(out, only=args.only)
    except ValueError as err:
        print(f"megarl smoke: {err}", file=sys.stderr)
        return 2
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skipped")}
    print(f"smoke: {counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped "
          f"({out / 'smoke.json'})")
    return 1 if counts["fail"] else 0
