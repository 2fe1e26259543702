"""One optimizer step on a rollout batch: this rank's data-parallel share, microbatches, the
registered loss, and the step metrics.

The loss closure turns a microbatch into the algorithm's `PolicyLossInput`; every value it returns
is a contribution to a global-batch quantity (divided by the global sequence or token count), so
the trainer sums them over microbatches and data-parallel ranks.
"""

from __future__ import annotations

import torch

from megarl.algorithms.corrections import correction_weights
from megarl.algorithms.losses import PolicyLossInput
from megarl.algorithms.registry import Algorithm
from megarl.algorithms.versions import check_token_versions
from megarl.batch import RolloutBatch
from megarl.config.schema import Config, TrainerConfig
from megarl.metrics import mismatch, token_lags
from megarl.schedule import VersionClock
from megarl.token_versions import version_lag
from megarl.trainer.batch_tensors import BatchTensors, as_batch_tensors
from megarl.trainer.batching import (
    microbatch_plan,
    microbatch_widths,
    pack_batch,
    pack_microbatch,
    plan_padding,
    select_microbatch,
)
from megarl.trainer.routing_replay import index_bytes


def sequence_multiple(model_config) -> int:
    """What every row length the model sees must divide by: TP under sequence parallelism (megatron scatters each
    microbatch along the sequence over the TP ranks and asserts the length divides), else 1. `model_config`: the
    megatron model's `TransformerConfig`."""
    return model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1


def rank_microbatches(tensors: dict[str, torch.Tensor], t: TrainerConfig, dp_rank: int, dp_size: int, multiple: int,
                      pad_id: int) -> tuple[list[list[list[int]]], list[int], list[dict[str, torch.Tensor]]]:
    """This data-parallel rank's microbatches of the global batch `tensors` (`pack_batch`), as the model gets them:
    `(plan, widths, microbatches)`. By count (`trainer.micro_batch_size` rows, every row padded to the batch's
    longest) or by token budget (`trainer.max_tokens_per_microbatch`: each microbatch cut to its longest row, the
    widths rounded up to `multiple` and counted so in the budget); with `trainer.pack_sequences` each microbatch's
    rows also packed into one (microbatch k as long on every rank; the losses still see `[b, S]`)."""
    lengths, padded = tensors["lengths"].tolist(), tensors["tokens"].shape[1]
    plan = microbatch_plan(lengths, dp_size, t.micro_batch_size, t.max_tokens_per_microbatch, t.pack_sequences,
                           multiple)
    if t.pack_sequences or t.max_tokens_per_microbatch is not None:
        widths = microbatch_widths(lengths, plan, t.pack_sequences, multiple)
    else:  # count-based microbatches: every row padded to the global batch's longest (rounded up)
        widths = [padded] * len(plan[dp_rank])
    rows = [i for mb in plan[dp_rank] for i in mb]
    share = {k: v[torch.tensor(rows, dtype=torch.long)] for k, v in tensors.items()}
    offsets = [0]
    for mb in plan[dp_rank]:
        offsets.append(offsets[-1] + len(mb))
    mbs = [select_microbatch(share, list(range(lo, hi)), padded if t.pack_sequences else w)
           for lo, hi, w in zip(offsets[:-1], offsets[1:], widths, strict=True)]
    if t.pack_sequences:
        mbs = [pack_microbatch(mb, w, pad_id) for mb, w in zip(mbs, widths, strict=True)]
    return plan, widths, mbs


def recompute_old_logprobs(policy, mbs: list[dict[str, torch.Tensor]]) -> None:
    """`algorithm.old_logprobs=trainer`: each microbatch's `old_logprobs` (response positions; 0 elsewhere) become
    the policy's own log-probs before the update, computed over the training microbatches themselves (forward only),
    so the recompute is cut by the same token budget, widths and packing as the step."""
    for mb, (logprobs, _) in zip(mbs, policy.microbatch_logprobs(mbs), strict=True):
        mb["old_logprobs"] = logprobs * mb["mask"]


def train_on_batch(
    policy, batch: RolloutBatch | BatchTensors, algorithm: Algorithm, cfg: Config, pad_id: int, dp_rank: int,
    dp_size: int, lag: int, bound: int | None = None,
) -> dict[str, float]:
    """One optimizer step on `batch`: a `RolloutBatch`, or its flat tensors as every rank receives them
    (`megarl.trainer.batch_tensors.broadcast_batch`; packed on the host, where the microbatches are cut). `lag`: the
    batch's lag behind the trainer; `bound`: the staleness bound its per-token versions are checked against (the
    run's `VersionClock.bound`; None: the bound of a clock built from `cfg`, for callers outside the run loop)."""
    multiple = sequence_multiple(policy.model.config)
    batch = as_batch_tensors(batch)
    batch = BatchTensors(batch.meta, {k: v.cpu() for k, v in batch.tensors.items()})
    # in-flight weight updates: per-token lags within the bound, mixed-version groups only for algorithms that take them
    trainer_version = policy.version
    if bound is None:
        bound = VersionClock.from_config(cfg).bound
    token_versions = batch.token_versions  # (once: rebuilt from the flat tensors)
    check_token_versions(token_versions, batch.rewards.shape[1], trainer_version, bound, algorithm.name)
    tensors = pack_batch(batch, pad_id, multiple)
    rewards = batch.rewards
    # per-sequence 0/1 weights (off-policy GRPO drops zero-variance groups; all ones for the others)
    tensors["seq_mask"] = algorithm.sequence_mask(rewards, cfg.algorithm).expand_as(rewards).reshape(-1)
    num_tokens = float(tensors["mask"].sum())  # response tokens of the GLOBAL batch
    t = cfg.trainer
    lengths = tensors["lengths"].tolist()
    plan, widths, mbs = rank_microbatches(tensors, t, dp_rank, dp_size, multiple, pad_id)
    for mb in mbs:
        mb["engine_logprobs"] = mb["old_logprobs"]
    if cfg.algorithm.old_logprobs == "trainer":  # decoupled-PPO proximal policy: recompute before updating
        recompute_old_logprobs(policy, mbs)

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: dict[str, torch.Tensor]):
        mask = mb["mask"]
        # train-inference correction (algorithm.correction): rho = trainer (this step's pre-update weights) / engine
        weight, correction_metrics = correction_weights(cfg.algorithm.correction, logprobs, mb["engine_logprobs"],
                                                        mask, num_tokens)
        inp = PolicyLossInput(logprobs * mask, mb["old_logprobs"], mask, mb["advantages"], batch.num_seqs,
                              num_tokens=int(num_tokens), engine_logprobs=mb["engine_logprobs"],
                              seq_mask=mb["seq_mask"].float(), token_weight=weight)
        loss, metrics = algorithm.loss(inp, cfg.algorithm)
        metrics.update(correction_metrics)
        metrics["entropy"] = (entropy.detach() * mask).sum() / num_tokens
        gap = (logprobs.detach() - mb["engine_logprobs"]).abs()
        metrics["logprob/engine_vs_trainer"] = (gap * mask).sum() / num_tokens
        # the train-inference mismatch monitor at the trainer's current weights (megarl/metrics/mismatch.py)
        metrics.update(mismatch.token_contributions(logprobs, mb["engine_logprobs"], mask, num_tokens))
        if "token_versions" in mb:  # the same mismatch per segment of equal token lag (megarl/metrics/token_lags.py)
            metrics.update(token_lags.segment_contributions(logprobs, mb["engine_logprobs"], mask,
                                                            version_lag(trainer_version, mb["token_versions"]),
                                                            bound))
        return loss, metrics

    # no registered loss has an entropy bonus (its coefficient is 0: the entropy above is a metric, detached), so
    # the entropy comes back without gradient and no entropy backward runs
    metrics = policy.train_step(mbs, loss_fn, entropy_grad=False)
    metrics.update(plan_padding(lengths, plan, widths, t.pack_sequences))
    metrics.setdefault("clip_frac", 0.0)  # algorithms without clipping clip nothing
    if batch.routed_experts is not None:  # routing replay: bytes of the expert indices the batch carries
        metrics["replay/index_bytes"] = index_bytes(batch.routed_experts)
    metrics = mismatch.finish(metrics)  # the summed log-ratio histogram -> ratio quantiles (scalars only)
    if token_versions is not None:  # per-token lag histogram, spanning share, mismatch per lag segment
        metrics = token_lags.finish_segments(metrics, bound)
        metrics.update(token_lags.token_lag_metrics(token_versions, trainer_version, bound))
    # lag 0: the trainer's current weights are the behaviour weights, so the mismatch is pure numerics
    metrics["mismatch/at_behaviour_weights"] = int(lag == 0)
    if lag != 0:  # the engine/trainer gap only measures numerics when both hold the same weights
        metrics["logprob/engine_vs_trainer"] = None
    return metrics
