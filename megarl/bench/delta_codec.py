"""`megarl bench delta`: what a delta push (`sync.delta`, `megarl.sync.delta`) costs in compute, per GB of weights,
on this machine's device (CUDA when present, else CPU).

For one block of `--numel` elements in `--dtype` and each changed fraction of `--fractions`, it times the sender's
work (count the changed elements against the base, then encode the block: what `PartitionedWeightSync` does per
block it sends as a delta), the receiver's (write the delta into its base), and the copy of the sender's base from
pinned host memory to the device (where the trainer keeps it: the compare on a GPU reads it across the host link).
Each figure is the median of `--repeats` timed runs after one warm-up, synchronised on CUDA. The bytes on the wire
are exact (`encoded_nbytes`). Prints a table and writes `--out` (JSON).

    megarl bench delta [--numel 268435456] [--dtype bfloat16] [--fractions 0.01 0.03 0.1 0.3] [--out F.json]

Runs with torch alone (no vLLM, megatron or config import), so it also runs where only PyTorch is installed:
`python -m megarl.bench.delta_codec ...`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.sync.delta import apply, changed_mask, encode, encoded_nbytes


def _timed(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(numel: int, dtype: torch.dtype, fractions: list[float], repeats: int, seed: int = 0) -> dict[str, Any]:
    """The rows of the table: one per changed fraction."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    base = (torch.randn(numel, generator=g, device=device) * 0.02).to(dtype)
    host_base = torch.empty(numel, dtype=dtype, pin_memory=cuda)
    host_base.copy_(base)
    gb = numel * dtype.itemsize / 1e9
    rows = []
    for fraction in fractions:
        new = base.clone()
        where = torch.rand(numel, generator=g, device=device) < fraction
        new[where] = (new[where].float() * 1.01 + 1e-3).to(dtype)  # moves every chosen element's bits
        changed = int(changed_mask(new, base).sum())
        encoding, nbytes = encoded_nbytes(numel, changed, dtype.itemsize)
        wire = encode(new, base, encoding, nbytes)
        target = base.clone()
        apply(target, wire, encoding, changed)
        if not torch.equal(target.view(torch.uint8), new.view(torch.uint8)):
            raise AssertionError(f"the decoded block differs from the new one at fraction {fraction}")
        count_s = _timed(lambda n=new: int(changed_mask(n, base).sum()), repeats, cuda)
        encode_s = _timed(lambda n=new, e=encoding, b=nbytes: encode(n, base, e, b), repeats, cuda)
        apply_s = _timed(lambda w=wire, e=encoding, c=changed: apply(base.clone(), w, e, c), repeats, cuda)
        clone_s = _timed(lambda: base.clone(), repeats, cuda)  # apply's timing includes a clone: subtracted
        rows.append({"fraction": fraction, "changed": changed, "encoding": encoding, "wire_bytes": nbytes,
                     "wire_vs_full": nbytes / (numel * dtype.itemsize),
                     "sender_gbps": gb / (count_s + encode_s), "count_s": count_s, "encode_s": encode_s,
                     "apply_s": max(apply_s - clone_s, 0.0), "receiver_gbps": gb / max(apply_s - clone_s, 1e-9)})
    h2d_s = _timed(lambda: host_base.to(device, non_blocking=False), repeats, cuda) if cuda else 0.0
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"device": name, "numel": numel, "dtype": str(dtype).removeprefix("torch."), "gb": gb,
            "host_to_device_gbps": gb / h2d_s if h2d_s else None, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']}: one block of {result['numel']:,} {result['dtype']} elements ({result['gb']:.2f} GB)"
             + (f"; the base from pinned host memory at {result['host_to_device_gbps']:.1f} GB/s"
                if result["host_to_device_gbps"] else ""),
             "| changed | encoding | wire / full | count s | encode s | sender GB/s | apply s | receiver GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['fraction']:.1%} | {r['encoding']} | {r['wire_vs_full']:.3f} | {r['count_s']:.4f} | "
                     f"{r['encode_s']:.4f} | {r['sender_gbps']:.1f} | {r['apply_s']:.4f} | "
                     f"{r['receiver_gbps']:.1f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=1 << 28, help="elements of the block (default 2^28: 0.54 GB bf16)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="wire dtype")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3],
                   help="changed fractions to time")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the median is kept)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench_delta_codec.json"), help="JSON output")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("delta", help="compute cost of delta pushes per GB: count + encode, apply, base copy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.numel < 1 or args.repeats < 1 or any(not 0 <= f <= 1 for f in args.fractions):
        print("megarl bench delta: --numel and --repeats must be positive, --fractions within [0, 1]")
        return 2
    result = measure(args.numel, getattr(torch, args.dtype), args.fractions, args.repeats)
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m megarl.bench.delta_codec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
