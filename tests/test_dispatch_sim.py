"""The dispatch simulation (`megarl.bench.dispatch_sim`) against hand-computed timelines: a static share costs
`pipeline_sim`'s formula (prefill + step x longest + per-sequence x total tokens), and the queue's small cases
worked out by hand (who takes which chunk when, idle seconds, chunks per replica). Then the in-flight simulation
(`megarl.bench.inflight_sim`) on the same engine model: which group joins which batch, step times, per-token lags,
aborted and dropped groups worked out by hand; today's queue in it against dispatch_sim's; the colocated step."""

import random

import pytest

from megarl.bench import inflight_sim
from megarl.bench import pipeline_sim as cluster
from megarl.bench.dispatch_sim import CLUSTER_COSTS, EngineCosts, guru_lengths, simulate_window
from megarl.bench.inflight_sim import fleet_setting
from megarl.sync.schedule import SyncSchedule

STEP = EngineCosts(step_s=1.0, per_seq_s=0.0, prefill_per_seq_s=0.0)  # one second a decode step, nothing else


def test_a_static_share_costs_the_projection_formula():
    rng = random.Random(0)
    batch = [[rng.randint(1, 500) for _ in range(4)] for _ in range(6)]  # 6 prompts x 4, two replicas
    r = simulate_window([batch], 2, "static", CLUSTER_COSTS)
    for rep in (0, 1):
        seqs = [n for i, g in enumerate(batch) if i % 2 == rep for n in g]
        expected = (
            len(seqs) * CLUSTER_COSTS.prefill_per_seq_s
            + cluster.DECODE_STEP_S * max(seqs)
            + cluster.DECODE_PER_SEQ_S * sum(seqs)
        )
        assert r.busy_s[rep] == pytest.approx(expected, rel=1e-12)
    assert r.wall_s == pytest.approx(max(r.busy_s)) and r.chunks == (1, 1)


def test_queue_by_hand():
    # one batch, prompts of 10, 1, 1, 1 tokens: static gives replica 0 prompts 0 and 2 (10 s), replica 1 the
    # others (1 s); the queue gives replica 1 prompts 1, 2, 3 one after another while replica 0 runs prompt 0
    one = [[[10], [1], [1], [1]]]
    static = simulate_window(one, 2, "static", STEP)
    queue = simulate_window(one, 2, "queue", STEP, chunk_prompts=1, in_flight=1)
    assert (static.wall_s, static.idle_s) == (10.0, (0.0, 9.0))
    assert (queue.wall_s, queue.idle_s, queue.chunks) == (10.0, (0.0, 7.0), (1, 3))
    # a window of two such batches (10, 1 each): static makes replica 0 run both 10-token prompts one after the
    # other (20 s); the queue lets replica 1 take batch 1's long prompt at t = 1 (done at 11)
    two = [[[10], [1]], [[10], [1]]]
    assert simulate_window(two, 2, "static", STEP).wall_s == 20.0
    queue = simulate_window(two, 2, "queue", STEP, chunk_prompts=1, in_flight=1)
    assert (queue.wall_s, queue.chunks) == (11.0, (2, 2))
    # a replica 2.5x slower (each step 2.5 s) takes fewer chunks: 4 prompts of 2 tokens, one loop each; replica 0
    # runs prompt 0 (0-5 s) while replica 1 runs prompts 1, 2, 3 (0-2, 2-4, 4-6 s)
    slow = simulate_window([[[2]] * 4], 2, "queue", STEP, in_flight=1, slowdown=(2.5, 1.0))
    assert (slow.wall_s, slow.chunks, slow.idle_s) == (6.0, (1, 3), (1.0, 0.0))


def test_guru_lengths_keep_their_spread():
    for per_prompt in (False, True):
        lengths = [n for b in range(4) for g in guru_lengths(b, per_prompt) for n in g]
        assert len(lengths) == 4 * cluster.PROMPTS * cluster.SAMPLES and max(lengths) == cluster.MAX_NEW_TOKENS
        assert 3000 < sum(lengths) / len(lengths) < 4000  # log-normal median 3000, sigma 0.6, capped: mean ~3,450


# ---- in-flight weight updates + partial rollouts (`megarl.bench.inflight_sim`), worked out by hand ----


def _one_group_batches(lengths):
    """Prompt batch j = one group of one response of `lengths[j]` tokens."""
    return lambda j: [[lengths[j]]]


def _run(schedule, steps, lengths, train, push, in_flight=1, replicas=2, **kw):
    return inflight_sim.simulate_inflight(schedule, steps, replicas, _one_group_batches(lengths), STEP, train, push,
                                          0.0, in_flight, **kw)


def test_inflight_by_hand_a_long_response_crosses_a_push():
    # sync (1, 1), bound 1, one group of one response a batch, two replicas, one group each, a decode step a second,
    # train 4 s, push 1 s. Groups 0-1 admitted at t = 0 (limit (0 + 1 + 1) x 1): r0 runs g0 (8 tokens), r1 g1 (2).
    # Step 0 (no push: version 0 is never pushed) takes g1 at t = 2, trains 2-6. Step 1 pushes v1 6-7: g0 has 6
    # tokens, is paused, resumes with v1 and ends at 9; g2 (3 tokens, v1) is admitted at 7 on r1, ends at 10. Batch
    # 1 = g0 at t = 9 (6 tokens at lag 1, 2 at lag 0), trains 9-13. Step 2 pushes v2 13-14; g3 (v2) is admitted at
    # 14 on r0 (both free: replica order), ends at 17; batch 2 = g2 (lag 1) at 14, trains 14-18; step 3 has no push
    # (it would precede batch 4 >= K) and trains g3 18-22.
    r = _run(SyncSchedule(1, 1), 4, [8, 2, 3, 3, 3], 4.0, 1.0)
    assert [s.groups for s in r.steps] == [(1,), (0,), (2,), (3,)]
    assert [x for s in r.steps for x in (s.start, s.end, s.wait_s, s.push_s)] == pytest.approx(
        [0, 6, 2, 0, 6, 13, 2, 1, 13, 18, 0, 1, 18, 22, 0, 0])
    assert [s.tokens_by_lag for s in r.steps] == [{0: 2}, {1: 6, 0: 2}, {1: 3}, {1: 3}]
    assert [s.responses_spanning for s in r.steps] == [0, 1, 0, 0]
    assert [g.replica for g in r.groups] == [0, 1, 1, 0] and r.pushes == [(6, 7), (13, 14)]
    # idle: r0 9-13 and 17-22; r1 2-6, 10-13 and 14-22 (pauses 6-7 and 13-14 are not idle)
    assert r.replica_idle == [[(9, 13), (17, 22)], [(2, 6), (10, 13), (14, 22)]]
    # decoding (the fleet bench's measure: neither idle nor paused): r0 0-6, 7-9, 14-17; r1 0-2, 7-10: 11 + 5 s
    assert fleet_setting.decoding_s(r, 0, 4) == pytest.approx(16.0)
    assert (r.dropped, r.aborted) == (0, 0)
    # today's queue on the same batches (the push waits for the tail, batch k = prompt batch k): batch 0 = g0 at 8,
    # trains 8-12; push 12-13, g2 13-16 on r0; batch 1 = g1 trains 13-17; push 17-18, g3 18-21; batch 2 = g2 trains
    # 18-22; batch 3 = g3 at 22 (ready 21), trains 22-26
    q = _run(SyncSchedule(1, 1), 4, [8, 2, 3, 3, 3], 4.0, 1.0, quiesce=True)
    assert [s.groups for s in q.steps] == [(0,), (1,), (2,), (3,)]
    assert [s.end for s in q.steps] == pytest.approx([12, 17, 22, 26])
    assert [s.tokens_by_lag for s in q.steps] == [{0: 8}, {1: 2}, {1: 3}, {1: 3}]


def test_inflight_by_hand_a_group_past_the_bound_is_aborted():
    # (`doomed='abort'`, not megarl's rule: a possible later improvement) as above with g0 10 tokens: at t = 10 g2 (v1)
    # ends first and forms batch 1; g0 (9 tokens, version 0) could only be trained at step 2 or later, lag 2 > bound 1:
    # aborted, 9 tokens wasted, and a new group admitted in its place (limit (1 + 2) x 1 + 1 lost): g3 (v1) at 10 on r0,
    # ends at 13. Step 2: push 14-15, batch 2 = g3 (lag 1) at 15, trains 15-19; g4 (v2) admitted at 15, ends at 18; step
    # 3 trains it 19-23.
    r = _run(SyncSchedule(1, 1), 4, [10, 2, 3, 3, 3, 3], 4.0, 1.0, doomed="abort")
    assert [s.groups for s in r.steps] == [(1,), (2,), (3,), (4,)]
    assert [s.end for s in r.steps] == pytest.approx([6, 14, 19, 23])
    assert (r.dropped, r.aborted, r.wasted_tokens) == (0, 1, pytest.approx(9.0))
    assert r.groups[0].fate == "aborted" and r.groups[3].replica == 0


def test_inflight_by_hand_doomed_finish_generates_the_group_to_its_end_then_drops_it():
    # the case above under the implemented rule (`doomed='finish'`, the default, megarl.rollout.partial): g0 (10 tokens,
    # v0) is not aborted when batch 1 = g2 forms at 10 (trains 10-14); it goes on to its end at 11 (6 tokens at v0
    # before the push 6-7, 4 after), holding r0 and its place in the limit ((1 + 2) x 1: nothing more is admitted at
    # v1). Step 2: push 14-15; at 15 the take drops g0 (scored at 11, lag 2 > 1), so v2's limit (2 + 2) x 1 + 1 dropped
    # admits g3 on r0 and g4 on r1, both 15-18; batch 2 = g3 (finished first: replica order) trains 18-22, step 3 (no
    # push) trains g4 22-26. The abort rule's run ends at 23, this one at 26. Both batch orders agree (at 18, g3 is
    # both the lower (home batch, prompt) and the first in replica order).
    for order in ("home", "completion"):
        r = _run(SyncSchedule(1, 1), 4, [10, 2, 3, 3, 3, 3], 4.0, 1.0, order=order)
        assert [s.groups for s in r.steps] == [(1,), (2,), (3,), (4,)]
        assert [s.end for s in r.steps] == pytest.approx([6, 14, 22, 26])
    assert (r.dropped, r.aborted, r.wasted_tokens) == (1, 0, pytest.approx(10.0))
    assert r.groups[0].fate == "dropped" and r.groups[0].done_at == pytest.approx(11.0)
    assert [g.replica for g in r.groups[3:]] == [0, 1] and r.pushes == [(6, 7), (14, 15)]
    with pytest.raises(ValueError, match="doomed"):
        _run(SyncSchedule(1, 1), 4, [2, 2], 4.0, 1.0, doomed="keep")
    with pytest.raises(ValueError, match="order"):
        _run(SyncSchedule(1, 1), 4, [2, 2], 4.0, 1.0, order="first")


def test_inflight_by_hand_a_complete_group_past_the_bound_is_dropped():
    # the completion order (AReaL's rule, megarl's first): sync (1, 2), bound 2, train 10 s, push 1 s. v0 may admit 3
    # groups: g0 (15 tokens) on r0, g1 (1) on r1, then g2
    # (1) on r1 at t = 1. Batch 0 = g1 at 1, trains 1-11. Step 1: push 11-12 (g0 has 11 tokens), g3 (v1) on r1
    # 12-13 (limit (1 + 3) x 1); batch 1 = g2 (v0, lag 1) at 12, trains 12-22; g0 ends at 16. Step 2 (no push: it
    # would precede batch 4 >= K) takes the first complete group, g3 (13) before g0 (16), trains 22-32. Step 3: g0 is
    # complete but its lag would be 3 > 2: dropped, 15 tokens wasted, a group admitted in its place: g4 (v1) on r0
    # 32-33; batch 3 = g4 (lag 2), trains 33-43. Both doomed rules alike (g0 is never doomed while generating).
    for doomed in ("abort", "finish"):
        r = _run(SyncSchedule(1, 2), 4, [15, 1, 1, 1, 1, 1, 1], 10.0, 1.0, order="completion", doomed=doomed)
        assert [s.groups for s in r.steps] == [(1,), (2,), (3,), (4,)]
        assert [s.end for s in r.steps] == pytest.approx([11, 22, 32, 43])
        assert (r.dropped, r.aborted, r.wasted_tokens) == (1, 0, pytest.approx(15.0))
        assert r.groups[0].fate == "dropped" and r.groups[0].done_at == pytest.approx(16.0)
        assert r.groups[0].taken_at == 3
        assert [s.tokens_by_lag for s in r.steps] == [{0: 1}, {1: 1}, {1: 1}, {2: 1}]
        assert r.groups[4].replica == 0 and r.pushes == [(11, 12)]


def test_inflight_by_hand_the_home_order_takes_the_oldest_finished_group_first():
    # the case above under megarl's rule (`order='home'`, `GroupPool.form`: the lowest (home batch, prompt) first),
    # the default. Up to step 2 nothing differs (one scored group at each take). At step 2 (t = 22) two groups are
    # scored: g3 (home batch 3, finished at 13) and g0 (home batch 0, finished at 16, oldest token v0: lag 2 <= 2).
    # The home order takes g0: 11 tokens decoded under v0 (0-11) at lag 2, 4 under v1 (12-16) at lag 1; trains 22-32.
    # Nothing is dropped, so the limit stays (1 + 3) x 1 = 4 and nothing more is admitted; step 3 (t = 32) takes g3
    # (v1, lag 2), trains 32-42. The long response is trained, not dropped, and the run ends 1 s sooner (no group
    # admitted and generated in g0's place).
    for doomed in ("finish", "abort"):
        r = _run(SyncSchedule(1, 2), 4, [15, 1, 1, 1, 1, 1, 1], 10.0, 1.0, doomed=doomed)
        assert [s.groups for s in r.steps] == [(1,), (2,), (0,), (3,)]
        assert [s.end for s in r.steps] == pytest.approx([11, 22, 32, 42])
        assert (r.dropped, r.aborted, r.wasted_tokens) == (0, 0, 0.0)
        assert [s.tokens_by_lag for s in r.steps] == [{0: 1}, {1: 1}, {2: 11, 1: 4}, {2: 1}]
        assert [s.responses_spanning for s in r.steps] == [0, 0, 1, 0]
        assert len(r.groups) == 4 and r.trained_lengths(0, 4) == [1, 1, 15, 1]


def test_inflight_by_hand_home_order_vs_completion_order_with_two_groups_a_batch():
    # P = 2 groups a batch, one replica holding up to 6 groups (it decodes all it holds, a token a second each),
    # sync (1, 2), bound 2, K = 4 (one push, at step 1), train 10 s, push 1 s, score 0. Home batches: 0 = g0 (30
    # tokens), g1 (1); 1 = g2 (5), g3 (3); 2 = g4 (1), g5 (2); 3 = g6 (1), g7 (1); 4 = g8 (1), g9 (1).
    # t = 0: v0 may start (0 + 2 + 1) x 2 = 6 groups: g0-g5. g1, g4 end at 1 -> batch 0 = g1, g4 (the only two
    # scored, either order), trains 1-11. g5 ends at 2, g3 at 3, g2 at 5. Step 1: push 11-12 (g0 has 11 tokens).
    # At 12 three groups are scored, g2 (at 5), g3 (3), g5 (2):
    #   home order: the lowest (home, prompt), g2 and g3;  completion order: the first two to finish, g5 and g3.
    # Batch 1 trains 12-22. After the push v1 may start (1 + 3) x 2 = 8: g6, g7 at 12, both end at 13; g0 (v0)
    # ends at 31. Step 2 (t = 22, no push): home order pools g5, g6, g7 and takes g5, g6; completion order pools g2,
    # g6, g7 and takes g2, g6 (g6 before g7: they end together, g6 is the replica's earlier entry). Trains 22-32.
    # Step 3 (t = 32): g0 is scored (31) but its oldest token would be at lag 3 > 2: dropped first (both orders,
    # `doomed='finish'`: it was generated to its end), 30 tokens wasted; the pool holds g7 alone, and the drop lets
    # the fleet start one more ((1 + 3) x 2 + 1 = 9): g8 (v1) at 32, ends at 33 -> batch 3 = g7, g8, trains 33-43.
    batches = [[[30], [1]], [[5], [3]], [[1], [2]], [[1], [1]], [[1], [1]]]
    expected = {"home": [(1, 4), (2, 3), (5, 6), (7, 8)], "completion": [(1, 4), (5, 3), (2, 6), (7, 8)]}
    lags = {"home": [{0: 2}, {1: 8}, {2: 2, 1: 1}, {2: 2}], "completion": [{0: 2}, {1: 5}, {2: 5, 1: 1}, {2: 2}]}
    for order in ("home", "completion"):
        r = inflight_sim.simulate_inflight(SyncSchedule(1, 2), 4, 1, lambda j: batches[j], STEP, 10.0, 1.0, 0.0, 6,
                                           order=order)
        assert [s.groups for s in r.steps] == expected[order], order
        assert [s.end for s in r.steps] == pytest.approx([11, 22, 32, 43])
        assert [s.tokens_by_lag for s in r.steps] == lags[order]
        assert [s.pooled for s in r.steps] == [2, 3, 3, 2]  # scored groups within the bound at each take
        assert (r.dropped, r.aborted, r.wasted_tokens) == (1, 0, 30.0)
        assert r.groups[0].fate == "dropped" and r.groups[0].taken_at == 3 and len(r.groups) == 9
        assert r.pushes == [(11, 12)]


def test_fleet_check_takes_the_steady_steps_pushes():
    # `megarl bench inflight-fleet`'s defaults: sync (1, 2), 12 steps, steady from step 2; its worker's end is
    # 12 + 1 + 2 = 15, so it pushes at steps 1..11 (version 0 is pushed before the run and not listed): 11 pushes,
    # listed in step order; the steady ones are steps 2..11, i.e. the 2nd to 11th: seconds 1..10, mean 5.5
    measured = {"spec": {"interval": 1, "offset": 2, "steps": 12, "skip": 2}}
    run = {"first_batch": 0, "pushes": [{"seconds": float(i)} for i in range(11)]}
    assert fleet_setting.steady_push_s(measured, run) == pytest.approx(5.5)
    with pytest.raises(ValueError, match="10 pushes recorded"):
        fleet_setting.steady_push_s(measured, {"first_batch": 0, "pushes": run["pushes"][:10]})


def test_sequence_slots_admit_a_group_when_enough_sequences_ended():
    # one replica, 2 groups of 2 samples in flight: g0 (1, 9), g1 (1, 9), g2 (2, 2). Group slots: g2 waits for a
    # group to end (t = 9), ends at 11. Sequence slots (4): two sequences end at t = 1, g2 starts then, ends at 3.
    batches = [[[1, 9]], [[1, 9]], [[2, 2]]]
    for admit, end in (("groups", 11.0), ("sequences", 3.0)):
        r = inflight_sim.simulate_inflight(SyncSchedule(8, 0), 3, 1, lambda j: batches[j] if j < 3 else [[50, 50]],
                                           STEP, 0.0, 0.0, 0.0, 2, admit)
        assert r.groups[2].done_at == pytest.approx(end)


def test_todays_queue_in_the_inflight_sim_is_dispatch_sims_queue():
    # no trainer, push or scoring cost: today's queue run window by window (`quiesce`) takes the sum of
    # dispatch_sim's queue windows, with per-sequence and prefill costs too
    rng = random.Random(3)
    costs = EngineCosts(step_s=1.0, per_seq_s=0.1, prefill_per_seq_s=0.5)
    data = [[[rng.randint(1, 40) for _ in range(3)] for _ in range(6)] for _ in range(12)]
    r = inflight_sim.simulate_inflight(SyncSchedule(4, 0), 12, 2, lambda j: data[j], costs, 0.0, 0.0, 0.0, 3,
                                       quiesce=True)
    windows = [simulate_window(data[w:w + 4], 2, "queue", costs, 1, 3).wall_s for w in (0, 4, 8)]
    assert r.wall == pytest.approx(sum(windows), rel=1e-9)


def test_colocated_step_by_hand():
    # 4 prompts of 2 responses on 2 replicas: r0 prompts 0, 2 (lengths 3, 5, 2, 2), r1 prompts 1, 3 (1, 1, 4, 1).
    # A share: 0.5 s a sequence of prefill + 1 s x longest + 0.1 s x tokens: r0 2 + 5 + 1.2 = 8.2, r1 2 + 4 + 0.7 =
    # 6.7; trainer 10 s on 32 GPUs -> 5 s on 64; score 1, switch 3: 8.2 + 1 + 5 + 3 = 17.2 s
    costs = EngineCosts(step_s=1.0, per_seq_s=0.1, prefill_per_seq_s=0.5)
    batch = [[3, 5], [1, 1], [2, 2], [4, 1]]
    c = inflight_sim.colocated_step(batch, replicas=2, gpus=64, switch_s=3.0, costs=costs, score_s=1.0,
                                    train_32=lambda lengths: 10.0)
    assert (c.generate_s, c.train_s, c.step_s) == pytest.approx((8.2, 5.0, 17.2))
    assert inflight_sim.COLOCATED_GPUS == 64 and inflight_sim.COLOCATED_REPLICAS == 16
    assert inflight_sim.COLOCATED_SWITCH_S == pytest.approx(2 * 2.0 + cluster.PUSH_FIXED_S)
    # the cluster trainer's time is pipeline_sim's formula: halving the GPUs' share of the FLOPs on 64
    lengths = [3000] * 1152
    assert cluster.train_seconds(lengths, 64) - cluster.OPTIMIZER_S == pytest.approx(
        (cluster.train_seconds(lengths) - cluster.OPTIMIZER_S) / 2)


def test_inflight_bound_below_the_interval_is_refused_clearly():
    with pytest.raises(ValueError, match="bound"):
        _run(SyncSchedule(1, 1), 2, [1, 1, 1], 1.0, 1.0, bound=-1)


def test_per_sequence_cost_by_hand_two_sequences_on_one_replica():
    # one replica, one group of two sequences (2 and 5 tokens), a decode step of a + b x N: two steps of a + 2b while
    # both run, then three of a + b: the short one ends at 2 (a + 2b), the group at 2 (a + 2b) + 3 (a + b)
    a, b = 0.010, 0.003
    costs = EngineCosts(step_s=a, per_seq_s=b, prefill_per_seq_s=0.0)
    r = inflight_sim.simulate_inflight(SyncSchedule(8, 0), 1, 1, lambda j: [[2, 5]] if j == 0 else [[1, 1]], costs,
                                       0.0, 0.0, 0.0, 1)
    assert r.groups[0].done_at == pytest.approx(2 * (a + 2 * b) + 3 * (a + b))
    # the fleet check's per-seq engine hands both costs to the simulation; the flat (GPU-like) one only the step
    engine = fleet_setting.Engine("per-seq", a, per_seq_s=b)
    assert engine.costs == costs
    assert fleet_setting.Engine("flat", a + 4 * b).costs == EngineCosts(a + 4 * b, 0.0, 0.0)


def test_fleet_check_per_seq_engine_needs_the_measured_ratio(tmp_path):
    with pytest.raises(ValueError, match="engine-step"):
        fleet_setting.calibrate({"spec": {}, "runs": [], "args": {"replicas": 2}}, "per-seq")
    path = tmp_path / "engine_step.json"
    path.write_text('{"step_s": 0.004, "per_seq_s": 0.0002, "per_seq_over_step": 0.05}')
    assert fleet_setting.read_engine_step(path) == pytest.approx(0.05)
    path.write_text('{"step_s": 0.004}')
    with pytest.raises(ValueError, match="not a `megarl bench engine-step"):
        fleet_setting.read_engine_step(path)


def test_fleet_check_trainer_step_set_or_measured():
    # the bench's --train-s, or the run's measured mean train span a steady step: 70 % of a 4.0 s wall per batch
    measured = {"spec": {"train_s": 2.0}}
    run = {"train_share": 0.7, "wall_per_batch_s": 4.0}
    assert fleet_setting.train_s(measured, run) == 2.0
    assert fleet_setting.train_s(measured, run, "measured") == pytest.approx(2.8)
    with pytest.raises(ValueError, match="'set' or 'measured'"):
        fleet_setting.train_s(measured, run, "sleep")
