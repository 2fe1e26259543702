"""The fleet's shared queue (`megarl.rollout.chunk_queue`) on its own: chunks of whole prompts handed out lowest
batch first, a chunk given back (its replica was lost) handed out next, and a batch complete, in prompt order, once
every prompt's group is in exactly once, whoever generated which chunk."""

from __future__ import annotations

import pytest

from megarl.data.arithmetic import problem_batch
from megarl.rollout.chunk_queue import Chunk, ChunkQueue
from megarl.rollout.client import Sample


def _group(batch: int, prompt: int) -> list[Sample]:
    """A stand-in group of one sample that names its batch and prompt (the queue stores groups, never reads them)."""
    return [Sample([batch, prompt], [prompt], [-1.0], "stop", 0)]


def _open(queue: ChunkQueue, prompts: int) -> int:
    problems = problem_batch(queue.next_batch, prompts, 9, seed=0)
    return queue.open_batch(problems, [[1, 2, 3]] * prompts)


def test_chunks_cover_a_batch_in_prompt_order_lowest_batch_first():
    queue = ChunkQueue(first=0, chunk_prompts=2)
    assert _open(queue, 5) == 0 and _open(queue, 3) == 1
    taken = [queue.take_open(replica=r % 2) for r in range(6)]
    assert taken == [Chunk(0, range(0, 2)), Chunk(0, range(2, 4)), Chunk(0, range(4, 5)), Chunk(1, range(0, 2)),
                     Chunk(1, range(2, 3)), None]
    assert queue.complete_below() == 0


def test_a_chunk_given_back_is_taken_next_and_its_batch_completes():
    queue = ChunkQueue(first=0, chunk_prompts=2)
    _open(queue, 5)
    lost, second, third = queue.take_open(0), queue.take_open(1), queue.take_open(1)
    assert queue.take_open(1) is None
    queue.give_back(lost)  # replica 0 stopped answering while generating it
    assert queue.open[0].missing == 5
    again = queue.take_open(1)
    assert again == lost == Chunk(0, range(0, 2))  # the front of the queue, for any replica
    assert queue.take_open(1) is None
    for chunk in (third, second):
        assert queue.done(chunk, [_group(0, i) for i in chunk.prompts]) is None
    batch = queue.done(again, [_group(0, i) for i in again.prompts])
    assert batch is not None and batch.missing == 0 and 0 not in queue.open and queue.complete_below() == 1
    assert [g[0].prompt_ids for g in batch.groups] == [[0, i] for i in range(5)]  # prompt order, each once


def test_a_prompt_stored_twice_is_an_error():
    queue = ChunkQueue(first=0, chunk_prompts=1)
    _open(queue, 2)
    chunk = queue.take_open(0)
    queue.done(chunk, [_group(0, 0)])
    with pytest.raises(RuntimeError, match="batch 0, prompt 0 was generated twice"):
        queue.done(chunk, [_group(0, 0)])


def test_a_static_share_goes_back_to_any_replica():
    """The static split (`megarl bench longtail`'s comparison) owns shares by replica; a share given back is
    anyone's."""
    queue = ChunkQueue(first=0, chunk_prompts=1, static_replicas=2)
    _open(queue, 4)
    assert queue.take_open(1) == Chunk(0, range(2, 4)) and queue.take_open(1) is None
    share = queue.take_open(0)
    queue.give_back(share)
    assert queue.take_open(1) == share == Chunk(0, range(0, 2))


def test_a_reopened_batch_hands_out_only_its_unstarted_prompts():
    """A resumed run's partial rollouts (`megarl.rollout.partial.CarriedGroups`): batch 1 had prompts 0, 3, 4 and 6
    started before the checkpoint; reopened, it hands out the others in chunks of consecutive prompts and completes
    when they are in."""
    queue = ChunkQueue(first=3, chunk_prompts=2)
    problems = problem_batch(1, 7, 9, seed=0)
    queue.reopen(1, problems, [[1, 2, 3]] * 7, [5, 1, 2])
    with pytest.raises(ValueError, match="batch 1 cannot be reopened"):
        queue.reopen(1, problems, [[1, 2, 3]] * 7, [5])
    with pytest.raises(ValueError, match="batch 3 cannot be reopened"):
        queue.reopen(3, problems, [[1, 2, 3]] * 7, [5])
    chunks = [queue.take_open(0), queue.take_open(1), queue.take_open(0)]
    assert chunks == [Chunk(1, range(1, 3)), Chunk(1, range(5, 6)), None]
    assert queue.complete_below() == 1
    assert queue.done(chunks[0], [_group(1, 1), _group(1, 2)]) is None
    batch = queue.done(chunks[1], [_group(1, 5)])
    assert batch is not None and queue.complete_below() == 3
