"""The step's batch reaches every trainer rank as tensors (`megarl.trainer.batch_tensors.broadcast_batch`): across two
real gloo ranks, what rank 1 receives equals what rank 0 sent, tensor for tensor (values, shapes and dtypes: the
routes' uint8 and int16, the per-token policy versions, the float32 log-probs) and in the header's metadata; and
both equal the batch's lists flattened here by hand. The padded trainer tensors built from them (`pack_tensors`,
indexed writes) equal a per-sample loop written from the layout in `megarl/trainer/batching.py`'s docstring.
"""

from __future__ import annotations

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.token_versions import TokenVersions
from megarl.trainer.batch_tensors import batch_to_tensors
from megarl.trainer.batching import pack_batch, pack_tensors
from tests.dist_utils import run_distributed

PROMPTS = [[5, 6], [7, 8, 9], [10], [11, 12]]
RESPONSES = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30]]
LAYERS, TOPK = 3, 2


def _batch(route_dtype: torch.dtype) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    routes = [torch.randint(0, 300 if route_dtype == torch.int16 else 8, (n - (i % 2), LAYERS, TOPK), generator=g)
              .to(route_dtype) for i, n in enumerate(lengths)]  # odd samples: one route short (the last token)
    versions = [TokenVersions(((3, 1), (4, 2))), TokenVersions.single(4, 1), TokenVersions(((2, 4), (4, 1))),
                TokenVersions.single(3, 2)]
    return RolloutBatch(index=7, prompt_ids=PROMPTS, response_ids=RESPONSES,
                        engine_logprobs=[(-torch.rand(len(r), generator=g)).tolist() for r in RESPONSES],
                        rewards=torch.tensor([[1.0, 0.0], [0.5, 0.25]]),
                        advantages=torch.tensor([[0.5, -0.5], [0.125, -0.125]]), policy_version=4,
                        reward_timeouts=1, reward_flags={"unparsable": 2}, routed_experts=routes,
                        token_versions=versions)


ROUTE_DTYPES = (torch.uint8, torch.int16)


def _rank(rank, world):
    from megarl.trainer.batch_tensors import broadcast_batch

    out = []
    for route_dtype in ROUTE_DTYPES:  # one batch after the other through the same pair of ranks
        got = broadcast_batch(_batch(route_dtype) if rank == 0 else None, torch.device("cpu"))
        out.append((got.meta, got.tensors))
    return out


@pytest.fixture(scope="module")
def broadcasts():
    return run_distributed(_rank, 2)


@pytest.mark.parametrize("case", range(len(ROUTE_DTYPES)))
def test_received_tensors_equal_the_senders_and_the_lists(broadcasts, case):
    (meta0, sent), (meta1, received) = broadcasts[0][case], broadcasts[1][case]
    batch = _batch(ROUTE_DTYPES[case])
    expected = {
        "tokens": torch.tensor([t for p, r in zip(PROMPTS, RESPONSES, strict=True) for t in p + r]),
        "prompt_lengths": torch.tensor([len(p) for p in PROMPTS]),
        "response_lengths": torch.tensor([len(r) for r in RESPONSES]),
        "engine_logprobs": torch.tensor([x for lps in batch.engine_logprobs for x in lps], dtype=torch.float32),
        "advantages": batch.advantages.reshape(-1),
        "routed_experts": torch.cat(batch.routed_experts),
        "route_lengths": torch.tensor([r.shape[0] for r in batch.routed_experts]),
        "response/token_versions": torch.tensor([3, 4, 4, 4, 2, 2, 2, 2, 4, 3, 3]),
    }
    assert sent.keys() == received.keys() == expected.keys()
    for key, want in expected.items():
        assert received[key].dtype == sent[key].dtype == want.dtype, key
        assert torch.equal(received[key], sent[key]) and torch.equal(received[key], want), key
    assert meta1 == meta0 == {"index": 7, "policy_version": 4, "rewards": [[1.0, 0.0], [0.5, 0.25]],
                              "rewards_dtype": "float32", "reward_timeouts": 1, "reward_flags": {"unparsable": 2}}


def test_packed_tensors_equal_a_per_sample_loop():
    batch = _batch(torch.int16)
    packed = pack_tensors(batch_to_tensors(batch), pad_id=0, multiple=4)
    n, s = len(PROMPTS), 8  # longest sequence 6, rounded up to a multiple of 4
    want = {"tokens": torch.zeros(n, s, dtype=torch.long), "targets": torch.zeros(n, s, dtype=torch.long),
            "mask": torch.zeros(n, s), "old_logprobs": torch.zeros(n, s),
            "token_versions": torch.full((n, s), -1, dtype=torch.long),
            "routed_experts": torch.arange(TOPK, dtype=torch.int16).expand(n, s, LAYERS, TOPK).clone()}
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        seq = p + r
        want["tokens"][i, :len(seq)] = torch.tensor(seq)
        want["targets"][i, :len(seq) - 1] = torch.tensor(seq[1:])
        for j in range(len(r)):  # position len(p) - 1 + j predicts response token j
            want["mask"][i, len(p) - 1 + j] = 1.0
            want["old_logprobs"][i, len(p) - 1 + j] = batch.engine_logprobs[i][j]
            want["token_versions"][i, len(p) - 1 + j] = batch.token_versions[i].per_token()[j]
        want["routed_experts"][i, :batch.routed_experts[i].shape[0]] = batch.routed_experts[i]
    want["advantages"] = batch.advantages.reshape(-1)
    want["lengths"] = torch.tensor([len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    assert packed.keys() == want.keys()
    for key, value in want.items():
        assert packed[key].dtype == value.dtype and torch.equal(packed[key], value), key
    assert all(torch.equal(pack_batch(batch, 0, 4)[k], v) for k, v in packed.items())  # the RolloutBatch form


def test_a_batch_without_advantages_or_with_a_short_field_is_refused():
    import dataclasses

    batch = _batch(torch.uint8)
    with pytest.raises(ValueError, match="no advantages yet"):
        batch_to_tensors(dataclasses.replace(batch, advantages=None))
    short = [TokenVersions.single(4, 1)] + batch.token_versions[1:]
    with pytest.raises(ValueError, match="sample 0: 1 token_versions for a response of 3 tokens"):
        batch_to_tensors(dataclasses.replace(batch, token_versions=short))
