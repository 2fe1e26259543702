"""Benchmarks run by `megarl bench NAME ...`; each module has `register(subparsers)` and `run(args) -> int`.

    megarl bench logprob    peak memory and time of the vocab-parallel log-prob + entropy (--hidden: from the
                            hidden states through the output layer, fused vs unfused vs megatron)
    megarl bench padding    tokens computed vs real per step: count-based vs token-budget microbatches
    megarl bench pipeline   the same short RL job with the overlapped pipeline off and on, per sync offset
    megarl bench sync       bytes, seconds and memory of one weight sync: partitioned vs raw vs broadcast
    megarl bench longtail   long-tailed responses on the real fleet: static split vs shared queue, and projected
    megarl bench inflight   in-flight weight updates + partial rollouts, projected (pure simulation, no fleet)
    megarl bench inflight-fleet   the same measured on the real fleet against today's queue, same batches
    megarl bench engine-step  one vLLM CPU replica's decode step against the sequences it runs (step + per seq x N)
    megarl bench savings    the same short job at several sync.interval values: bytes, sync seconds, fleet pause
    megarl bench delta      compute cost of delta pushes per GB (count + encode, apply, base copy) on this device
    megarl bench trainer    one training step per variant (fp32, bf16, bf16 with one change on): time, MFU, memory
    megarl bench gpu-step   on a GPU, in one command: bench trainer's variants, bench logprob --hidden, gpu tests
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {"logprob": "megarl.bench.logprob", "padding": "megarl.bench.padding",
           "pipeline": "megarl.bench.pipeline", "sync": "megarl.bench.sync", "longtail": "megarl.bench.longtail",
           "inflight": "megarl.bench.inflight", "inflight-fleet": "megarl.bench.inflight_fleet",
           "engine-step": "megarl.bench.engine_step",
           "savings": "megarl.bench.savings", "delta": "megarl.bench.delta_codec",
           "trainer": "megarl.bench.trainer", "gpu-step": "megarl.bench.gpu_step"}


def register(subparsers: argparse._SubParsersAction) -> None:
    for module in BENCHES.values():
        importlib.import_module(module).register(subparsers)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHES[args.command]).run(args)
