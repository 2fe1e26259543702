"""The fleet's shared queue on real vLLM replicas: a replica made deliberately slow (a proxy holds each of its
generate requests) takes fewer chunks instead of holding the batch, and the batches come out in prompt order and
equal to a one-replica run with the same seeds (prompt i of batch j is seeded by its index, not by who served it).
A replica that stops answering (connection refused; 503s after a few requests) loses its chunks to the other: the
batches complete, nothing lost or doubled, the same as the one-replica run, with one warning naming the replica."""

import logging

import pytest
from transformers import AutoTokenizer

from megarl.data.arithmetic import problem_batch
from megarl.launch import free_port
from megarl.metrics.timeline import Timeline
from megarl.rewards.pool import RewardPool
from megarl.rewards.scoring import BatchScorer
from megarl.rollout.client import RolloutClient
from megarl.rollout.evaluation import Evaluator
from megarl.rollout.worker import RolloutWorker, RolloutWorkerError
from megarl.sync.schedule import SyncSchedule
from tests.slow_proxy import slow_proxy

PROMPTS, K = 8, 2


def _generate(urls, encode, chunks_in_flight, live):
    """Batches 0 and 1 (one window of sync (2, 0): the fleet's initial weights) with 1-prompt chunks; `live`:
    the replicas still answering at the end."""
    timeline = Timeline()
    worker = RolloutWorker(
        [RolloutClient(u, timeout_s=60) for u in urls],
        SyncSchedule(2, 0),
        problems=lambda j: problem_batch(j, PROMPTS, 9, seed=3),
        encode=encode,
        sampling={"n": K, "max_tokens": 6},
        seed=lambda j: 1000 + 100 * j,
        score=BatchScorer(
            RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=10), lambda ids: "7"
        ),
        timeline=timeline,
        end=2,
        chunk_prompts=1,
        chunks_in_flight=chunks_in_flight,
    )
    try:
        batches = [worker.take(0), worker.take(1)]
        assert worker.live_replicas() == live
        return batches, list(worker.chunks_taken), timeline.spans()
    finally:
        worker.close()


@pytest.fixture(scope="module")
def encode(tiny_moe_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_moe_dir))
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def one_replica_run(moe_fleet_2x1, encode):
    batches, taken, _ = _generate(moe_fleet_2x1.urls[:1], encode, chunks_in_flight=2, live=1)
    assert taken == [2 * PROMPTS]
    return batches


def _same_as(raced, reference, encode) -> None:
    for j, (ref, got) in enumerate(zip(reference, raced, strict=True)):
        # prompt order: group i holds prompt i of batch j, K samples each, whichever replica served it
        prompts = [encode(p.prompt) for p in problem_batch(j, PROMPTS, 9, seed=3)]
        assert got.prompt_ids == [p for p in prompts for _ in range(K)]
        # the same weights for both (the shared fleet holds whatever version earlier tests pushed into it)
        assert got.index == j and got.policy_version == ref.policy_version
        # same seeds, same weights: the same samples as the one-replica run
        assert got.response_ids == ref.response_ids
        for a, b in zip(got.engine_logprobs, ref.engine_logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-5)


def test_a_slow_replica_takes_fewer_chunks_and_the_batch_is_the_one_replica_batch(
    moe_fleet_2x1, encode, one_replica_run
):
    # the slow replica is replica 0, so its loops start first: listed second, a loaded machine once ran the fast
    # replica's loops through every chunk before the slow one's took any (CI: [16, 0]), and the race was not run
    with slow_proxy(moe_fleet_2x1.urls[1], delay_s=1.5) as slow_url:
        raced, taken, spans = _generate([slow_url, moe_fleet_2x1.urls[0]], encode, chunks_in_flight=2, live=2)
    # every chunk generated once; the slow replica (>= 1.5 s a chunk) took fewer than the fast one, not its half
    assert sum(taken) == 2 * PROMPTS and 1 <= taken[0] < taken[1], taken
    assert len([s for s in spans if s.kind == "generate"]) == 2 * PROMPTS
    _same_as(raced, one_replica_run, encode)


@pytest.mark.parametrize("how", ["connection refused", "503 after 1 chunk"])
def test_a_lost_replica_costs_no_batch(moe_fleet_2x1, encode, one_replica_run, caplog, how):
    caplog.set_level(logging.WARNING, logger="megarl.rollout.worker")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # answer=1: the replica starts with two chunks in flight, so its second request is answered 503 whatever the
    # other replica's speed (with a later 503 the other replica could take every remaining chunk first)
    with slow_proxy(moe_fleet_2x1.urls[1], answer=1) as dying:
        lost_url = dead if how == "connection refused" else dying
        raced, taken, _ = _generate([lost_url, moe_fleet_2x1.urls[0]], encode, chunks_in_flight=2, live=1)
    # the lost replica's answered chunks count, its failed ones went to the other: every prompt exactly once
    assert taken[0] == (0 if how == "connection refused" else 1) and sum(taken) == 2 * PROMPTS, taken
    _same_as(raced, one_replica_run, encode)
    lines = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"rollout replica 0 ({lost_url}) lost: RolloutServerLost"), lines
    assert ("unreachable" if how == "connection refused" else "answered 503") in lines[0]


def _worker(urls, encode, end, min_replicas=1, evaluator=None):
    return RolloutWorker(
        [RolloutClient(u, timeout_s=60) for u in urls], SyncSchedule(2, 0),
        problems=lambda j: problem_batch(j, PROMPTS, 9, seed=3), encode=encode, sampling={"n": K, "max_tokens": 6},
        seed=lambda j: 1000 + 100 * j,
        score=BatchScorer(RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=10),
                          lambda ids: "7"),
        timeline=Timeline(), end=end, chunk_prompts=1, chunks_in_flight=2, min_replicas=min_replicas,
        evaluator=evaluator)


def test_a_replica_admitted_at_a_push_point_takes_chunks_from_the_next_window(moe_fleet_2x1, encode):
    # slot 0 is dead from the start (nothing listens there); at the push point before batch 2 a "restarted"
    # replica (a live server) is admitted into slot 0 and generates part of the next window
    dead = f"http://127.0.0.1:{free_port()}"
    worker = _worker([dead, moe_fleet_2x1.urls[0]], encode, end=4)
    try:
        first = [worker.take(0), worker.take(1)]
        assert worker.live_replicas() == 1 and list(worker.lost()) == [0] and worker.chunks_taken == [0, 2 * PROMPTS]
        worker.quiesce(2)
        worker.admit(0, RolloutClient(moe_fleet_2x1.urls[1], timeout_s=60))
        worker.pushed(2)
        second = [worker.take(2), worker.take(3)]
        assert worker.live_replicas() == 2 and not worker.lost()
        # the admitted replica took chunks of the second window only, and every prompt was generated once
        assert worker.chunks_taken[0] >= 1 and sum(worker.chunks_taken) == 4 * PROMPTS, worker.chunks_taken
    finally:
        worker.close()
    reference = _worker(moe_fleet_2x1.urls[:1], encode, end=4)
    try:
        expected = [reference.take(0), reference.take(1)]
        reference.quiesce(2)
        reference.pushed(2)
        expected += [reference.take(2), reference.take(3)]
    finally:
        reference.close()
    for j, (got, ref) in enumerate(zip(first + second, expected, strict=True)):
        prompts = [encode(p.prompt) for p in problem_batch(j, PROMPTS, 9, seed=3)]
        assert got.index == j and got.prompt_ids == [p for p in prompts for _ in range(K)]
        assert got.response_ids == ref.response_ids  # same seeds, same weights: the one-replica samples


def test_fewer_replicas_than_min_replicas_stops_the_rollout(moe_fleet_2x1, encode):
    dead = f"http://127.0.0.1:{free_port()}"
    worker = _worker([dead, moe_fleet_2x1.urls[0]], encode, end=2, min_replicas=2)
    try:
        with pytest.raises(RolloutWorkerError, match=r"1 replica\(s\) left, fewer than rollout.min_replicas=2") as err:
            worker.take(0)
        assert dead in str(err.value)
    finally:
        worker.close()


def test_a_replica_lost_in_an_evaluation_leaves_the_worker_and_below_min_replicas_stops_it(moe_fleet_2x1, encode):
    """No batch to generate (end=0): only the evaluation talks to replica 1, which answers 503 to every generate
    request. The worker takes it out (`lost()`), and with min_replicas=2 the evaluation raises naming the bound."""
    scorer = BatchScorer(RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=10), lambda ids: "7")
    with slow_proxy(moe_fleet_2x1.urls[1], answer=0) as dying:
        urls = [moe_fleet_2x1.urls[0], dying]
        evaluator = Evaluator([RolloutClient(u, timeout_s=60) for u in urls], problem_batch(-1, 4, 9, seed=1),
                              encode, scorer, {"n": K, "max_tokens": 4}, seed=7)
        for min_replicas in (1, 2):
            worker = _worker(urls, encode, end=0, min_replicas=min_replicas, evaluator=evaluator)
            try:
                if min_replicas == 1:
                    assert worker.evaluate()["eval/replicas_lost"] == 1
                else:
                    with pytest.raises(RolloutWorkerError, match=r"(?s)replica 1 .* lost during the evaluation: .*503.*"
                                       r"1 replica\(s\) left, fewer than rollout.min_replicas=2"):
                        worker.evaluate()
                assert list(worker.lost()) == [1] and worker.live_replicas() == 1
            finally:
                worker.close()
    scorer.close()
