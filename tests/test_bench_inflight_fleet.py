"""`megarl bench inflight-fleet`'s bookkeeping (`megarl.bench.inflight_fleet`) against hand-computed cases: the
replicas' idle share with pushes overlapping requests in flight, the trainer's shares, the length accounting of
trained vs sampled vs dropped responses, one run's steady window and drops, and the paired ratio; and `megarl bench
engine-step`'s (`megarl.bench.engine_step`): its least-squares line and its reading of vLLM's metrics. Pure: no fleet
(the benches themselves run on the real one)."""

import pytest

from megarl.bench.engine_step import (
    DECODE_S,
    PHASES,
    TOKENS_COUNT,
    TOKENS_SUM,
    fit_step_cost,
    metric_sums,
    phase_means,
    step_from_metrics,
)
from megarl.bench.inflight_fleet import (
    FleetBenchSpec,
    covered_s,
    format_tables,
    length_accounting,
    long_call_time,
    replica_time,
    summarize_modes,
    summarize_run,
    trainer_time,
)
from megarl.bench.longtail import long_prompts
from megarl.metrics.timeline import Span


def test_engine_step_fit_by_hand():
    # points (1, 1), (2, 3), (3, 2): means (2, 2); sum (x - 2)(y - 2) = 1, sum (x - 2)^2 = 2: slope 0.5, intercept 1
    assert fit_step_cost([1, 2, 3], [1.0, 3.0, 2.0]) == pytest.approx((1.0, 0.5))
    # exact on a line: 4 ms + 0.25 ms per sequence
    assert fit_step_cost([1, 4, 16, 64], [0.004 + 0.00025 * n for n in (1, 4, 16, 64)]) == pytest.approx(
        (0.004, 0.00025))
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_step_cost([8, 8], [0.01, 0.02])


def test_engine_step_reads_vllms_metrics_by_hand():
    # two readings of vLLM's Prometheus text (two engines' label sets summed): between them 4 sequences finished with
    # 4 x 32 tokens, i.e. 4 x 31 decode steps after the first token, in 2.48 s of decode: 20 ms a step
    before = metric_sums(
        "# HELP vllm:request_decode_time_seconds ...\n"
        'vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:request_decode_time_seconds_sum{engine="1",model_name="m"} 0.5\n'
        'vllm:request_generation_tokens_sum{engine="0",model_name="m"} 100.0\n'
        'vllm:request_generation_tokens_count{engine="0",model_name="m"} 3.0\n'
        'vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 3.0\n', (DECODE_S, TOKENS_SUM, TOKENS_COUNT))
    assert before == {DECODE_S: 2.0, TOKENS_SUM: 100.0, TOKENS_COUNT: 3.0}
    after = {DECODE_S: 2.0 + 2.48, TOKENS_SUM: 100.0 + 4 * 32, TOKENS_COUNT: 7.0}
    step_s, sequences = step_from_metrics(before, after)
    assert (step_s, sequences) == (pytest.approx(0.02), 4)
    with pytest.raises(RuntimeError, match="disable-log-stats"):
        step_from_metrics(before, before)


@pytest.mark.slow  # starts a vLLM CPU replica (about a minute): `make test-all`
def test_engine_step_on_a_real_replica(tmp_path):
    # `megarl bench engine-step` end to end on one real replica: vLLM's per-request decode figures against the
    # independent clock of the bench's own HTTP call, which holds the 47 decode steps after the first token and also
    # the call and the prefill (so it is longer, but by far less than twice at 48 tokens); and the churn part's long
    # request answered in full; the same through keep-mode and recompute pauses
    import argparse
    import json

    from megarl.bench import engine_step

    parser = argparse.ArgumentParser()
    engine_step.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "engine_step.json"
    args = parser.parse_args(["engine-step", "--sizes", "1", "16", "--tokens", "48", "--repeats", "1",
                              "--positions", "128", "--churn-loops", "0", "2", "--churn-tokens", "48",
                              "--pause-loops", "0", "--pause-every", "0.03", "--pause-s", "0.01", "--out", str(out)])
    assert engine_step.run(args) == 0
    data = json.loads(out.read_text())
    assert [r["size"] for r in data["rows"]] == [1, 16]
    for r in data["rows"]:
        wall = r["wall_per_token_s"] * 48
        assert wall / 2 < 47 * r["step_s"] <= wall
    assert data["step_s"] + 16 * data["per_seq_s"] == pytest.approx(data["rows"][1]["step_s"])
    assert [r["loops"] for r in data["churn"]] == [0, 2] and all(r["long_per_token_s"] > 0 for r in data["churn"])
    # the pauses' part: the long request answered in full through keep-mode and recompute pauses (measure_churn
    # raises otherwise), and paused at least once in each
    assert [r["pauses"] for r in data["pauses"]] == ["none", "keep", "recompute"]
    assert [r["pause_count"] >= 1 for r in data["pauses"]] == [False, True, True]


def test_engine_step_phase_means_leave_the_long_request_out_by_hand():
    # between two readings 10 requests finished: the long request's 4 sequences (5.0 s each, arrival to finish) and 6
    # short ones; e2e 26.0 s in all -> (26 - 4 x 5) / 6 = 1.0 s; queued 3.0 s and prefill 0.6 s over the 6 short ones
    # (the long request's own are taken as nothing): 0.5 s and 0.1 s
    before = {f"{n}_{s}": 1.0 for n in PHASES.values() for s in ("sum", "count")}
    after = {**before, PHASES["e2e"] + "_sum": 27.0, PHASES["e2e"] + "_count": 11.0,
             PHASES["queue"] + "_sum": 4.0, PHASES["prefill"] + "_sum": 1.6}
    assert phase_means(before, after, 4, 5.0) == {"e2e": pytest.approx(1.0), "queue": pytest.approx(0.5),
                                                  "prefill": pytest.approx(0.1)}
    assert phase_means(before, before, 4, 5.0) == {"e2e": None, "queue": None, "prefill": None}


def test_covered_seconds_by_hand():
    # [1, 4) u [3, 6) u [8, 12) inside [0, 10): 5 + 2
    assert covered_s([(3, 6), (1, 4), (8, 12)], 0, 10) == pytest.approx(7.0)
    assert covered_s([(-5, -1), (10, 11)], 0, 10) == 0.0


def test_replica_idle_counts_a_push_as_idle_even_with_requests_held():
    # window [0, 10). Replica 0 has requests in flight over [1, 6) and [8, 12) (two overlapping loops at [3, 4));
    # a push pauses every replica over [5, 7). Replica 0 decodes over [1, 5) and [8, 10): 6 s; paused 2 s; nothing in
    # flight and no push over [0, 1) and [7, 8): 2 s; idle share 4 / 10. Replica 1 never has a request: decodes 0 s,
    # paused 2 s, empty 8 s, idle share 1.
    spans = [Span("replica 0", "generate", 1, 4), Span("replica 0", "generate", 3, 6),
             Span("replica 0", "generate", 8, 12), Span("push", "push", 5, 7), Span("trainer", "wait", 0, 1)]
    r0, r1 = replica_time(spans, 0.0, 10.0, 2)
    assert (r0["decoding_s"], r0["paused_s"], r0["empty_s"], r0["idle_share"]) == pytest.approx((6, 2, 2, 0.4))
    assert (r1["decoding_s"], r1["paused_s"], r1["empty_s"], r1["idle_share"]) == pytest.approx((0, 2, 8, 1.0))


def test_trainer_shares_by_hand():
    # [0, 10): waits [0, 2) (for a batch) and [4, 5) (for the fleet before a push), pushes [5, 6), trains [6, 10);
    # a replica's "wait"-kind span on another lane is not the trainer's
    spans = [Span("trainer", "wait", 0, 2), Span("trainer", "wait", 4, 5), Span("push", "push", 5, 6),
             Span("trainer", "train", 6, 10), Span("replica 0", "wait", 2, 4)]
    assert trainer_time(spans, 0.0, 10.0) == pytest.approx({"wait_share": 0.3, "push_share": 0.1,
                                                            "train_share": 0.4})


def test_length_accounting_by_hand():
    # sampled: two short (16) and two long (256) responses, mean 136; trained: three short and one long, mean 76,
    # bias 76 / 136 - 1; one dropped long group of one response
    out = length_accounting([16, 256, 16, 256], [16, 16, 256, 16], [256], 256)
    assert (out["sampled"]["responses"], out["sampled"]["long"], out["sampled"]["mean"]) == (4, 2, 136.0)
    assert (out["trained"]["responses"], out["trained"]["long"], out["trained"]["mean"]) == (4, 1, 76.0)
    assert (out["dropped"]["responses"], out["dropped"]["long"]) == (1, 1)
    assert out["bias"] == pytest.approx(76 / 136 - 1)


def test_one_runs_steady_window_walls_drops_and_lengths_by_hand():
    # 3 steps, the first left out: the window runs from step 0's end (2) to step 2's end (7), 2 batches, 2.5 s a
    # batch; step walls 2 (step 1: 2 -> 4) and 3. Prompts: 2 x 1 sample; long share 0.5 (which prompts are long is
    # the bench's fixed draw, read here from `long_prompts` to know each one's set length). Drops: (step 0, home 0,
    # prompt 1) is before the window; (step 2, home 1, prompt 0) counts, with home batch 1's prompt 0's set length.
    spec = FleetBenchSpec(prompts=2, samples=1, steps=3, skip=1, long_share=0.5, long_tokens=100, short_tokens=10)
    first = 5
    length = {(j, i): 100 if long else 10 for j in range(first, first + 3)
              for i, long in enumerate(long_prompts(j, 2, 0.5))}
    spans = [Span("replica 0", "generate", 1, 6), Span("push", "push", 3, 4)]
    trained = [[999], [10, 10], [10, 100]]
    run = summarize_run(spec, "inflight", first, 0.0, [2.0, 4.0, 7.0], spans, 1, trained,
                        [(0, 0, 1, 2), (2, 1, 0, 2)], {})
    assert run["wall_per_batch_s"] == pytest.approx(2.5) and run["step_walls_s"] == pytest.approx([2.0, 3.0])
    # replica 0 decodes [2, 3) and [4, 6) of [2, 7): 3 s, idle share 2 / 5
    assert run["idle_share"] == pytest.approx(0.4)
    assert (run["dropped_groups"], run["dropped_total"]) == (1, 2)
    assert run["lengths"]["dropped"]["mean"] == length[(first + 1, 0)]
    sampled = [length[(first + j, i)] for j in (1, 2) for i in (0, 1)]
    assert run["lengths"]["sampled"]["mean"] == pytest.approx(sum(sampled) / 4)
    assert run["lengths"]["trained"]["mean"] == pytest.approx(130 / 4)  # step 0's batch is outside the window


def test_long_calls_timed_by_hand():
    # pushes [2, 3) and [5, 7); the window [0, 20); long responses of 100 tokens
    spans = [Span("push", "push", 2, 3), Span("push", "push", 5, 7), Span("replica 0", "generate", 0, 20)]
    calls = [
        {"start": 1.0, "end": 6.0, "long": True, "tokens": 100, "aborted": False},  # 5 s, paused 1 + 1: 3 s for 100
        {"start": 8.0, "end": 9.0, "long": True, "tokens": 100, "aborted": False},  # no push: 10 ms a token
        {"start": 1.0, "end": 4.0, "long": False, "tokens": 8, "aborted": False},  # short: left out
        {"start": 1.0, "end": 4.0, "long": True, "tokens": 40, "aborted": True},  # aborted: left out
        {"start": 15.0, "end": 21.0, "long": True, "tokens": 100, "aborted": False},  # ends after the window
    ]
    timed = long_call_time(calls, spans, 0.0, 20.0, 100)
    assert [(c["wall_s"], c["paused_s"]) for c in timed] == [(5.0, 2.0), (1.0, 0.0)]
    assert [c["decode_ms_per_token"] for c in timed] == pytest.approx([30.0, 10.0])


def test_modes_pair_their_rounds():
    def run(mode, first, wall, dropped=(), aborted=()):
        stats = {"responses": 2, "mean": 5.0, "long": 0}
        return {"mode": mode, "first_batch": first, "wall_per_batch_s": wall, "step_walls_s": [wall, wall],
                "idle_share": 0.5, "wait_share": 0.1, "push_share": 0.1, "dropped_groups": len(dropped),
                "lengths": {"trained": stats, "sampled": stats}, "held_per_push": [], "pushes": [], "max_token_lag": 1,
                "responses_spanning": 0, "steady_steps": [2, 12], "dropped": [list(d) for d in dropped],
                "aborted": [list(a) for a in aborted],
                "long_calls": [{"wall_s": wall, "paused_s": 0.5, "decode_ms_per_token": 10.0}]}

    # (step, home, prompt, lag) per drop; (home, prompt, lag, lengths) per abort: of round 0's three drops, (3, 1)
    # is outside the steady steps and (5, 0) finished before it was dropped, so one steady drop was aborted
    dropped = [(1, 3, 1, 3), (4, 4, 2, 3), (6, 5, 0, 3)]
    aborted = [(3, 1, 3, [7]), (4, 2, 3, [9])]
    out = summarize_modes([run("queue", 0, 2.0), run("inflight", 0, 1.0, dropped, aborted),
                           run("inflight_finish", 0, 1.5, dropped[:1]), run("inflight_finish", 1000, 3.5),
                           run("inflight", 1000, 3.0), run("queue", 1000, 4.0)])
    assert out["ratio_per_round"] == pytest.approx([0.5, 0.75])
    assert out["inflight"]["step_wall_s"]["median"] == pytest.approx(2.0)
    assert out["ratio_of_medians"] == pytest.approx(2.0 / 3.0)
    assert out["inflight_finish_ratio_per_round"] == pytest.approx([0.75, 0.875])
    assert (out["inflight"]["dropped_groups"], out["inflight"]["aborted_groups"]) == (3, 1)
    assert (out["inflight_finish"]["dropped_groups"], out["inflight_finish"]["aborted_groups"]) == (1, 0)
    tables = format_tables(FleetBenchSpec(doomed="both"), out)
    assert "inflight / queue, wall per batch: per round 0.50, 0.75 (median 0.62)" in tables
    assert "inflight_finish / queue, wall per batch: per round 0.75, 0.88 (median 0.81)" in tables
    # long responses pooled over a mode's runs: inflight's walls 1.0 and 3.0
    assert out["inflight"]["long_calls"] == {"n": 2, "wall_s": 2.0, "paused_s": 0.5, "decode_ms_per_token": 10.0}
    assert "| inflight | 2 | 2.00 | 0.50 | 10.00 |" in tables
    assert FleetBenchSpec(doomed="both").modes == ("queue", "inflight", "inflight_finish")
    assert FleetBenchSpec().modes == ("queue", "inflight")
