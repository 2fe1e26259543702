"""From a `RolloutBatch` to padded trainer tensors, this data-parallel rank's share, and microbatches.

Token layout per sequence: `tokens = prompt + response` (right-padded); position `t` predicts
`targets[t] = tokens[t+1]`; `mask[t] = 1` exactly where `targets[t]` is a response token, and
`old_logprobs[t]` is the engine's log-prob of that token.

Packed microbatches (`trainer.pack_sequences`): the model sees the microbatch's sequences, each cut to
its real length, concatenated into ONE row (no padding inside), so a sequence attends only to itself: on the
local spec through a block-diagonal causal mask, on Transformer Engine's through THD packed-sequence parameters
(megatron's `PackedSeqParams`, the sequences' cumulative lengths: `thd_params`). The losses still see one row per
response: the model's per-token log-probs are gathered back into the `[b, S]` layout (`unpack_index`), so
GSPO/OAPL sequence quantities are per whole response, whatever the packing.

Sequence parallelism (megatron's, on for MoE at TP > 1: `megarl.models.qwen_provider`) scatters each microbatch
along the sequence over the TP ranks and asserts that its length divides by TP: with it, every row length the model
sees (the padded batch, each microbatch's width, packed or padded) is rounded up to a multiple of TP (`multiple`);
the columns added are padding (mask 0), so no loss term changes.
"""

from __future__ import annotations

import torch

from megarl.batch import RolloutBatch
from megarl.trainer.batch_tensors import RESPONSE_PREFIX, RESPONSE_TOKEN_FIELDS, BatchTensors, as_batch_tensors


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `n`."""
    return -(-n // multiple) * multiple


def pack_batch(batch: RolloutBatch | BatchTensors, pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Tensors of the whole global batch: tokens/targets/mask/old_logprobs `[N, S]`, advantages `[N]`; S is the
    longest sequence rounded up to a multiple of `multiple` (sequence parallelism: TP; else 1). `pack_tensors` of
    the batch's flat tensors (`megarl.trainer.batch_tensors`)."""
    return pack_tensors(as_batch_tensors(batch), pad_id, multiple)


def _flat_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments of `lengths` laid end to end: each element's (segment, index within its segment)."""
    total = int(lengths.sum())
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    return segment, torch.arange(total, device=lengths.device) - starts[segment]


def pack_tensors(batch: BatchTensors, pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """`pack_batch` from the flat tensors, by indexed writes (no loop over samples), on the tensors' device:
    `tokens [N, S]` (prompt + response, right-padded), `targets` (tokens shifted left by one), `mask` (1 at the
    positions predicting a response token), `old_logprobs` (the engine's there), `advantages [N]`, `lengths [N]`,
    `routed_experts [N, S, layers, k]` when the batch has routes (`pad_routed_experts`' layout), and each
    per-response-token field `<name> [N, S]` (`RESPONSE_TOKEN_FIELDS`) where `old_logprobs` has the log-probs."""
    t = batch.tensors
    prompt, response = t["prompt_lengths"], t["response_lengths"]
    lengths = prompt + response
    n, s = len(lengths), round_up(int(lengths.max()), multiple)
    device = lengths.device
    row, col = _flat_positions(lengths)
    tokens = torch.full((n, s), pad_id, dtype=torch.long, device=device)
    tokens[row, col] = t["tokens"]
    targets = torch.cat([tokens[:, 1:], torch.full((n, 1), pad_id, dtype=torch.long, device=device)], dim=1)
    resp_row, j = _flat_positions(response)
    resp_col = prompt[resp_row] - 1 + j  # the position predicting response token j
    mask = torch.zeros(n, s, device=device)
    mask[resp_row, resp_col] = 1.0
    old = torch.zeros(n, s, device=device)
    old[resp_row, resp_col] = t["engine_logprobs"]
    packed = {"tokens": tokens, "targets": targets, "mask": mask, "old_logprobs": old,
              "advantages": t["advantages"].float(), "lengths": lengths}
    if "routed_experts" in t:  # routes of input token t at position t; filler where the engine gave none
        routed = t["routed_experts"]
        routes = _route_filler(n, routed)[:, None].repeat(1, s, 1, 1).to(device)
        route_row, route_col = _flat_positions(t["route_lengths"])
        routes[route_row, route_col] = routed
        packed["routed_experts"] = routes
    for key, values in t.items():
        if key.startswith(RESPONSE_PREFIX):
            fill = RESPONSE_TOKEN_FIELDS[key.removeprefix(RESPONSE_PREFIX)][2]
            field = torch.full((n, s), fill, dtype=values.dtype, device=device)
            field[resp_row, resp_col] = values
            packed[key.removeprefix(RESPONSE_PREFIX)] = field
    return packed


def _route_filler(rows: int, like: torch.Tensor) -> torch.Tensor:
    """`[rows, layers, k]` of experts 0..k-1 in `like`'s dtype: valid, distinct experts for positions whose output
    feeds no log-prob (row padding, and the last token, which predicts nothing)."""
    layers, k = like.shape[-2:]
    return torch.arange(k, dtype=like.dtype).expand(rows, layers, k).clone()


def pad_routed_experts(routed: list[torch.Tensor], lengths: list[int], s: int) -> torch.Tensor:
    """Per-sample engine routes `[T_i, layers, k]` -> `[N, S, layers, k]` (their compact dtype), aligned with
    `tokens`: position t routes input token t. T_i must be the sequence length or one fewer (the engine never
    forwards the last sampled token; that position predicts nothing); the rest is `_route_filler`."""
    out = _route_filler(len(routed), routed[0])[:, None].repeat(1, s, 1, 1)
    for i, (r, n) in enumerate(zip(routed, lengths, strict=True)):
        if not n - 1 <= r.shape[0] <= n:
            raise ValueError(f"sample {i}: routed experts for {r.shape[0]} tokens, expected {n - 1} or {n} (prompt "
                             "+ response); the engine must return routes for every prompt token "
                             "(routed_experts_prompt_start=0)")
        out[i, :r.shape[0]] = r
    return out


def data_parallel_share(tensors: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """Contiguous rows `[dp_rank*N/dp, (dp_rank+1)*N/dp)` of every tensor (N must divide evenly)."""
    n = next(iter(tensors.values())).shape[0]
    if n % dp_size:
        raise ValueError(f"global batch of {n} sequences does not split over {dp_size} data-parallel ranks; "
                         "make data.prompts_per_step * rollout.samples_per_prompt a multiple of it")
    per = n // dp_size
    return {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in tensors.items()}


def microbatches(tensors: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[i:i + size] for k, v in tensors.items()} for i in range(0, n, size)]


# ---- microbatch plans: by count or by token budget (trainer.max_tokens_per_microbatch) -----------------------
# A plan lists, per data-parallel rank, its microbatches, each a list of GLOBAL row indices of the batch: a rank's
# share is the rows of its microbatches. Microbatch k has the same row length on every rank (`microbatch_widths`):
# with expert parallelism the token dispatcher gathers equal token counts from the ranks of its group.


def _group_tokens(lengths: list[int], group: list[int], dp: int, packed: bool, multiple: int = 1) -> int:
    """Tokens one rank computes when `group` (dp x b rows, longest first) is dealt to the dp ranks row by row:
    the largest rank's sum of lengths when packed, else b rows padded to the group's longest; the row width rounded
    up to a multiple of `multiple` (sequence parallelism: TP), as `microbatch_widths` rounds it."""
    if packed:
        return round_up(max(sum(lengths[i] for i in group[r::dp]) for r in range(dp)), multiple)
    return len(group) // dp * round_up(max(lengths[i] for i in group), multiple)


def microbatch_plan(lengths: list[int], dp_size: int, micro_batch_size: int, max_tokens: int | None,
                    packed: bool, multiple: int = 1) -> list[list[list[int]]]:
    """The microbatches of every data-parallel rank for a global batch of sequences of real `lengths`.

    `max_tokens` None (count-based): rank r holds the contiguous rows `data_parallel_share` gives it, cut into
    microbatches of `micro_batch_size` consecutive rows. Otherwise (token budget): the whole batch is sorted by
    length, longest first (ties: lower index first), and cut into groups of dp x b consecutive rows, b as large as
    the budget allows (`_group_tokens(...) <= max_tokens`, b >= 1; the widths counted as the model sees them, rounded
    up to a multiple of `multiple` under sequence parallelism); each group is dealt row by row to the ranks,
    so microbatch k has b rows on every rank and every rank runs the same number of microbatches (megatron's
    schedule, the gradient all-reduces and the expert dispatch are collective: no rank can run one more). A row
    longer than the budget gets a microbatch of its own. Whole sequences only; a function of the lengths alone,
    so every rank computes the same plan without a collective."""
    n = len(lengths)
    if n % dp_size:
        raise ValueError(f"global batch of {n} sequences does not split over {dp_size} data-parallel ranks; "
                         "make data.prompts_per_step * rollout.samples_per_prompt a multiple of it")
    per = n // dp_size
    if max_tokens is None:
        return [[list(range(r * per + i, r * per + min(i + micro_batch_size, per)))
                 for i in range(0, per, micro_batch_size)] for r in range(dp_size)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    start = 0
    while start < n:
        b = 1
        while (start + dp_size * (b + 1) <= n
               and _group_tokens(lengths, order[start:start + dp_size * (b + 1)], dp_size, packed, multiple)
               <= max_tokens):
            b += 1
        group = order[start:start + dp_size * b]
        for r in range(dp_size):
            plan[r].append(group[r::dp_size])
        start += dp_size * b
    return plan


def microbatch_widths(lengths: list[int], plan: list[list[list[int]]], packed: bool,
                      multiple: int = 1) -> list[int]:
    """Per microbatch index k, the row length every rank uses for microbatch k: its longest sequence over the
    ranks, or, packed, its longest packed row (sum of lengths) over the ranks; rounded up to a multiple of
    `multiple` (sequence parallelism: TP; else 1)."""
    return [round_up(max(sum(lengths[i] for i in mb) if packed else max(lengths[i] for i in mb) for mb in mbs),
                     multiple) for mbs in zip(*plan, strict=True)]


def plan_padding(lengths: list[int], plan: list[list[list[int]]], widths: list[int],
                 packed: bool) -> dict[str, float]:
    """Tokens the model computes for a plan whose microbatch k is `widths[k]` long vs the real tokens of the
    batch, summed over DP ranks: `train/tokens_computed`, `train/tokens_real`, `train/padding_fraction`
    (1 - real / computed) and `train/microbatches` (per rank). Packed: one row of `widths[k]` per microbatch;
    else b rows of it."""
    computed = sum(w if packed else len(mb) * w for mbs in plan for mb, w in zip(mbs, widths, strict=True))
    real = sum(lengths)
    return {"train/tokens_computed": computed, "train/tokens_real": real,
            "train/padding_fraction": 1.0 - real / computed, "train/microbatches": len(plan[0])}


def select_microbatch(share: dict[str, torch.Tensor], rows: list[int], width: int) -> dict[str, torch.Tensor]:
    """Rows `rows` of a share, every `[n, S, ...]` tensor cut (or kept) to `width` columns, at least the
    microbatch's longest sequence: the columns cut are padding in every selected row (mask 0), so no loss term
    changes."""
    index = torch.tensor(rows, dtype=torch.long)
    s = share["tokens"].shape[1]
    return {k: (v[index][:, :width] if v.dim() >= 2 and v.shape[1] == s else v[index]) for k, v in share.items()}


def packed_length(microbatches: list[dict[str, torch.Tensor]]) -> int:
    """The row length that holds every microbatch packed: one shape for all microbatches, since the policy
    passes megatron's schedule a single `seq_length` per step."""
    return max(int(mb["lengths"].sum()) for mb in microbatches)


def pack_microbatch(mb: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Add the packed model inputs to a microbatch of `b` padded rows `[b, S]` with real `lengths [b]`:
    `packed_tokens`, `packed_targets`, `packed_positions` (position within its own sequence) and
    `packed_segments` (which sequence, -1 on the padding at the end), all `[1, length]`,
    `unpack_index [b, S]`: where each (sequence, position) sits in the packed row (0 past a sequence's
    end, where `mask` is 0), and `packed_cu_seqlens` (int32): where each sequence starts in the row, then the row's
    end, with the trailing padding as a last sequence of its own (THD's cumulative lengths: `thd_params`)."""
    b, s = mb["tokens"].shape
    lengths = mb["lengths"].tolist()
    if sum(lengths) > length:
        raise ValueError(f"{sum(lengths)} tokens do not fit a packed row of {length}")
    tokens = torch.full((1, length), pad_id, dtype=torch.long)
    targets = torch.full((1, length), pad_id, dtype=torch.long)
    positions = torch.zeros(1, length, dtype=torch.long)
    segments = torch.full((1, length), -1, dtype=torch.long)
    index = torch.zeros(b, s, dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        row = slice(start, start + n)
        tokens[0, row], targets[0, row] = mb["tokens"][i, :n], mb["targets"][i, :n]
        positions[0, row], segments[0, row] = torch.arange(n), i
        index[i, :n] = torch.arange(start, start + n)
        start += n
    ends = torch.tensor(lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), ends] + ([torch.tensor([length], dtype=torch.int32)]
                                                                 if start < length else []))
    packed = {**mb, "packed_tokens": tokens, "packed_targets": targets, "packed_positions": positions,
              "packed_segments": segments, "unpack_index": index, "packed_cu_seqlens": cu}
    if "routed_experts" in mb:  # routing replay: the routes are packed exactly like their tokens
        routes = _route_filler(length, mb["routed_experts"])
        start = 0
        for i, n in enumerate(lengths):
            routes[start:start + n] = mb["routed_experts"][i, :n]
            start += n
        packed["packed_routed_experts"] = routes[None]
    return packed


def thd_params(cu_seqlens: torch.Tensor):
    """megatron's `PackedSeqParams` for one packed row whose sequences start at `cu_seqlens[:-1]` and end at
    `cu_seqlens[1:]` (int32, on the model's device; `pack_microbatch`'s `packed_cu_seqlens`): the `thd` format
    Transformer Engine's attention and fused RoPE take instead of a mask (each sequence causal within itself)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
