"""Packing a rollout batch into trainer tensors: targets, masks and engine log-probs line up with
the response tokens, and data-parallel shares and microbatches partition the rows."""

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.trainer.batching import data_parallel_share, microbatches, pack_batch, pack_microbatch, packed_length


def _batch():
    return RolloutBatch(
        index=0,
        prompt_ids=[[5, 6, 7], [8, 9]],
        response_ids=[[10, 2], [11]],
        engine_logprobs=[[-0.5, -0.25], [-1.5]],
        rewards=torch.tensor([[1.0, 0.0]]),
        advantages=torch.tensor([[0.5, -0.5]]),
        policy_version=3,
    )


def test_pack_aligns_targets_mask_and_logprobs():
    t = pack_batch(_batch(), pad_id=0)
    assert t["tokens"].tolist() == [[5, 6, 7, 10, 2], [8, 9, 11, 0, 0]]
    assert t["targets"].tolist() == [[6, 7, 10, 2, 0], [9, 11, 0, 0, 0]]
    # position t predicts targets[t]; only response targets count
    assert t["mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert t["old_logprobs"].tolist() == [[0, 0, -0.5, -0.25, 0], [0, -1.5, 0, 0, 0]]
    assert t["advantages"].tolist() == [0.5, -0.5]
    assert t["lengths"].tolist() == [5, 3]


def test_packed_row_concatenates_sequences_and_maps_back():
    mb = pack_batch(_batch(), pad_id=0)
    assert packed_length([mb]) == 8
    p = pack_microbatch(mb, length=10, pad_id=0)
    assert p["packed_tokens"].tolist() == [[5, 6, 7, 10, 2, 8, 9, 11, 0, 0]]
    assert p["packed_targets"].tolist() == [[6, 7, 10, 2, 0, 9, 11, 0, 0, 0]]
    assert p["packed_positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]]
    assert p["packed_segments"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]]
    # gathering any per-position value of the packed row through unpack_index restores the padded rows
    # wherever a sequence has a token (targets there, 0 = pad past the end where the mask is 0 anyway)
    unpacked = p["packed_targets"].reshape(-1)[p["unpack_index"]]
    real = torch.arange(5)[None] < p["lengths"][:, None]
    assert torch.equal(unpacked[real], mb["targets"][real])
    with pytest.raises(ValueError, match="8 tokens do not fit a packed row of 7"):
        pack_microbatch(mb, length=7, pad_id=0)


def test_shares_and_microbatches_partition_rows():
    tensors = {"x": torch.arange(12).reshape(6, 2)}
    shares = [data_parallel_share(tensors, r, 3)["x"] for r in range(3)]
    assert torch.equal(torch.cat(shares), tensors["x"])
    mbs = microbatches(tensors, 4)
    assert [m["x"].shape[0] for m in mbs] == [4, 2]
    with pytest.raises(ValueError, match="does not split over 4 data-parallel ranks"):
        data_parallel_share(tensors, 0, 4)


def test_scored_batch_and_advantages_by_hand():
    from megarl.algorithms.registry import get_algorithm
    from megarl.batch import with_advantages
    from megarl.config.schema import AlgorithmConfig
    from megarl.rewards.scoring import scored_batch
    from megarl.rollout.client import Sample

    samples = [[Sample([1], [t], [-0.5], "length", 3) for t in (10, 11, 10, 11)]]
    batch = scored_batch(4, samples, [[1.0, 0.0, 1.0, 0.0]], reward_timeouts=1)
    assert batch.advantages is None and batch.policy_version == 3 and batch.reward_timeouts == 1
    assert batch.response_ids == [[10], [11], [10], [11]] and batch.prompt_ids == [[1]] * 4
    # GRPO-style group baseline without std (REC-GSPO-NOIS): r - mean = +-0.5
    batch = with_advantages(batch, get_algorithm("rec_gspo_nois"), AlgorithmConfig())
    assert batch.rewards.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert batch.advantages.tolist() == [[0.5, -0.5, 0.5, -0.5]]
    mixed = [[Sample([1], [10], [-0.5], "length", v) for v in (3, 4)]]
    with pytest.raises(RuntimeError, match="mixes samples from policy versions"):
        scored_batch(0, mixed, [[1.0, 1.0]])


def test_batch_metrics_by_hand():
    from megarl.batch import batch_metrics

    batch = RolloutBatch(index=0, prompt_ids=[[1]] * 3, response_ids=[[5], [5, 6, 2], [7, 2]],
                         engine_logprobs=[[-0.1], [-0.1] * 3, [-0.1] * 2], rewards=torch.tensor([[1.0, 0.0, 0.5]]),
                         advantages=None, policy_version=0, reward_timeouts=1, reward_flags={"unparsable": 2})
    assert batch_metrics(batch, ("unparsable", "gold_unparsable")) == {
        "batch/samples": 3, "reward/mean": 0.5, "reward/timeouts": 1, "reward/unparsable": 2,
        "reward/gold_unparsable": 0,
        "response/length_mean": 2.0, "response/length_min": 1, "response/length_max": 3}


# lengths of a global batch of 8; plans and token counts worked out by hand
LENGTHS = [5, 4, 6, 4, 9, 3, 6, 3]  # longest first: rows 4 (9), 2 (6), 6 (6), 0 (5), 1 (4), 3 (4), 5 (3), 7 (3)


def test_token_budget_plan_by_hand():
    from megarl.trainer.batching import microbatch_plan, microbatch_widths, plan_padding

    # DP 1, b x longest <= 12: the 9-token row alone, then 2x6, 2x5, 3x4 (43 tokens for 40 real ones)
    plan = microbatch_plan(LENGTHS, 1, 8, 12, packed=False)
    assert plan == [[[4], [2, 6], [0, 1], [3, 5, 7]]]
    assert microbatch_plan(LENGTHS, 1, 8, 5, packed=False) == [[[4], [2], [6], [0], [1], [3], [5], [7]]]
    widths = microbatch_widths(LENGTHS, plan, packed=False)
    assert widths == [9, 6, 5, 4]
    stats = plan_padding(LENGTHS, plan, widths, packed=False)
    assert stats["train/tokens_computed"] == 9 + 2 * 6 + 2 * 5 + 3 * 4
    assert stats["train/tokens_real"] == 40 and stats["train/microbatches"] == 4
    assert stats["train/padding_fraction"] == pytest.approx(1 - 40 / 43)
    # DP 2: groups of 2b rows dealt row by row, so microbatch k has b rows and one width on both ranks:
    # [9 | 6] (b=1: 2x9 > 12), [6, 4 | 5, 4] (b=2 at width 6), [3 | 3] (the rest)
    plan = microbatch_plan(LENGTHS, 2, 8, 12, packed=False)
    assert plan == [[[4], [6, 1], [5]], [[2], [0, 3], [7]]]
    assert microbatch_plan(LENGTHS, 2, 8, 12, packed=False) == plan  # deterministic
    widths = microbatch_widths(LENGTHS, plan, packed=False)
    assert widths == [9, 6, 3]
    assert plan_padding(LENGTHS, plan, widths, packed=False)["train/tokens_computed"] == 2 * (9 + 2 * 6 + 3)
    # packed, DP 2: a rank's sum <= 12 ([9 | 6]; [6, 4 | 5, 4] = 10 | 9; adding [3 | 3] would make 13)
    packed = microbatch_plan(LENGTHS, 2, 8, 12, packed=True)
    assert packed == plan
    widths = microbatch_widths(LENGTHS, packed, packed=True)
    assert widths == [9, 10, 3]
    assert plan_padding(LENGTHS, packed, widths, packed=True)["train/tokens_computed"] == 2 * (9 + 10 + 3)
    # count-based (today's): each rank's contiguous rows, consecutive
    assert microbatch_plan(LENGTHS, 2, 3, None, packed=False) == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]


def test_token_budget_counts_widths_rounded_for_sequence_parallelism():
    """Under sequence parallelism every width is rounded up to a multiple of TP (4 here), and the budget counts the
    rounded widths: cut by real lengths, [2, 6] would be 2 x 8 = 16 tokens and [0, 1] 2 x 8, over 12."""
    from megarl.trainer.batching import microbatch_plan, microbatch_widths

    plan = microbatch_plan(LENGTHS, 1, 8, 12, packed=False, multiple=4)
    assert plan == [[[4], [2], [6], [0], [1, 3, 5], [7]]]  # 9 -> 12 alone; 6, 6, 5 -> 8 alone; 4, 4, 3 -> 3 x 4
    widths = microbatch_widths(LENGTHS, plan, packed=False, multiple=4)
    assert widths == [12, 8, 8, 8, 4, 4]
    assert all(len(mb) * w <= 12 or len(mb) == 1 for mb, w in zip(plan[0], widths, strict=True))
    unrounded = microbatch_plan(LENGTHS, 1, 8, 12, packed=False)  # the plan without the rounding overflows it
    assert [len(mb) * w for mb, w in zip(unrounded[0], microbatch_widths(LENGTHS, unrounded, False, 4),
                                         strict=True)] == [12, 16, 16, 12]
    # packed: a rank's sum of lengths rounded up (9 -> 12; 6 + 6 = 12; 5 + 4 = 9 -> 12; 4 + 3 + 3 = 10 -> 12)
    assert microbatch_plan(LENGTHS, 1, 8, 12, packed=True, multiple=4) == [[[4], [2, 6], [0, 1], [3, 5, 7]]]


def test_rank_microbatches_are_the_recompute_cuts():
    """`rank_microbatches` (what the step trains on and `algorithm.old_logprobs=trainer` recomputes over): at a
    12-token budget, DP 2, each rank's microbatches are the plan's rows cut to the plan's widths, every b x width
    within the budget unless one row; count-based: `micro_batch_size` rows at the batch's padded width."""
    from megarl.config.schema import TrainerConfig
    from megarl.trainer.step import rank_microbatches

    batch = RolloutBatch(index=0, prompt_ids=[[1]] * 8, response_ids=[[5] * (n - 1) for n in LENGTHS],
                         engine_logprobs=[[-0.1] * (n - 1) for n in LENGTHS], rewards=torch.zeros(1, 8),
                         advantages=torch.zeros(1, 8), policy_version=0)
    tensors = pack_batch(batch, pad_id=0)
    budget = TrainerConfig(world_size=2, max_tokens_per_microbatch=12)
    for rank, want in enumerate(([[4], [6, 1], [5]], [[2], [0, 3], [7]])):  # the DP 2 plan above
        plan, widths, mbs = rank_microbatches(tensors, budget, rank, 2, 1, pad_id=0)
        assert plan[rank] == want and widths == [9, 6, 3]
        assert [tuple(mb["tokens"].shape) for mb in mbs] == [(1, 9), (2, 6), (1, 3)]
        assert [mb["lengths"].tolist() for mb in mbs] == [[LENGTHS[i] for i in rows] for rows in want]
    _, _, mbs = rank_microbatches(tensors, TrainerConfig(world_size=2, micro_batch_size=3), 1, 2, 1, pad_id=0)
    assert [tuple(mb["tokens"].shape) for mb in mbs] == [(3, 9), (1, 9)]  # rows 4-6, then 7, padded to 9


def test_select_microbatch_cuts_columns():
    from megarl.trainer.batching import select_microbatch

    t = pack_batch(_batch(), pad_id=0)
    mb = select_microbatch(t, [1], 3)
    assert mb["tokens"].tolist() == [[8, 9, 11]] and mb["mask"].tolist() == [[0, 1, 0]]
    assert mb["advantages"].tolist() == [-0.5] and mb["lengths"].tolist() == [3]


# sequence parallelism (MoE at TP > 1): every row length rounded up to a multiple of TP, worked out by hand
ODD = [5, 3, 7, 2, 9, 4]
ODD_PLAN = [[[0, 1], [4]], [[2, 3], [5]]]  # DP 2: microbatch 0 = rows 0, 1 | 2, 3; microbatch 1 = row 4 | row 5


@pytest.mark.parametrize("tp, padded, packed", [
    (1, [7, 9], [9, 9]),  # longest of [5, 3 | 7, 2] = 7, of [9 | 4] = 9; packed sums 8 | 9 and 9 | 4
    (2, [8, 10], [10, 10]),
    (4, [8, 12], [12, 12]),
])
def test_microbatch_widths_divide_by_tp_under_sequence_parallelism(tp, padded, packed):
    from megarl.trainer.batching import microbatch_widths, plan_padding

    assert microbatch_widths(ODD, ODD_PLAN, packed=False, multiple=tp) == padded
    assert microbatch_widths(ODD, ODD_PLAN, packed=True, multiple=tp) == packed
    computed = plan_padding(ODD, ODD_PLAN, padded, packed=False)["train/tokens_computed"]
    assert computed == 2 * (2 * padded[0] + padded[1])  # each rank: 2 rows of width 0, 1 row of width 1


@pytest.mark.parametrize("tp, s", [(1, 5), (2, 6), (4, 8)])
def test_pack_batch_pads_the_batch_to_a_multiple_of_tp(tp, s):
    t = pack_batch(_batch(), pad_id=0, multiple=tp)  # rows of 5 and 3 tokens
    pad = [0] * (s - 5)
    assert t["tokens"].tolist() == [[5, 6, 7, 10, 2] + pad, [8, 9, 11, 0, 0] + pad]
    assert t["targets"].tolist() == [[6, 7, 10, 2, 0] + pad, [9, 11, 0, 0, 0] + pad]
    assert t["mask"].tolist() == [[0, 0, 1, 1, 0] + pad, [0, 1, 0, 0, 0] + pad]
    assert t["lengths"].tolist() == [5, 3]


@pytest.mark.parametrize("experts, tp, multiple", [(8, 2, 2), (8, 4, 4), (8, 1, 1), (0, 2, 1)])
def test_the_width_multiple_is_tp_exactly_when_megatron_runs_sequence_parallel(experts, tp, multiple):
    from megarl.models.qwen_provider import transformer_config_from_hf
    from megarl.trainer.step import sequence_multiple

    hf = dict(model_type="qwen3_moe" if experts else "qwen3", vocab_size=32, hidden_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if experts:
        hf.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    config = transformer_config_from_hf(hf, tp, 1, 1)
    assert config.sequence_parallel == (multiple > 1)
    assert sequence_multiple(config) == multiple


def test_packed_row_carries_thd_cumulative_lengths_for_transformer_engine():
    """`pack_microbatch`'s `packed_cu_seqlens`: each sequence's start in the row, then the row's end, the trailing
    padding a last sequence of its own (hand count); `thd_params` turns them into megatron's `PackedSeqParams` in
    the `thd` format with the longest sequence as max_seqlen (what Transformer Engine's attention and fused RoPE
    take instead of the block-diagonal mask)."""
    import torch

    from megarl.trainer.batching import pack_microbatch, thd_params

    tokens = torch.arange(15).reshape(3, 5)
    mb = {"tokens": tokens, "targets": tokens + 1, "lengths": torch.tensor([5, 2, 4])}
    packed = pack_microbatch(mb, length=12, pad_id=0)
    cu = packed["packed_cu_seqlens"]
    assert cu.tolist() == [0, 5, 7, 11, 12] and cu.dtype == torch.int32
    full = pack_microbatch(mb, length=11, pad_id=0)  # no padding: no extra sequence
    assert full["packed_cu_seqlens"].tolist() == [0, 5, 7, 11]
    params = thd_params(packed["packed_cu_seqlens"])
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.cu_seqlens_q is params.cu_seqlens_kv is packed["packed_cu_seqlens"]


def test_packed_rows_attend_by_mask_on_the_local_spec_and_by_thd_on_te():
    import torch

    from megarl.trainer.batching import pack_microbatch
    from megarl.trainer.policy import attention_inputs

    tokens = torch.arange(6).reshape(2, 3)
    plain = {"tokens": tokens, "targets": tokens, "lengths": torch.tensor([3, 2])}
    packed = pack_microbatch(plain, length=6, pad_id=0)
    assert attention_inputs(plain, 3, torch.device("cpu"), "te") == (None, None)  # causal: no mask either way
    mask, thd = attention_inputs(packed, 6, torch.device("cpu"), "local")
    assert thd is None and mask.shape == (1, 1, 6, 6)
    assert not mask[0, 0, 4, 3] and mask[0, 0, 3, 2] and mask[0, 0, 3, 4]  # own sequence, earlier: attended
    mask, thd = attention_inputs(packed, 6, torch.device("cpu"), "te")
    assert mask is None and thd.qkv_format == "thd" and thd.cu_seqlens_q.tolist() == [0, 3, 5, 6]
