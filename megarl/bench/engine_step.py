"""`megarl bench engine-step`: what one decode step of a vLLM CPU replica costs against the sequences it runs.

One tiny-MoE vLLM CPU replica, started as `megarl bench inflight-fleet` starts each of its replicas (the same tiny
checkpoint, `--positions` its context; `--node-replicas` replicas' share of the cores: by default 2, so the replica
gets the one core it gets in the fleet bench's 2-replica fleet). For each N in `--sizes`: one request of a 4-token
prompt with `n = N` samples (vLLM runs them as N sequences admitted together), `ignore_eos`, exactly `--tokens` T
tokens each; `--repeats` times each N (the sizes interleaved, round by round, so drift in the machine's load hits
every N alike), after one discarded warm-up round.

The seconds a decode step takes, per N, from vLLM's own per-request figures (its Prometheus `/metrics`, read before
and after the request): `vllm:request_decode_time_seconds` (a request's first token to its last) summed over the N
sequences, over `vllm:request_generation_tokens` less one per sequence (the decode steps after the first token,
which the prefill step makes): with the N decoding in lockstep, that is the engine's step. Beside it the wall
clock: the request's wall / T (an upper bound: it includes the HTTP call and the prefill). The medians over the
repeats are fitted by least squares to `step_s + per_seq_s x N` (`fit_step_cost`): the engine model of
`megarl.bench.dispatch_sim.EngineCosts` (which `megarl bench inflight --fleet-check --engine-step FILE` takes the
ratio per_seq_s / step_s from).

Then the condition of the fleet bench's in-flight mode, where a long response runs beside short ones that come and
go: one long request (`--samples` x `--churn-tokens`) beside each number of `--churn-loops` loops of short requests
(`--samples` x `--short-tokens`, each loop sending its next request as soon as its last one is answered, as the
bench's group loops do; 7 is the bench's 8 loops a replica less the long group's), the long one sent 1 s after the
loops start, `max(1, --repeats - 1)` times each: the long request's wall per token, against the fit at every
sequence running (an upper bound of what the per-sequence cost alone explains), the short requests' latency before
the long one starts and beside it, and vLLM's own means (`/metrics`: arrival to finish, waiting for the scheduler,
prefill) of the requests that finished beside it, the long one's sequences left out.

Then the pauses of the in-flight pushes, without the weights: the long request beside `--pause-loops` short loops,
as above, with no pauses, with a pause every `--pause-every` seconds of `--pause-s` seconds in vLLM's keep mode (the
requests frozen in the engine, their KV kept), and with the same pauses preempting every running request
(`sync.inflight_kv=recompute`: the KV recomputed at the resume), `max(1, --repeats - 1)` times each: the long
request's wall per token, and outside the pauses. Prints the tables, writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SIZES = (1, 2, 4, 8, 16, 32, 64)
PROMPT = [5, 7, 8, 9]  # 4 tokens of the tiny tokenizer (the fleet bench's prompts are 4 tokens too)
DECODE_S = "vllm:request_decode_time_seconds_sum"
TOKENS_SUM = "vllm:request_generation_tokens_sum"
TOKENS_COUNT = "vllm:request_generation_tokens_count"
# a finished request's phases in vLLM's own clock: arrival to finish, waiting for the scheduler, prefill (scheduled to
# first token)
PHASES = {"e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds"}


def fit_step_cost(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of `seconds[i] ~ step_s + per_seq_s x sizes[i]`: (step_s, per_seq_s)."""
    n = len(sizes)
    if n != len(seconds) or n < 2 or len(set(sizes)) < 2:
        raise ValueError(f"a line needs at least two distinct sizes, got sizes {list(sizes)} for {len(seconds)} "
                         "figures")
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    per_seq = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sxx
    return my - per_seq * mx, per_seq


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each metric of `names` in a Prometheus text exposition, summed over its label sets (0 when absent)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def step_from_metrics(before: dict[str, float], after: dict[str, float]) -> tuple[float, int]:
    """(seconds a decode step, sequences finished) between two readings of `metric_sums`: the sequences' decode
    seconds over their decode steps (tokens after the first)."""
    sequences = round(after[TOKENS_COUNT] - before[TOKENS_COUNT])
    steps = after[TOKENS_SUM] - before[TOKENS_SUM] - sequences
    if sequences < 1 or steps <= 0:
        raise RuntimeError(f"vLLM's /metrics saw {sequences} requests finish with {steps:g} decode steps: is the "
                           "server logging stats (no --disable-log-stats)?")
    return (after[DECODE_S] - before[DECODE_S]) / steps, sequences


def read_metrics(url: str, headers: dict[str, str], names: Sequence[str]) -> dict[str, float]:
    import requests

    r = requests.get(f"{url}/metrics", headers=headers, timeout=60)
    r.raise_for_status()
    return metric_sums(r.text, names)


def phase_means(before: dict[str, float], after: dict[str, float], leave_out: int, leave_out_e2e_s: float
                ) -> dict[str, float | None]:
    """Mean seconds a finished request spent in each of `PHASES` between two readings, `leave_out` requests (the long
    request's sequences, `leave_out_e2e_s` seconds of arrival-to-finish each; their queue and prefill are taken as
    nothing) left out."""
    count = after[PHASES["e2e"] + "_count"] - before[PHASES["e2e"] + "_count"] - leave_out
    if count < 1:
        return dict.fromkeys(PHASES)
    out: dict[str, float | None] = {}
    for key, name in PHASES.items():
        total = after[name + "_sum"] - before[name + "_sum"]
        out[key] = (total - (leave_out * leave_out_e2e_s if key == "e2e" else 0.0)) / count
    return out


def measure_size(url: str, headers: dict[str, str], size: int, tokens: int, seed: int) -> dict[str, Any]:
    """One request of `size` samples x `tokens` tokens: s/step from vLLM's metrics and from the wall clock."""
    import requests

    def read() -> dict[str, float]:
        r = requests.get(f"{url}/metrics", headers=headers, timeout=60)
        r.raise_for_status()
        return metric_sums(r.text, (DECODE_S, TOKENS_SUM, TOKENS_COUNT))

    before = read()
    body = {"token_ids": PROMPT, "request_id": f"engine-step-{size}-{seed}-{time.time_ns()}",
            "sampling_params": {"n": size, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0,
                                "seed": seed}}
    t0 = time.perf_counter()
    r = requests.post(f"{url}/inference/v1/generate", json=body, headers=headers, timeout=1200)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    lengths = [len(c["token_ids"]) for c in r.json()["choices"]]
    if lengths != [tokens] * size:
        raise RuntimeError(f"N={size}: asked for {size} x {tokens} tokens (ignore_eos), got {lengths}")
    time.sleep(0.3)  # the engine's stats reach the API server's metrics at its next output batch
    step_s, sequences = step_from_metrics(before, read())
    if sequences != size:
        raise RuntimeError(f"N={size}: vLLM's /metrics counted {sequences} finished requests (another client on this "
                           "replica?)")
    return {"size": size, "step_s": step_s, "wall_s": wall, "wall_per_token_s": wall / tokens}


def measure_churn(url: str, headers: dict[str, str], loops: int, tokens: int, short_tokens: int, samples: int,
                  seed: int, pauses: str | None = None, every_s: float = 3.0, pause_s: float = 0.7,
                  client: Any = None) -> dict[str, Any]:
    """One long request (`samples` x `tokens`) beside `loops` loops of short ones (`samples` x `short_tokens`, each loop
    sending its next request when its last one is answered, as the fleet bench's group loops do), started 1 s
    before it: the long request's wall / `tokens`, the short requests answered while it ran, and the short requests'
    median latency (send to answer) before the long request started and while it ran. `pauses` ('keep' or
    'recompute', with `client` a `RolloutClient` of the replica): while the long request runs, every `every_s` seconds
    the replica is paused as an in-flight push pauses it (vLLM's keep mode; 'recompute': then every running request
    preempted, its KV recomputed at the resume, `sync.inflight_kv=recompute`) for `pause_s` seconds, and resumed (no
    weights move): the paused seconds are counted, so that the pace outside the pauses is known."""
    import threading

    import requests

    stop, lock, done = threading.Event(), threading.Lock(), []

    def body(n: int, max_tokens: int, key: str) -> dict[str, Any]:
        return {"token_ids": PROMPT, "request_id": f"engine-step-{key}-{time.time_ns()}",
                "sampling_params": {"n": n, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
                                    "seed": seed}}

    def loop(i: int) -> None:
        while not stop.is_set():
            sent = time.perf_counter()
            r = requests.post(f"{url}/inference/v1/generate", json=body(samples, short_tokens, f"short{i}"),
                              headers=headers, timeout=600)
            r.raise_for_status()
            with lock:
                done.append((sent, time.perf_counter()))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(loops)]
    for t in threads:
        t.start()
    time.sleep(1.0 if loops else 0.0)
    paused, finished, failed = [0.0, 0], threading.Event(), []

    def pauser() -> None:
        while not finished.wait(every_s):
            a = time.perf_counter()
            try:
                client.pause(mode="keep", clear_cache=False)
                if pauses == "recompute" and not client.reset_prefix_cache(True):
                    raise RuntimeError("the replica did not empty its prefix cache after preempting its requests")
                time.sleep(max(0.0, pause_s - (time.perf_counter() - a)))
            except BaseException as err:  # noqa: BLE001 - raised by the measuring thread, after the resume
                failed.append(err)
                finished.set()
            finally:
                client.resume()  # never leave the replica paused: the long request would wait for ever
            paused[0] += time.perf_counter() - a
            paused[1] += 1

    holder = threading.Thread(target=pauser, daemon=True) if pauses else None
    names = [n + suffix for n in PHASES.values() for suffix in ("_sum", "_count")]
    before = read_metrics(url, headers, names)
    t0 = time.perf_counter()
    if holder is not None:
        holder.start()
    r = requests.post(f"{url}/inference/v1/generate", json=body(samples, tokens, "long"), headers=headers,
                      timeout=1200)
    t1 = time.perf_counter()
    time.sleep(0.3)  # the stats reach the API server's metrics at its next output batch
    phases = phase_means(before, read_metrics(url, headers, names), samples, t1 - t0)
    finished.set()
    if holder is not None:
        holder.join()
    stop.set()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"pauses {pauses}: a pause failed: {failed[0]}") from failed[0]
    r.raise_for_status()
    if [len(c["token_ids"]) for c in r.json()["choices"]] != [tokens] * samples:
        raise RuntimeError(f"churn {loops}: the long request did not return {samples} x {tokens} tokens")
    alone = [b - a for a, b in done if b < t0]
    beside = [b - a for a, b in done if t0 <= b <= t1]
    return {"loops": loops, "pauses": pauses, "paused_s": paused[0], "pause_count": paused[1],
            "long_per_token_unpaused_s": (t1 - t0 - paused[0]) / tokens,
            "long_wall_s": t1 - t0, "long_per_token_s": (t1 - t0) / tokens,
            "short_answered": len(beside), "short_per_s": len(beside) / (t1 - t0),
            "short_latency_alone_s": statistics.median(alone) if alone else None,
            "short_latency_beside_s": statistics.median(beside) if beside else None,
            "finished_beside": {f"{k}_s": v for k, v in phases.items()}}


def measure_churns(url: str, headers: dict[str, str], loops: Sequence[int], tokens: int, short_tokens: int,
                   samples: int, repeats: int) -> list[dict]:
    out = []
    for r in range(repeats):
        for n in (loops if r % 2 == 0 else loops[::-1]):
            out.append({"round": r, **measure_churn(url, headers, n, tokens, short_tokens, samples, 7 + r)})
            x = out[-1]
            print(f"round {r}, {n} short loops: the long request {x['long_per_token_s'] * 1e3:.2f} ms a token, "
                  f"{x['short_answered']} short requests beside it ({x['short_per_s']:.1f}/s, median latency "
                  f"{_s(x['short_latency_beside_s'])}; before it {_s(x['short_latency_alone_s'])}; vLLM's means of the "
                  f"requests finished beside it: {_phases(x['finished_beside'])})", flush=True)
    return out


def measure_pauses(url: str, headers: dict[str, str], client: Any, loops: int, tokens: int, short_tokens: int,
                   samples: int, every_s: float, pause_s: float, repeats: int) -> list[dict]:
    """The long request beside `loops` short loops with no pauses, with keep-mode pauses and with recompute pauses
    (`measure_churn`), `repeats` rounds."""
    out = []
    kinds: tuple[str | None, ...] = (None, "keep", "recompute")
    for r in range(repeats):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            out.append({"round": r, **measure_churn(url, headers, loops, tokens, short_tokens, samples, 7 + r, kind,
                                                    every_s, pause_s, client)})
            x = out[-1]
            print(f"round {r}, pauses {kind or 'none'}: the long request {x['long_per_token_s'] * 1e3:.2f} ms a token "
                  f"({x['pause_count']} pauses, {x['paused_s']:.2f} s; outside them "
                  f"{x['long_per_token_unpaused_s'] * 1e3:.2f} ms a token)", flush=True)
    return out


def summarize_pauses(samples: list[dict]) -> list[dict]:
    rows = []
    for kind in (None, "keep", "recompute"):
        mine = [s for s in samples if s["pauses"] == kind]
        if mine:
            rows.append({"pauses": kind or "none",
                         **{k: statistics.median(s[k] for s in mine) for k in
                            ("long_per_token_s", "long_per_token_unpaused_s", "paused_s", "pause_count")},
                         "long_per_token_s_all": [s["long_per_token_s"] for s in mine]})
    return rows


def _phases(p: dict[str, float | None]) -> str:
    return ", ".join(f"{k[:-2]} {_s(v)}" for k, v in p.items())


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_churn(samples: list[dict], loops: Sequence[int], summary: dict[str, Any], sequences: int,
                    short_tokens: int) -> list[dict]:
    """Per number of short loops the medians over the repeats, beside the fit's step at the most the replica can
    run (the long request's sequences and every loop's, all decoding: an upper bound of the per-sequence part)."""
    rows = []
    for n in loops:
        mine = [s for s in samples if s["loops"] == n]
        full = sequences * (1 + n)
        rows.append({"loops": n, "long_per_token_s": statistics.median(s["long_per_token_s"] for s in mine),
                     "long_per_token_s_all": [s["long_per_token_s"] for s in mine],
                     "short_per_s": statistics.median(s["short_per_s"] for s in mine),
                     "short_latency_alone_s": _median([s["short_latency_alone_s"] for s in mine]),
                     "short_latency_beside_s": _median([s["short_latency_beside_s"] for s in mine]),
                     **{f"finished_beside_{k}": _median([s["finished_beside"][k] for s in mine])
                        for k in mine[0]["finished_beside"]},
                     "fitted_full_s": summary["step_s"] + summary["per_seq_s"] * full, "sequences_at_most": full})
    return rows


def measure(url: str, headers: dict[str, str], sizes: Sequence[int], tokens: int, repeats: int) -> list[dict]:
    """A discarded warm-up round, then `repeats` rounds over every size (even rounds ascending, odd descending)."""
    for size in sizes:
        measure_size(url, headers, size, min(tokens, 16), seed=size)
    out = []
    for r in range(repeats):
        for size in (sizes if r % 2 == 0 else sizes[::-1]):
            out.append({"round": r, **measure_size(url, headers, size, tokens, seed=1000 * r + size)})
            print(f"round {r} N={size}: {out[-1]['step_s'] * 1e3:.2f} ms a step (wall / T "
                  f"{out[-1]['wall_per_token_s'] * 1e3:.2f} ms)", flush=True)
    return out


def summarize(samples: list[dict], sizes: Sequence[int]) -> dict[str, Any]:
    """Per size the medians over the repeats, the fit on the medians, and each size's fitted figure."""
    rows = []
    for size in sizes:
        mine = [s for s in samples if s["size"] == size]
        rows.append({"size": size, "step_s": statistics.median(s["step_s"] for s in mine),
                     "step_s_all": [s["step_s"] for s in mine],
                     "wall_per_token_s": statistics.median(s["wall_per_token_s"] for s in mine)})
    a, b = fit_step_cost([r["size"] for r in rows], [r["step_s"] for r in rows])
    for r in rows:
        r["fitted_s"] = a + b * r["size"]
    return {"step_s": a, "per_seq_s": b, "per_seq_over_step": b / a, "rows": rows}


def table(summary: dict[str, Any]) -> str:
    lines = ["| N running | s/step, vLLM metrics (median; all) | fitted | wall / T |", "|---:|---|---:|---:|"]
    for r in summary["rows"]:
        every = ", ".join(f"{x * 1e3:.2f}" for x in r["step_s_all"])
        lines.append(f"| {r['size']} | {r['step_s'] * 1e3:.2f} ms ({every}) | {r['fitted_s'] * 1e3:.2f} ms | "
                     f"{r['wall_per_token_s'] * 1e3:.2f} ms |")
    lines.append(f"\nfit: {summary['step_s'] * 1e3:.3f} ms + {summary['per_seq_s'] * 1e3:.4f} ms x N "
                 f"(per_seq_s / step_s = {summary['per_seq_over_step']:.4f})")
    if summary.get("churn"):
        lines += ["", "| short-request loops beside the long request | the long request, s/token (median; all) | "
                  "fit at N = all sequences running | short requests answered per s | a short request's latency: "
                  "before the long one / beside it | vLLM's means beside it: arrival to finish; queued; prefill |",
                  "|---:|---|---|---:|---|---|"]
        for r in summary["churn"]:
            every = ", ".join(f"{x * 1e3:.2f}" for x in r["long_per_token_s_all"])
            lines.append(f"| {r['loops']} | {r['long_per_token_s'] * 1e3:.2f} ms ({every}) | "
                         f"{r['fitted_full_s'] * 1e3:.2f} ms (N = {r['sequences_at_most']}) | {r['short_per_s']:.1f} | "
                         f"{_s(r['short_latency_alone_s'])} / {_s(r['short_latency_beside_s'])} | "
                         f"{_s(r['finished_beside_e2e_s'])}; {_s(r['finished_beside_queue_s'])}; "
                         f"{_s(r['finished_beside_prefill_s'])} |")
    if summary.get("pauses"):
        lines += ["", "| pauses while the long request runs | the long request, s/token (median; all) | outside the "
                  "pauses | pauses (s) |", "|---|---|---:|---|"]
        for r in summary["pauses"]:
            every = ", ".join(f"{x * 1e3:.2f}" for x in r["long_per_token_s_all"])
            lines.append(f"| {r['pauses']} | {r['long_per_token_s'] * 1e3:.2f} ms ({every}) | "
                         f"{r['long_per_token_unpaused_s'] * 1e3:.2f} ms | {r['pause_count']:g} "
                         f"({r['paused_s']:.2f} s) |")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "engine-step",
        help="a vLLM CPU replica's decode step against the sequences it runs: step_s + per_seq_s x N, measured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="running sequences N to measure")
    p.add_argument("--tokens", type=int, default=128, help="tokens each sequence generates (T, ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the sizes (the medians are fitted)")
    p.add_argument("--positions", type=int, default=1024,
                   help="the tiny model's context, as `megarl bench inflight-fleet --positions` (its long-response "
                        "runs: 1024)")
    p.add_argument("--node-replicas", type=int, default=2,
                   help="replicas whose share of the cores the replica gets (the fleet bench's --replicas: 2)")
    p.add_argument("--churn-loops", type=int, nargs="*", default=[0, 1, 3, 7],
                   help="then: one long request (--samples x --churn-tokens) beside this many loops of short ones "
                        "(--samples x --short-tokens), the fleet bench's in-flight condition (8 group loops a replica, "
                        "one of them the long group's); none: skip")
    p.add_argument("--churn-tokens", type=int, default=500, help="the long request's tokens in the churn part")
    p.add_argument("--short-tokens", type=int, default=8, help="the short requests' tokens (the fleet bench's)")
    p.add_argument("--samples", type=int, default=4, help="samples a request in the churn part (the fleet bench's K)")
    p.add_argument("--pause-loops", type=int, default=7,
                   help="then: the long request beside this many short loops, with no pauses, keep-mode pauses and "
                        "recompute pauses (as an in-flight push pauses the replica, no weights moved); -1: skip")
    p.add_argument("--pause-every", type=float, default=3.0,
                   help="seconds of generation between two pauses (the long-response runs' in-flight step less "
                        "its push)")
    p.add_argument("--pause-s", type=float, default=0.7, help="seconds each pause lasts (those runs' push)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/engine_step_cpu.json"), help="JSON output")
    return p


def run(args: argparse.Namespace) -> int:
    sizes = sorted(set(args.sizes))
    loops = sorted(set(args.churn_loops))
    if len(sizes) < 2 or sizes[0] < 1 or args.tokens < 2 or args.repeats < 1 or args.node_replicas < 1 \
            or max(args.tokens, args.churn_tokens) + len(PROMPT) > args.positions or (loops and loops[0] < 0) \
            or args.samples < 1 or args.short_tokens < 1 or args.pause_every <= 0 or args.pause_s < 0:
        print("megarl bench engine-step: need two or more distinct --sizes >= 1, --tokens >= 2, --repeats >= 1, "
              "--node-replicas, --samples, --short-tokens >= 1, --churn-loops >= 0, --pause-every > 0, --pause-s >= 0, "
              "--tokens and --churn-tokens <= "
              f"--positions - {len(PROMPT)}", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_engine_step_"))
    t0 = time.perf_counter()
    try:
        samples, churn, pauses = _on_replica(args, sizes, loops, work_dir)
    except BaseException:
        print(f"megarl bench engine-step failed: the replica's log is kept in {work_dir}", file=sys.stderr)
        raise
    shutil.rmtree(work_dir, ignore_errors=True)
    summary = summarize(samples, sizes)
    summary["churn"] = summarize_churn(churn, loops, summary, args.samples, args.short_tokens) if loops else []
    summary["pauses"] = summarize_pauses(pauses) if pauses else []
    load = os.getloadavg()
    print(f"\nmeasured ({time.perf_counter() - t0:.0f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}): "
          f"one tiny-MoE vLLM CPU replica (context {args.positions}, a 1/{args.node_replicas} share of "
          f"{len(os.sched_getaffinity(0))} cores), one request of n = N samples x {args.tokens} tokens, "
          f"{args.repeats} repeats")
    print(table(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                             if k != "func"}, "load_average": load, **summary,
                                    "samples": samples, "churn_samples": churn,
                                    "pause_samples": pauses}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _on_replica(args: argparse.Namespace, sizes: list[int], loops: list[int],
                work_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.fleet import FleetSpec, launch
    from megarl.rollout.fleet_auth import bearer_header, read_secret

    model = make_tiny_checkpoint(work_dir / "tiny_moe", kind="moe", positions=args.positions)
    print("starting one vLLM CPU replica of the tiny MoE ...", flush=True)
    with launch(FleetSpec(model_dir=model, tp=1, replicas=1, node_replicas=args.node_replicas,
                          log_dir=work_dir)) as fleet:
        headers = bearer_header(read_secret(fleet.secret_file))
        steps = measure(fleet.base_url, headers, sizes, args.tokens, args.repeats)
        churn = measure_churns(fleet.base_url, headers, loops, args.churn_tokens, args.short_tokens, args.samples,
                               max(1, args.repeats - 1)) if loops else []
        pauses = measure_pauses(fleet.base_url, headers, RolloutClient(fleet.base_url, secret_file=fleet.secret_file),
                                args.pause_loops, args.churn_tokens, args.short_tokens, args.samples, args.pause_every,
                                args.pause_s, max(1, args.repeats - 1)) if args.pause_loops >= 0 else []
        return steps, churn, pauses
