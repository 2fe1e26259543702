"""The dispatch simulation (`megarl.bench.dispatch_sim`) against hand-computed timelines: a static share costs
`pipeline_sim`'s formula (prefill + step x longest + per-sequence x total tokens), and the queue's small cases
worked out by hand (who takes which chunk when, idle seconds, chunks per replica)."""

import random

import pytest

from megarl.bench import pipeline_sim as cluster
from megarl.bench.dispatch_sim import CLUSTER_COSTS, EngineCosts, guru_lengths, simulate_window

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
