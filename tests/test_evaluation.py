"""Evaluation during training (megarl/rollout/evaluation.py): pass@k against brute-force enumeration, and the
evaluator on a real two-replica fleet against a direct count of the same seeded samples from one replica."""

from __future__ import annotations

import itertools
import math

import pytest
from transformers import AutoTokenizer

from megarl.data.arithmetic import problem_batch
from megarl.rewards.pool import RewardPool
from megarl.rewards.scoring import BatchScorer
from megarl.rollout.client import RolloutClient, RolloutServerLost
from megarl.rollout.evaluation import Evaluator, pass_at_k
from tests.dist_utils import free_port
from tests.slow_proxy import slow_proxy


def _pass_at_k_by_enumeration(n: int, correct: int, k: int) -> float:
    """The share of the C(n, k) size-k subsets of n samples (the first `correct` right) holding a right one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < correct for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "correct", "k"), [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 0, 4),
                                                 (6, 5, 2), (8, 3, 8), (7, 7, 3)])
def test_pass_at_k_equals_enumeration(n, correct, k):
    assert pass_at_k(n, correct, k) == pytest.approx(_pass_at_k_by_enumeration(n, correct, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


PROBLEMS = problem_batch(-1, 6, 9, seed=0, digits=True)
SAMPLING = {"n": 3, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def tokenizer(tiny_moe_dir):
    return AutoTokenizer.from_pretrained(str(tiny_moe_dir))


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _evaluate(tokenizer, clients, on_lost=None):
    scorer = BatchScorer(RewardPool("tests.reward_fns:odd_word_count", workers=1, timeout_s=30),
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    try:
        evaluator = Evaluator(list(clients.values()), PROBLEMS, lambda t: _encode(tokenizer, t), scorer, SAMPLING,
                              seed=500)
        return evaluator(clients, on_lost=on_lost)
    finally:
        scorer.close()


def _assert_direct_count(metrics, tokenizer, client):
    """The metrics equal the same prompts and seeds generated one by one on `client`, scored here by hand."""
    direct = [client.generate([_encode(tokenizer, p.prompt)], **SAMPLING, seed=500 + i)[0]
              for i, p in enumerate(PROBLEMS)]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rewards = [[float(len(decode(s.response_ids).split()) % 2 == 1) for s in group] for group in direct]
    flat = [x for g in rewards for x in g]
    assert 0 < sum(flat) < len(flat), "the test reward should score some samples and not others"
    assert metrics["eval/mean@3"] == pytest.approx(sum(flat) / len(flat), abs=1e-12)
    assert metrics["eval/pass@3"] == pytest.approx(sum(any(x >= 1 for x in g) for g in rewards) / len(rewards))
    lengths = [len(s.response_ids) for g in direct for s in g]
    assert metrics["eval/response_tokens"] == pytest.approx(sum(lengths) / len(lengths))


def test_evaluator_on_two_replicas_matches_a_direct_count(moe_fleet_2x1, tokenizer):
    clients = [RolloutClient(u, timeout_s=120) for u in moe_fleet_2x1.urls]
    metrics = _evaluate(tokenizer, dict(enumerate(clients)))
    _assert_direct_count(metrics, tokenizer, clients[0])
    assert metrics["eval/replicas_lost"] == 0
    labels = {c.weight_version() for c in clients}  # "default" (version 0) or the last push's version
    assert len(labels) == 1
    assert metrics["eval/policy_version"] == (0 if labels == {"default"} else int(labels.pop()))
    assert metrics["eval/prompts"] == 6 and metrics["eval/timeouts"] == 0
    assert math.isfinite(metrics["eval/seconds"]) and metrics["eval/seconds"] > 0


def test_a_replica_lost_mid_evaluation_hands_its_prompts_to_the_others(moe_fleet_2x1, tokenizer):
    """Replica 1 answers its first generate request and then 503 (a failing engine): it is reported once through
    `on_lost`, its unfinished prompts go to replica 0, and the metrics are those of the one-replica count."""
    live = RolloutClient(moe_fleet_2x1.urls[0], timeout_s=120)
    lost = []
    with slow_proxy(moe_fleet_2x1.urls[1], answer=1) as dying:
        clients = {0: live, 1: RolloutClient(dying, timeout_s=120)}
        metrics = _evaluate(tokenizer, clients, on_lost=lambda rep, why: lost.append((rep, why)))
    assert [rep for rep, _ in lost] == [1] and "503" in lost[0][1], lost
    assert metrics["eval/replicas_lost"] == 1 and metrics["eval/prompts"] == len(PROBLEMS)
    _assert_direct_count(metrics, tokenizer, live)


def test_an_evaluation_with_no_replica_left_says_so(tokenizer):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RolloutServerLost, match=r"every rollout replica stopped answering \(6 of 6 held-out"):
        _evaluate(tokenizer, {0: RolloutClient(dead, timeout_s=5)})
