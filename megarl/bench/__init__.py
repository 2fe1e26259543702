"""Benchmarks run by `megarl bench NAME ...`; each module has `register(subparsers)` and `run(args) -> int`.

    megarl bench logprob    peak memory and time of the vocab-parallel log-prob + entropy
    megarl bench pipeline   the same short RL job with the overlapped pipeline off and on, per sync offset
    megarl bench sync       bytes, seconds and memory of one weight sync: partitioned vs raw vs broadcast
    megarl bench longtail   long-tailed responses on the real fleet: static split vs shared queue, and projected
    megarl bench savings    the same short job at several sync.interval values: bytes, sync seconds, fleet pause
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {"logprob": "megarl.bench.logprob", "pipeline": "megarl.bench.pipeline", "sync": "megarl.bench.sync",
           "savings": "megarl.bench.savings", "longtail": "megarl.bench.longtail"}


def register(subparsers: argparse._SubParsersAction) -> None:
    for module in BENCHES.values():
        importlib.import_module(module).register(subparsers)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHES[args.command]).run(args)
