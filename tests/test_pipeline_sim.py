"""The pipeline simulation against timelines worked out by hand, and the schedule's invariants on it."""

from __future__ import annotations

import itertools

import pytest

from megarl.bench.pipeline_sim import PUSH_S, SimResult, StageTimes, project_cluster, simulate
from megarl.sync.schedule import SyncSchedule


def _ends(result: SimResult) -> list[float]:
    return [s.end for s in result.steps]


def _spans(result: SimResult, kind: str) -> list[tuple[float, float, str]]:
    return [(s.start, s.end, s.label) for s in result.spans if s.kind == kind]


def _overlaps(a: tuple[float, float, str], b: tuple[float, float, str]) -> bool:
    return min(a[1], b[1]) - max(a[0], b[0]) > 1e-12


@pytest.mark.parametrize("push_initial", [False, True])
def test_interval_1_offset_0_is_the_same_with_and_without_overlap(push_initial: bool) -> None:
    # Every step: push 0.5 (none before step 0), generate 2, score 1, train 3. Pushes at steps 1, 2, 3 (+ initial).
    times = StageTimes(generate=2.0, score=1.0, train=3.0, push=0.5)
    first = 0.5 if push_initial else 0.0
    hand = [first + 6.0, first + 12.5, first + 19.0, first + 25.5]  # 4 * (2 + 1 + 3) + 3 * 0.5 (+ 0.5)
    for overlap in (False, True):
        r = simulate(SyncSchedule(1, 0), 4, 1, times, overlap, push_initial=push_initial)
        assert _ends(r) == pytest.approx(hand)
        assert len(_spans(r, "push")) == 3 + push_initial
        assert r.wall == pytest.approx(hand[-1])
        assert [s.wait_s for s in r.steps] == pytest.approx([3.0] * 4)  # generate + score, push excluded
        assert [s.push_s for s in r.steps] == [0.0, 0.5, 0.5, 0.5]


def test_interval_1_offset_1_overlapped_reaches_push_plus_max_of_train_and_generate() -> None:
    # gen 3, score 0.5, train 5, push 1. Limit starts at 2 (batches 0, 1 by the initial weights).
    # Batch 0: 0-3 (ready 3.5), batch 1: 3-6. Step 0 trains 3.5-8.5. Step 1: push 8.5-9.5, batch 2 9.5-12.5,
    # train 9.5-14.5. Step 2: push 14.5-15.5 (batch 2 done at 12.5), batch 3 15.5-18.5, train 15.5-20.5:
    # a step every 1 + max(5, 3) = 6 s. Step 3: no push (it would precede batch 4, which a 4-step run never
    # trains on), batch 3 ready at 19, train 20.5-25.5.
    times = StageTimes(generate=3.0, score=0.5, train=5.0, push=1.0)
    r = simulate(SyncSchedule(1, 1), 4, 1, times, overlap=True)
    assert _ends(r) == pytest.approx([8.5, 14.5, 20.5, 25.5])
    assert [s.wait_s for s in r.steps] == pytest.approx([3.5, 0.0, 0.0, 0.0])
    assert [x for b in r.batches for x in (b.gen_start, b.gen_end, b.ready)] == pytest.approx(
        [0, 3, 3.5, 3, 6, 6.5, 9.5, 12.5, 13, 15.5, 18.5, 19])
    assert len(_spans(r, "push")) == 2
    assert r.overlap == pytest.approx((4 * 3 + 4 * 5) / 25.5)
    # Sequential: step 0 waits for batches 0 and 1 (6.5), trains to 11.5; steps 1 and 2 are push 1, generate 3,
    # score 0.5, train 5 = 9.5 s; step 3 only trains (batch 3 was made before step 2).
    seq = simulate(SyncSchedule(1, 1), 4, 1, times, overlap=False)
    assert _ends(seq) == pytest.approx([11.5, 21.0, 30.5, 35.5])
    assert seq.overlap == pytest.approx((4 * 3 + 4 * 5) / 35.5)


def test_interval_4_overlapped_generates_batches_1_to_3_during_step_0() -> None:
    # gen 1, score 0, train 5, push 1. Batches 0-3 at 0-1, 1-2, 2-3, 3-4; steps 0-3 train 1-6, 6-11, 11-16, 16-21;
    # step 4 pushes 21-22, batch 4 at 22-23, trains 23-28 while batches 5-7 run 23-26; steps 5-7 end 33, 38, 43.
    times = StageTimes(generate=1.0, score=0.0, train=5.0, push=1.0)
    r = simulate(SyncSchedule(4, 0), 8, 1, times, overlap=True)
    assert [x for b in r.batches[:4] for x in (b.gen_start, b.gen_end)] == pytest.approx([0, 1, 1, 2, 2, 3, 3, 4])
    train0 = r.steps[0].end - r.steps[0].train_s, r.steps[0].end
    assert train0 == pytest.approx((1.0, 6.0))
    assert all(train0[0] <= b.gen_start and b.gen_end <= train0[1] for b in r.batches[1:4])
    assert _ends(r) == pytest.approx([6, 11, 16, 21, 28, 33, 38, 43])
    step4 = r.steps[4]
    assert (step4.start, step4.wait_s, step4.push_s) == pytest.approx((21.0, 1.0, 1.0))
    # inside [21, 28): generating batches 4-7 (4 s), paused for the push 1 s, idle 2 s
    assert (step4.generating_s[0], step4.paused_s[0], step4.idle_s[0]) == pytest.approx((4.0, 1.0, 2.0))
    seq = simulate(SyncSchedule(4, 0), 8, 1, times, overlap=False)
    assert seq.wall == pytest.approx(8 * (1 + 5) + 1)


def _times() -> StageTimes:
    return StageTimes(generate=lambda r, j: 1.0 + 0.5 * ((7 * r + 3 * j) % 5), score=lambda j: 0.3 * (j % 3),
                      train=lambda k: 2.0 + k % 4, push=0.7)


@pytest.mark.parametrize(("mn", "overlap", "push_initial"),
                         list(itertools.product([(8, 2), (2, 1), (1, 4), (4, 0)], [False, True], [False, True])))
def test_lags_and_versions_follow_the_schedule(mn: tuple[int, int], overlap: bool, push_initial: bool) -> None:
    schedule, steps = SyncSchedule(*mn), 20
    r = simulate(schedule, steps, 3, _times(), overlap, push_initial=push_initial)
    assert [k - r.batches[k].version for k in range(steps)] == [schedule.expected_lag(k) for k in range(steps)]
    pushes = {int(label.removeprefix("v")): (a, b) for a, b, label in _spans(r, "push")}
    made = [k for k in range(steps) if schedule.push_at_step(k) is not None and schedule.push_at_step(k) < steps]
    assert sorted(pushes) == ([0] if push_initial else []) + made
    gens = _spans(r, "generate")
    assert not any(_overlaps(g, p) for g in gens for p in _spans(r, "push"))
    for j, batch in enumerate(r.batches):
        version = schedule.generation_version(j)
        if version in pushes:
            assert batch.gen_start >= pushes[version][1] - 1e-12
        later = [a for v, (a, _) in pushes.items() if v > version]
        assert not later or batch.gen_end <= min(later) + 1e-12
        assert batch.ready >= batch.gen_end


@pytest.mark.parametrize(("m", "n"), [(1, 0), (1, 2), (8, 2), (2, 1), (4, 1)])
def test_sequential_never_generates_while_training(m: int, n: int) -> None:
    r = simulate(SyncSchedule(m, n), 17, 2, _times(), overlap=False)
    assert not any(_overlaps(g, t) for g in _spans(r, "generate") for t in _spans(r, "train"))
    assert r.overlap < 1.0  # scoring and pushes are neither generation nor training
    on = simulate(SyncSchedule(m, n), 17, 2, _times(), overlap=True)
    assert on.wall <= r.wall + 1e-9


def test_fast_replica_runs_ahead_within_the_window() -> None:
    # (4, 0): replica 0 takes 1 s a share, replica 1 2 s. Replica 0: batches 0-3 at 0-1, 1-2, 2-3, 3-4; replica 1:
    # 0-2, 2-4, 4-6, 6-8; batches ready at 2, 4, 6, 8; the trainer (10 s a step) runs 2-12, 12-22, 22-32, 32-42.
    times = StageTimes(generate=lambda r, j: 1.0 if r == 0 else 2.0, score=0.0, train=10.0, push=1.0)
    r = simulate(SyncSchedule(4, 0), 4, 2, times, overlap=True)
    fast = sorted((a, b) for a, b, _ in _spans(r, "generate") if a in (0, 1, 2, 3) and b - a == 1.0)
    assert fast == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [b.gen_end for b in r.batches] == pytest.approx([2, 4, 6, 8])
    assert _ends(r) == pytest.approx([12, 22, 32, 42])
    assert r.steps[0].generating_s == pytest.approx((4.0, 8.0))  # window [0, 12)
    assert r.steps[0].idle_s == pytest.approx((8.0, 4.0))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        simulate(SyncSchedule(1, 0), 0, 1, _times(), overlap=True)


def test_projection_assumptions() -> None:
    assert PUSH_S == pytest.approx(15_285_252_096 / 25e9 + 5.0)
    off, on = project_cluster(1, 0, False, steps=8), project_cluster(1, 0, True, steps=8)
    assert on.wall == pytest.approx(off.wall)  # (1, 0) leaves nothing to overlap
    assert project_cluster(8, 1, True, steps=16).wall < project_cluster(8, 1, False, steps=16).wall


@pytest.mark.parametrize(("m", "n", "overlap"), [(2, 1, True), (2, 1, False), (4, 0, True), (1, 2, True)])
def test_bench_reads_stage_times_back_from_a_timeline(m: int, n: int, overlap: bool) -> None:
    """`megarl bench pipeline` feeds a run's measured spans back into the simulation: a timeline drawn by the
    simulation itself must come back as the same durations, and so the same wall time and steps."""
    from megarl.bench.pipeline import stage_times

    first = simulate(SyncSchedule(m, n), 9, 2, _times(), overlap, push_initial=True)
    again = simulate(SyncSchedule(m, n), 9, 2, stage_times(first.spans), overlap, push_initial=True)
    assert again.wall == pytest.approx(first.wall)
    assert _ends(again) == pytest.approx(_ends(first))
