"""`megarl bench inflight-fleet`'s bookkeeping (`megarl.bench.inflight_fleet`) against hand-computed cases: the
replicas' idle share with pushes overlapping requests in flight, the trainer's shares, the length accounting of
trained vs sampled vs dropped responses, one run's steady window and drops, and the paired ratio; its arms (the queue
at the in-flight bound's schedule, KV modes, refill settings and the config they start the fleet from), wall per
trained token, the engine's occupancy from vLLM's gauges and the paired comparisons; and `megarl bench
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
    Arm,
    FleetBenchSpec,
    bench_config,
    comparisons,
    covered_s,
    engine_occupancy,
    format_tables,
    gauge_mean,
    lag_schedule,
    length_accounting,
    long_call_time,
    paired_ratios,
    per_token_ms,
    plan_arms,
    replica_time,
    round_order,
    summarize_modes,
    summarize_run,
    trainer_time,
    warmup_arms,
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


def test_like_for_like_queue_schedule_by_hand():
    # the in-flight arm at bound B against the queue whose maximum lag m' + n' - 1 is B, at the same interval
    assert lag_schedule(8, 1) == (1, 8)  # bound 8 at sync (1, 2): the queue at (1, 8)
    assert lag_schedule(2, 1) == (1, 2)  # the schedule's own bound: the schedule itself
    assert lag_schedule(7, 8) == (8, 0)  # the 30B recipe's (8, 0)
    assert lag_schedule(9, 8) == (8, 2)
    assert lag_schedule(2, 8) == (3, 0)  # below m - 1: fewer batches between pushes, no offset
    assert lag_schedule(0, 1) == (1, 0)
    for bound in range(12):
        for interval in range(1, 9):
            m, n = lag_schedule(bound, interval)
            assert m + n - 1 == bound and m >= 1 and n >= 0
    with pytest.raises(ValueError, match="maximum lag"):
        lag_schedule(-1, 1)


def test_arms_planned_by_hand():
    # the default spec: the two arms the bench always ran, named as their modes, at the schedule (1, 2)
    assert [(a.name, a.mode, a.interval, a.offset, a.kv, a.refill) for a in plan_arms(FleetBenchSpec())] == [
        ("queue", "queue", 1, 2, "recompute", "groups"), ("inflight", "inflight", 1, 2, "recompute", "groups")]
    # bound 8, both KV modes, both refills: per refill the queue at (1, 2), the like-for-like queue at (1, 8), and an
    # in-flight arm per KV mode; the sequences arms named +seq
    spec = FleetBenchSpec(bound=8, kv="recompute", kvs=("recompute", "keep"), refills=("groups", "sequences"))
    arms = plan_arms(spec)
    assert [(a.name, a.interval, a.offset, a.kv, a.refill) for a in arms] == [
        ("queue", 1, 2, "recompute", "groups"), ("queue_lag", 1, 8, "recompute", "groups"),
        ("inflight", 1, 2, "recompute", "groups"), ("inflight_keep", 1, 2, "keep", "groups"),
        ("queue+seq", 1, 2, "recompute", "sequences"), ("queue_lag+seq", 1, 8, "recompute", "sequences"),
        ("inflight+seq", 1, 2, "recompute", "sequences"), ("inflight_keep+seq", 1, 2, "keep", "sequences")]
    assert arms[1].max_lag == spec.staleness_bound == 8 and arms[0].max_lag == 2
    # an in-flight arm runs at the spec's bound, a queue arm at its own schedule's maximum lag
    assert spec.for_arm(arms[1]).staleness_bound == 8 and spec.for_arm(arms[0]).staleness_bound == 2
    assert spec.for_arm(arms[3]).staleness_bound == 8 and spec.for_arm(arms[3]).kv == "keep"
    assert spec.for_arm(arms[1]).generated_batches == 12 + 1 + 8
    # only the like-for-like control
    assert [a.name for a in plan_arms(FleetBenchSpec(bound=8, controls=("lag",)))] == ["queue_lag", "inflight"]
    # at the schedule's own bound the queue is the like-for-like control, whatever the controls asked
    assert [a.name for a in plan_arms(FleetBenchSpec(controls=("lag",)))] == ["queue", "inflight"]
    assert [a.name for a in plan_arms(FleetBenchSpec(doomed="both"))] == ["queue", "inflight", "inflight_finish"]
    # more like-for-like queues: at interval 8, (8, 1), which waits for the tail once per 8 batches
    wide = plan_arms(FleetBenchSpec(bound=8, lag_intervals=(1, 8)))
    assert [(a.name, a.interval, a.offset) for a in wide] == [("queue", 1, 2), ("queue_lag", 1, 8),
                                                              ("queue_lag_m8", 8, 1), ("inflight", 1, 2)]
    assert [(a, c) for a, c, _ in comparisons(wide, 8)] == [("inflight", "queue_lag"), ("inflight", "queue_lag_m8"),
                                                            ("inflight", "queue")]


def test_comparisons_pair_like_for_like_and_refill_by_hand():
    spec = FleetBenchSpec(bound=8, kvs=("recompute", "keep"), refills=("groups", "sequences"))
    got = comparisons(plan_arms(spec), 8)
    assert [(a, c) for a, c, _ in got] == [
        ("inflight", "queue_lag"), ("inflight", "queue"), ("inflight_keep", "queue_lag"), ("inflight_keep", "queue"),
        ("inflight+seq", "queue_lag+seq"), ("inflight+seq", "queue+seq"),
        ("inflight_keep+seq", "queue_lag+seq"), ("inflight_keep+seq", "queue+seq"),
        ("queue+seq", "queue"), ("queue_lag+seq", "queue_lag"), ("inflight+seq", "inflight"),
        ("inflight_keep+seq", "inflight_keep")]
    assert got[0][2] == "like for like: max lag 8" and got[1][2] == "the same schedule (1, 2), max lag 2"
    # at the schedule's own bound: one control, like for like
    assert comparisons(plan_arms(FleetBenchSpec()), 2) == [("inflight", "queue", "like for like: max lag 2")]


def test_bench_config_starts_the_fleet_as_megarl_train_would(tmp_path):
    # 16 prompts over 2 replicas, chunks of one prompt: 8 chunks in flight per replica; with refill sequences twice
    # as many, and 8 x 1 x 4 = 32 sequence slots (vLLM's --max-num-seqs); with groups vLLM's default
    spec = FleetBenchSpec(prompts=16, samples=4)
    seq, groups = bench_config(spec, 2, "sequences", tmp_path), bench_config(spec, 2, "groups", tmp_path)
    assert (seq.sequence_slots(), seq.rollout_chunks_in_flight()) == (32, 16)
    assert (groups.sequence_slots(), groups.rollout_chunks_in_flight()) == (None, 8)
    from megarl.rollout.fleet import fleet_spec

    assert fleet_spec(seq, log_dir=tmp_path).max_num_seqs == 32


def test_warmups_and_round_order():
    arms = plan_arms(FleetBenchSpec(bound=8, kvs=("recompute", "keep"), refills=("groups", "sequences")))
    # one warm-up per (refill, mode, KV): the queue at (1, 8) shares the queue's at (1, 2), at the spec's schedule
    assert [(a.name, a.interval, a.offset) for a in warmup_arms(arms, FleetBenchSpec())] == [
        ("queue_lag", 1, 2), ("inflight", 1, 2), ("inflight_keep", 1, 2), ("queue_lag+seq", 1, 2),
        ("inflight+seq", 1, 2), ("inflight_keep+seq", 1, 2)]
    assert round_order(arms, 0) == arms and round_order(arms, 1) == arms[::-1]


def test_per_token_wall_and_gauges_by_hand():
    assert per_token_ms(2.0, 400) == pytest.approx(5.0) and per_token_ms(2.0, 0) is None
    # readings at 1 (4 running), 3 (8), 6 (0) inside [2, 8): 4 over [2, 3), 8 over [3, 6), 0 over [6, 8):
    # (4 + 24 + 0) / 6
    assert gauge_mean([(3.0, 8.0), (1.0, 4.0), (6.0, 0.0)], 2.0, 8.0) == pytest.approx(28 / 6)
    # the first reading inside the window: the time before it is left out
    assert gauge_mean([(4.0, 2.0), (6.0, 6.0)], 2.0, 8.0) == pytest.approx((2 * 2 + 6 * 2) / 4)
    assert gauge_mean([(9.0, 1.0)], 2.0, 8.0) is None and gauge_mean([], 0.0, 1.0) is None
    # two replicas, 32 slots: replica 0 runs 32 then 16 (waiting 8 then 0), replica 1 runs 16 throughout
    occ = engine_occupancy([[(0.0, 32.0, 8.0), (5.0, 16.0, 0.0)], [(0.0, 16.0, 0.0)]], 0.0, 10.0, 32)
    assert occ["replicas"][0] == {"running": 24.0, "waiting": 4.0, "waiting_max": 8.0, "occupancy": 0.75}
    assert (occ["running"], occ["occupancy"], occ["waiting_max"]) == (20.0, 0.625, 8.0)


def test_one_runs_full_wall_and_wall_per_trained_token_by_hand():
    # 3 steps from t0 = 0, the first left out: steady window [2, 7) trained 10 + 10 + 10 + 100 = 130 tokens:
    # 5 s / 130 tokens; the full run [0, 7) trained 999 more; the gauges over [2, 7)
    spec = FleetBenchSpec(prompts=2, samples=1, steps=3, skip=1, long_share=0.5, long_tokens=100, short_tokens=10)
    run = summarize_run(spec, "queue", 5, 0.0, [2.0, 4.0, 7.0], [], 1, [[999], [10, 10], [10, 100]], [], {},
                        gauges=[[(0.0, 1.0, 0.0), (4.5, 2.0, 3.0)]], slots=4)
    assert (run["trained_tokens"], run["full_trained_tokens"]) == (130, 1129)
    assert run["wall_per_trained_token_ms"] == pytest.approx(5000 / 130)
    assert (run["full_wall_s"], run["full_wall_per_trained_token_ms"]) == (7.0, pytest.approx(7000 / 1129))
    assert run["engine"]["running"] == pytest.approx((1 * 2.5 + 2 * 2.5) / 5)
    assert run["engine"]["occupancy"] == pytest.approx(1.5 / 4) and run["engine"]["waiting_max"] == 3.0


def _arm_run(arm: Arm, first: int, wall: float, tokens: int, full: float, bound: int, dropped=(), long=0):
    stats = {"responses": 4, "mean": tokens / 4, "long": long}
    return {"mode": arm.mode, "arm": arm.name, "interval": arm.interval, "offset": arm.offset, "kv": arm.kv,
            "refill": arm.refill, "bound": bound, "first_batch": first, "wall_per_batch_s": wall,
            "step_walls_s": [wall], "trained_tokens": tokens, "wall_per_trained_token_ms": per_token_ms(wall, tokens),
            "full_wall_s": full, "full_trained_tokens": tokens, "full_wall_per_trained_token_ms": None,
            "engine": {"running": 16.0, "waiting": 0.0, "waiting_max": 0.0, "occupancy": 0.5, "slots": 32},
            "idle_share": 0.5, "wait_share": 0.1, "push_share": 0.1, "dropped_groups": len(dropped),
            "lengths": {"trained": stats, "sampled": {"responses": 4, "mean": 50.0, "long": 1}}, "held_per_push": [],
            "pushes": [], "max_token_lag": 1, "responses_spanning": 0, "steady_steps": [2, 12],
            "dropped": [list(d) for d in dropped], "aborted": [], "long_calls": []}


def test_arms_pair_their_rounds_per_trained_token_by_hand():
    arms = {a.name: a for a in plan_arms(FleetBenchSpec(bound=8, refills=("groups", "sequences")))}
    # round 0 (batches 0): the like-for-like queue 4 s a batch over 200 tokens (20 ms a token), in flight 3 s over 100
    # (30 ms): faster a batch (0.75) but 1.5x the wall per trained token; round 1000: 4 s / 200 against 2 s / 200
    # (0.5 both). Sequences against groups in flight: 2.4 s against 3 s in round 0.
    runs = [_arm_run(arms["queue_lag"], 0, 4.0, 200, 50.0, 8), _arm_run(arms["inflight"], 0, 3.0, 100, 40.0, 8,
                                                                        dropped=[(3, 2, 1, 9)]),
            _arm_run(arms["queue"], 0, 5.0, 200, 60.0, 2), _arm_run(arms["inflight+seq"], 0, 2.4, 100, 30.0, 8),
            _arm_run(arms["queue_lag"], 1000, 4.0, 200, 50.0, 8), _arm_run(arms["inflight"], 1000, 2.0, 200, 25.0, 8),
            _arm_run(arms["queue"], 1000, 8.0, 200, 100.0, 2)]
    ratios = {(r["arm"], r["control"]): r for r in paired_ratios(runs)}
    like = ratios["inflight", "queue_lag"]
    assert like["why"] == "like for like: max lag 8" and like["rounds"] == 2
    assert like["wall_per_batch_s"]["per_round"] == pytest.approx([0.75, 0.5])
    assert like["wall_per_trained_token_ms"]["per_round"] == pytest.approx([1.5, 0.5])
    assert like["wall_per_trained_token_ms"]["median"] == pytest.approx(1.0)
    assert like["full_wall_s"]["per_round"] == pytest.approx([0.8, 0.5])
    assert ratios["inflight", "queue"]["wall_per_batch_s"]["per_round"] == pytest.approx([0.6, 0.25])
    assert ratios["inflight+seq", "inflight"]["wall_per_batch_s"]["per_round"] == pytest.approx([0.8])
    assert ratios["inflight+seq", "inflight"]["why"] == "refill: sequences against groups"
    # runs of a file without arm fields pair nothing
    assert paired_ratios([{k: v for k, v in r.items() if k != "interval"} for r in runs]) == []
    out = summarize_modes(runs)
    assert list(out)[:4] == ["queue_lag", "inflight", "queue", "inflight+seq"]
    assert out["inflight"]["wall_per_trained_token_ms_median"] == pytest.approx(20.0)  # 30 and 10 ms
    assert out["inflight"]["full_wall_s_median"] == pytest.approx(32.5)
    assert out["inflight"]["trained_length_bias"] == pytest.approx((300 / 8) / 50 - 1)  # trained 37.5 against 50
    assert out["inflight"]["arm"] == {"mode": "inflight", "interval": 1, "offset": 2, "kv": "recompute",
                                      "refill": "groups", "bound": 8}
    assert out["inflight"]["engine"]["occupancy"] == 0.5 and out["inflight"]["engine"]["slots"] == 32
    tables = format_tables(FleetBenchSpec(bound=8), out)
    assert ("| inflight / queue_lag | like for like: max lag 8 | 0.75, 0.50 (0.62) | 1.50, 0.50 (1.00) | "
            "0.80, 0.50 (0.65) | 1 (0), -25.0% | 0 (0), +0.0% |") in tables
    assert "| queue_lag | (1, 8); 8 | - | groups |" in tables
    assert "| inflight | (1, 2); 8 | recompute | groups |" in tables


def test_fleet_check_replays_only_the_specs_own_arms():
    # `megarl bench inflight --fleet-check` simulates the spec's schedule: the queue at another schedule, another KV
    # mode's or refill's arm are left out; files written before arms existed keep every run
    from megarl.bench.inflight_sim.fleet_setting import base_arms

    runs = [{"mode": "queue", "arm": "queue"}, {"mode": "queue", "arm": "queue_lag"},
            {"mode": "inflight", "arm": "inflight"}, {"mode": "inflight", "arm": "inflight_keep"},
            {"mode": "inflight", "arm": "inflight+seq"}, {"mode": "inflight_finish"}]
    assert [r.get("arm", r["mode"]) for r in base_arms({"runs": runs})["runs"]] == ["queue", "inflight",
                                                                                   "inflight_finish"]
