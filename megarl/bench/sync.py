"""`megarl bench sync`: what moving the weights costs on the wire, measured in one run on this machine.

Processes: `--trainers` trainer ranks (senders) and `--replicas x --vllm-tp` receivers standing in for vLLM
workers, all joined in one sync group exactly as a real sync joins them (`make_sync_group`: gloo on CPU, NCCL
on GPU, over a TCPStore hosted by trainer rank 0). The model is synthetic: a Qwen3-shaped HF config scaled to
`--size-mb`, each trainer rank holding an even tensor-parallel split of it (`vllm_rank_slices` at
`--trainers` ranks), every element a fixed function of its tensor and global index, so each receiver checks
every value it got against that function.

Methods, timed over `--repeats` runs in the same processes (the median is reported) after one untimed run in
which every receiver checks every value it got:
- `raw`: trainer rank 0 sends one receiver's share of the partitioned sync to receiver 0 as bucket-sized
  point-to-point messages: the link's own bandwidth, with nothing planned or assembled;
- `partitioned`: megarl's sync: `plan_transfers` + `layout_buckets`, senders streaming buckets
  (`megarl.sync.stream.send_buckets`), receivers assembling their slices as buckets arrive (`receive_slices`). Every
  receiver gets exactly the slices its vLLM TP rank loads;
- `broadcast`: what vLLM's own `nccl` weight-transfer backend does (`NCCLWeightTransferEngine`): trainer rank 0
  holds full tensors (here it first receives the other trainer ranks' shards and assembles each bucket of
  full tensors, as a gather-then-broadcast trainer does) and broadcasts every bucket to every receiver
  (one group of trainer 0 and all receivers). Each receiver gets the whole model.

Reported per method: bytes each receiver got, bytes on the wire, seconds, GB/s of receiver-bound bytes, and
its time over the time `raw` would take to move all receiver-bound bytes as one stream (on one machine every
stream shares the loopback and the cores, so 1.00 means "as fast as the machine moves bytes at all"). Also the
peak memory growth of every process during a sync (the kernel's resident-set high-water mark, reset before
each run, against the resident size at its start; glibc's mmap threshold is fixed at 1 MiB in these
processes so that freed buffers leave the resident set: `map_large_buffers`) and the senders' exact staging
peak. Writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megarl.sync.peak_memory import map_large_buffers
from megarl.sync.peak_memory import peak_rss_bytes as _peak_rss_bytes
from megarl.sync.peak_memory import reset_peak_rss as _reset_peak_rss
from megarl.sync.peak_memory import rss_bytes as _rss_bytes

METHODS = ("raw", "partitioned", "broadcast")


@dataclass(frozen=True)
class SyncBenchSpec:
    hf: dict[str, Any]  # the synthetic HF config
    dtype: str  # torch dtype name of every weight
    trainers: int
    vllm_tp: int
    replicas: int
    bucket_bytes: int
    repeats: int
    methods: tuple[str, ...]
    window: int = 2  # send buckets in flight per trainer rank

    @property
    def receivers(self) -> int:
        return self.vllm_tp * self.replicas


def synthetic_hf(size_bytes: int, itemsize: int, hidden: int = 1024, vocab: int = 32768) -> dict[str, Any]:
    """A Qwen3-dense-shaped config whose weights take about `size_bytes` (at least one layer)."""
    heads = max(1, hidden // 64)
    hf = {"model_type": "qwen3", "hidden_size": hidden, "num_attention_heads": heads,
          "num_key_value_heads": max(1, heads // 2), "head_dim": 64, "intermediate_size": 3 * hidden,
          "vocab_size": vocab, "tie_word_embeddings": False, "num_hidden_layers": 1}
    from megarl.models.shapes import total_params

    one = total_params(hf)
    per_layer = total_params({**hf, "num_hidden_layers": 2}) - one
    hf["num_hidden_layers"] = max(1, round((size_bytes / itemsize - (one - per_layer)) / per_layer))
    return hf


def block_values(name: str, box: tuple[tuple[int, int], ...], dtype):
    """The synthetic weights of `box` of tensor `name`: sin(seed + 1e-3 * row + 1.7e-2 * col), computed from
    global indices, so any rank can produce (or check) any block on its own."""
    import torch

    seed = zlib.crc32(name.encode()) % 1000
    rows = torch.arange(*box[0], dtype=torch.float64)
    if len(box) == 1:
        return torch.sin(seed + 1e-3 * rows).to(dtype)
    cols = torch.arange(*box[1], dtype=torch.float64)
    return torch.sin(seed + 1e-3 * rows[:, None] + 1.7e-2 * cols[None, :]).to(dtype)


def _group(store, rank: int, members: list[int], prefix: str, timeout_s: float):
    """A process group of `members` (sync-group ranks) over the same store; None on non-members."""
    import torch.distributed as dist

    from megarl.sync.transport import process_group

    if rank not in members:
        return None
    return process_group(dist.PrefixStore(prefix, store), members.index(rank), len(members), timeout_s)


def _plan(spec: SyncBenchSpec):
    import torch

    from megarl.sync.plan import plan_transfers, vllm_rank_slices
    from megarl.sync.wire import layout_buckets

    holdings = {t: vllm_rank_slices(spec.hf, spec.trainers, t) for t in range(spec.trainers)}
    needs = {spec.trainers + rep * spec.vllm_tp + r: vllm_rank_slices(spec.hf, spec.vllm_tp, r)
             for rep in range(spec.replicas) for r in range(spec.vllm_tp)}
    dtype = getattr(torch, spec.dtype)
    dtypes = {b.name: dtype for blocks in holdings.values() for b in blocks}
    return holdings, needs, layout_buckets(plan_transfers(holdings, needs), dtypes, spec.bucket_bytes)


def _check(blocks: dict, needs: list, dtype) -> None:
    """Every needed slice arrived whole and holds the synthetic values (raises naming the first wrong one)."""
    import torch

    got = {name: block for name, (block, _) in blocks.items()}
    want = {b.name: b for b in needs}
    if got != want:
        raise AssertionError(f"received slices differ from the needed ones: {sorted(set(got) ^ set(want))[:5]}")
    for name, (block, data) in blocks.items():
        if not torch.equal(data, block_values(name, block.box, dtype)):
            raise AssertionError(f"{name} {block.box}: received values differ from the trainer's")


def _partitioned(rank: int, spec: SyncBenchSpec, group, local, entries, needs, check: bool) -> dict[str, Any]:
    from megarl.sync.stream import receive_slices, send_buckets

    if rank < spec.trainers:
        sent = send_buckets(group, rank, entries, local, window=spec.window)
        return {"bytes_sent": sent.bytes_sent, "staging_peak_bytes": sent.peak_staging_bytes}
    mine = [e for e in entries if e.receiver == rank]
    blocks, received = receive_slices(group, mine)
    if check:
        import torch

        _check(blocks, needs[rank], getattr(torch, spec.dtype))
    return {"bytes_received": received}


def _broadcast(rank: int, spec: SyncBenchSpec, group, bcast, local, full_entries, check: bool) -> dict[str, Any]:
    """Gather-then-broadcast: trainer ranks > 0 send their shards to trainer 0, bucket by bucket; trainer 0
    assembles the bucket of full tensors and broadcasts it to every receiver."""
    import torch

    from megarl.sync.slices import HFSlice
    from megarl.sync.stream import cut, holders_by_name
    from megarl.sync.wire import device, to_bytes

    dtype = getattr(torch, spec.dtype)
    by_name = holders_by_name(local)
    out: dict[str, Any] = {"bytes_sent": 0, "bytes_received": 0}
    tag = 0  # one tag per (tensor, piece), in the order both sides walk the buckets
    for items in full_entries:  # items: (name, full_shape, offset, nbytes, [(sender, box), ...])
        size = max(off + n for _, _, off, n, _ in items)
        if rank == 0:
            buf = torch.empty(size, dtype=torch.uint8, device=device())
            works = []
            for name, shape, off, n, pieces in items:
                whole = torch.empty(shape, dtype=dtype, device=device())
                for sender, box in pieces:
                    index = tuple(slice(a, b) for a, b in box)
                    tag += 1
                    if sender == 0:
                        whole[index] = cut(by_name, HFSlice(name, tuple(shape), box))
                    else:
                        piece = torch.empty([b - a for a, b in box], dtype=dtype, device=device())
                        works.append((group.recv([piece], sender, tag), whole, index, piece))
                for work, target, index, piece in works:
                    work.wait()
                    target[index] = piece
                works = []
                buf[off:off + n] = to_bytes(whole)
            bcast.broadcast(buf, 0).wait()
            out["bytes_sent"] += size * spec.receivers
        elif rank < spec.trainers:
            works = []
            for name, shape, _, _, pieces in items:
                for sender, box in pieces:
                    tag += 1
                    if sender == rank:
                        piece = cut(by_name, HFSlice(name, tuple(shape), box)).contiguous()
                        works.append((group.send([piece], 0, tag), piece))
                        out["bytes_sent"] += piece.numel() * piece.element_size()
            for work, _ in works:
                work.wait()
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=device())
            bcast.broadcast(buf, 0).wait()
            out["bytes_received"] += size
            if check:
                for name, shape, off, n, _ in items:
                    data = buf[off:off + n].view(dtype).reshape(shape)
                    if not torch.equal(data, block_values(name, tuple((0, s) for s in shape), dtype)):
                        raise AssertionError(f"{name}: broadcast values differ from the trainer's")
    return out


def _full_entries(spec: SyncBenchSpec, holdings) -> list[list]:
    """Buckets of whole HF tensors for the broadcast baseline, each tensor with the trainer pieces covering it."""
    import torch

    from megarl.sync.plan import plan_transfers, vllm_rank_slices

    itemsize = getattr(torch, spec.dtype).itemsize
    whole = {-1: vllm_rank_slices(spec.hf, 1, 0)}
    plan = plan_transfers(holdings, whole)
    pieces: dict[str, list] = {}
    for t in plan:
        pieces.setdefault(t.block.name, []).append((t.sender, t.block.box))
    buckets: list[list] = []
    items: list = []
    used = 0
    for block in whole[-1]:
        nbytes = block.numel * itemsize
        if items and used + nbytes > spec.bucket_bytes:
            buckets.append(items)
            items, used = [], 0
        items.append((block.name, block.full_shape, used, nbytes, pieces[block.name]))
        used += nbytes
    if items:
        buckets.append(items)
    return buckets


def _raw(rank: int, spec: SyncBenchSpec, group, nbytes: int) -> dict[str, Any]:
    import torch

    from megarl.sync.wire import device

    receiver = spec.trainers
    if rank not in (0, receiver):
        return {}
    sizes = [min(spec.bucket_bytes, nbytes - off) for off in range(0, nbytes, spec.bucket_bytes)]
    bufs = [torch.ones(n, dtype=torch.uint8, device=device()) for n in sizes]
    if rank == 0:
        works = [group.send([b], receiver, i) for i, b in enumerate(bufs)]
    else:
        works = [group.recv([b], 0, i) for i, b in enumerate(bufs)]
    for w in works:
        w.wait()
    return {"bytes_sent" if rank == 0 else "bytes_received": nbytes}


def bench_rank(rank: int, spec: SyncBenchSpec, host: str, port: int, check: bool = True) -> dict[str, Any]:
    """One process of the benchmark (sync-group rank `rank`): every method, `spec.repeats` times each."""
    import torch

    from megarl.sync.transport import make_sync_group

    # one intra-op thread: torch's OpenMP workers spin after each parallel copy, and with several ranks on a few
    # cores they take the CPU from gloo's transport threads (measured: 3-4x slower receives on 2 cores)
    torch.set_num_threads(1)
    map_large_buffers()  # the memory growth measured below counts every buffer a method allocates
    if torch.cuda.is_available():  # one GPU per rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    world = spec.trainers + spec.receivers
    store, group = make_sync_group(host, port, rank, world)
    bcast = _group(store, rank, [0, *range(spec.trainers, world)], "bench_broadcast", 600.0)
    holdings, needs, entries = _plan(spec)
    dtype = getattr(torch, spec.dtype)
    local = [(b, block_values(b.name, b.box, dtype)) for b in holdings.get(rank, [])]
    raw_bytes = sum(e.nbytes for e in entries if e.receiver == spec.trainers)
    full = _full_entries(spec, holdings) if "broadcast" in spec.methods else []
    results: dict[str, Any] = {"rank": rank, "role": "trainer" if rank < spec.trainers else "receiver",
                               "held_bytes": sum(t.numel() * t.element_size() for _, t in local)}
    for method in spec.methods:
        runs = []
        for repeat in range(-1 if check else 0, spec.repeats):  # run -1 checks every value, untimed
            group.barrier().wait()
            _reset_peak_rss()
            rss0 = _rss_bytes()
            t0 = time.perf_counter()
            if method == "raw":
                info = _raw(rank, spec, group, raw_bytes)
            elif method == "partitioned":
                info = _partitioned(rank, spec, group, local, entries, needs, repeat < 0)
            else:
                info = _broadcast(rank, spec, group, bcast, local, full, repeat < 0)
            if torch.cuda.is_available():  # NCCL's waits return before the GPU is done: time what it did
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            group.barrier().wait()  # the method ends when every process has finished it
            wall = time.perf_counter() - t0
            if repeat >= 0:
                runs.append({**info, "seconds": seconds, "wall_s": wall,
                             "memory_growth_bytes": max(0, _peak_rss_bytes() - rss0)})
        results[method] = runs
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(spec: SyncBenchSpec, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: receiver bytes, wire bytes, median wall seconds, GB/s, time relative to raw."""
    model_bytes = sum(math.prod(b.full_shape) for b in _whole(spec)) * _itemsize(spec)
    out: dict[str, Any] = {"spec": {**asdict(spec), "hf": spec.hf}, "model_bytes": model_bytes, "methods": {},
                           # the weights each process holds before any sync (to read the memory growth against)
                           "held_bytes": {r["rank"]: r["held_bytes"] for r in per_rank}}
    receivers = [r for r in per_rank if r["role"] == "receiver"]
    for method in spec.methods:
        walls = [max(r[method][i]["wall_s"] for r in per_rank) for i in range(spec.repeats)]
        received = [r[method][0].get("bytes_received", 0) for r in receivers]
        wire = sum(r[method][0].get("bytes_sent", 0) for r in per_rank if r["role"] == "trainer")
        seconds = _median(walls)
        out["methods"][method] = {
            "bytes_per_receiver": received, "bytes_on_wire": wire,
            "bytes_per_sender": [r[method][0].get("bytes_sent", 0) for r in per_rank if r["role"] == "trainer"],
            "seconds": seconds, "seconds_all": walls,
            "GBps": sum(received) / seconds / 1e9 if seconds > 0 else None,
            "memory_growth_bytes": {r["rank"]: max(x["memory_growth_bytes"] for x in r[method]) for r in per_rank},
            "staging_peak_bytes": {r["rank"]: r[method][0]["staging_peak_bytes"] for r in per_rank
                                   if "staging_peak_bytes" in r[method][0]},
        }
    if "raw" in out["methods"]:
        raw = out["methods"]["raw"]
        raw_bps = sum(raw["bytes_per_receiver"]) / raw["seconds"]  # bytes / s of one point-to-point stream
        for m in out["methods"].values():  # seconds / the seconds raw would take for all receiver-bound bytes
            moved = sum(m["bytes_per_receiver"])
            m["vs_raw"] = m["seconds"] * raw_bps / moved if moved else None
    return out


def _whole(spec: SyncBenchSpec):
    from megarl.sync.plan import vllm_rank_slices

    return vllm_rank_slices(spec.hf, 1, 0)


def _itemsize(spec: SyncBenchSpec) -> int:
    import torch

    return getattr(torch, spec.dtype).itemsize


def run_bench(spec: SyncBenchSpec, check: bool = True) -> dict[str, Any]:
    """Run every method in `trainers + receivers` fresh processes; the summary of `summarize`."""
    from megarl.parallel.spawn import free_port, run_ranks

    per_rank = run_ranks(bench_rank, spec.trainers + spec.receivers, spec, "127.0.0.1", free_port(), check,
                         role="bench sync rank")
    return summarize(spec, per_rank)


def format_table(result: dict[str, Any]) -> str:
    spec = result["spec"]
    lines = [f"model {result['model_bytes'] / 1e6:,.1f} MB ({spec['dtype']}), trainer ranks {spec['trainers']}, "
             f"receivers {spec['replicas']} x TP{spec['vllm_tp']}, bucket {spec['bucket_bytes'] / 2**20:g} MiB, "
             f"median of {spec['repeats']}",
             "| method | MB per receiver | MB on the wire | seconds | GB/s to receivers | time / raw for those bytes |",
             "|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        per = "/".join(f"{b / 1e6:,.1f}" for b in m["bytes_per_receiver"])
        vs = f"{m['vs_raw']:.2f}" if m.get("vs_raw") is not None else "-"
        gbps = f"{m['GBps']:.3f}" if m["GBps"] is not None else "-"
        lines.append(f"| {name} | {per} | {m['bytes_on_wire'] / 1e6:,.1f} | {m['seconds']:.3f} | {gbps} | {vs} |")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sync", help="bytes and seconds of megarl's partitioned sync vs raw point-to-point "
                              "and vLLM-style gather-then-broadcast")
    p.add_argument("--size-mb", type=float, default=400.0, help="synthetic model size (MB of weights)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks (senders), an even TP split")
    p.add_argument("--vllm-tp", type=int, default=2, help="tensor-parallel size of each receiving replica")
    p.add_argument("--replicas", type=int, default=1, help="receiving replicas")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size (MiB), as sync.bucket_mb")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", type=Path, default=Path("artifacts/bench_sync.json"))
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    itemsize = getattr(torch, args.dtype).itemsize
    spec = SyncBenchSpec(hf=synthetic_hf(int(args.size_mb * 1e6), itemsize), dtype=args.dtype,
                         trainers=args.trainers, vllm_tp=args.vllm_tp, replicas=args.replicas,
                         bucket_bytes=int(args.bucket_mb * 2**20), repeats=args.repeats, methods=tuple(args.methods))
    print(f"megarl bench sync: {spec.trainers} trainer ranks -> {spec.replicas} x TP{spec.vllm_tp}, "
          f"{spec.hf['num_hidden_layers']} layers, {args.size_mb:g} MB target", file=sys.stderr)
    result = run_bench(spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0
