"""The decoupled objective and the per-token versions through the REAL trainer: the cases that
tests/test_corrections_trainer.py runs in its trainer process (one gloo rank, tiny dense Qwen3; sharing it saves a
process start and a checkpoint), on the batch of tests/test_trainer_invariance.py with in-flight versions: the
trainer is at version 3, half the responses span versions 2 and 3, one holds version 2 only. Engine log-probs: the
reference's on lag-0 tokens (the engine held the trainer's weights), the reference's shifted by fixed offsets on lag-1
tokens (behaviour weights pi_prox / mu = 1.82 / 0.90 / 1.11 / 0.55; C = 1.5 truncates 1.82). Split into 1 x 8 and
4 x 2 microbatches.

The reference is independent: `transformers` log-probs of each sequence alone and the decoupled objective written
out here (megarl's proximal policy is the training forward itself, so r = s = 1 in value and the gradient is
`-A w_t dlogp_t` times the loss's factor). Checked: loss, every parameter gradient (loss rtol 1e-5, gradients 1e-5 of
the largest), `decoupled/*`, `token_lag/*` against hand counts and `mismatch/lag{k}/*` against the offsets; and the
run-time refusals (OAPL with mixed-version groups, a token past the staleness bound) before any computation.
"""

from __future__ import annotations

import math

import torch

from megarl.config.schema import (
    AlgorithmConfig,
    Config,
    DecoupledConfig,
    ModelConfig,
    SyncConfig,
    TrainerConfig,
)
from megarl.token_versions import TokenVersions
from tests.test_megatron_vs_hf import _per_expert
from tests.test_trainer_invariance import (
    DELTAS,
    EPS,
    PAD,
    RESPONSE_LENGTHS,
    REWARDS,
    _batch,
    _grad_errors,
    _hf_logprobs,
)

TRAINER_VERSION = 3
CAP = 1.5
# per response (lengths 3, 1, 5, 2, 6, 2, 4, 1): versions 2 (lag 1) then 3 (lag 0)
TV = [TokenVersions(((2, 1), (3, 2))), TokenVersions.single(3, 1), TokenVersions(((2, 3), (3, 2))),
      TokenVersions.single(2, 2), TokenVersions(((2, 2), (3, 4))), TokenVersions(((2, 1), (3, 1))),
      TokenVersions.single(3, 4), TokenVersions.single(2, 1)]
CASES = ("grpo", "rec_gspo_is")
MICRO_BATCH_SIZES = (8, 2)
GRAD_TOL = 1e-5


def _lags() -> list[list[int]]:
    return [[TRAINER_VERSION - v for v in tv.per_token()] for tv in TV]


def _engine(lp: list[torch.Tensor]) -> list[torch.Tensor]:
    """Lag-0 tokens: the reference log-prob; lag-1 tokens: shifted by DELTAS (so log pi_prox / mu = DELTAS)."""
    return [x.detach() - torch.tensor([DELTAS[(i + t) % 4] if lag else 0.0 for t, lag in enumerate(lags)])
            for i, (x, lags) in enumerate(zip(lp, _lags(), strict=True))]


def _cfg(name: str, hf_dir, interval: int = 2, decoupled: bool = True) -> Config:
    return Config(model=ModelConfig(hf_dir=hf_dir), sync=SyncConfig(interval=interval),
                  algorithm=AlgorithmConfig(name=name, eps_low=EPS, eps_high=EPS,
                                            decoupled=DecoupledConfig(enabled=decoupled, cap=CAP)))


def _reference_loss(name: str, lp: list[torch.Tensor], engine: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(a loss with the decoupled gradient, the value the trainer reports), the whole batch at once."""
    r = REWARDS
    mean, std = r.mean(-1, keepdim=True), r.std(-1, unbiased=False, keepdim=True)
    adv = ((r - mean) / (std + 1e-6) if name == "grpo" else r - mean).reshape(-1)
    n, tokens = len(lp), sum(len(x) for x in lp)
    total = 0.0
    for x, e, a in zip(lp, engine, adv, strict=True):
        w = torch.clamp(torch.exp(x.detach() - e), max=CAP)
        if name == "grpo":  # -w min(r A, clip(r) A), r = pi_theta / pi_prox = 1 in value
            ratio = torch.exp(x - x.detach())
            total = total - (w * torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)).sum() / tokens
        else:  # s = 1 in value, M = 1 (A != 0); gradient -(1/N) A w_t / |y|
            total = total - a * (w * torch.exp(x - x.detach())).mean() / n
    value = float(total.detach()) if name == "grpo" else -float(adv.sum()) / n  # GSPO reports -min(s A, clip(s) A)
    return total, value


def run_in_rank(policy, hf, hf_dir, world, dp_rank, dp, responses, engine, references) -> tuple[dict, dict]:
    """Rank side: the refusals, then each case and split from the policy's initial weights (restored after each)."""
    import dataclasses

    from megarl.algorithms.registry import get_algorithm
    from megarl.trainer.step import train_on_batch

    results, refusals = {}, {}
    initial = [p.detach().clone() for p in policy.model.parameters()]
    version = policy.version
    base = dataclasses.replace(_batch(responses, engine), policy_version=2, token_versions=TV)
    for refused, interval in (("oapl", 2), ("grpo", 1)):  # mixed-version groups; a bound of 0 < the lag of 1
        cfg = _cfg(refused, hf_dir, interval, decoupled=refused != "oapl")
        policy.version = TRAINER_VERSION
        try:
            train_on_batch(policy, base, get_algorithm(refused), cfg, PAD, dp_rank, dp, lag=1)
            refusals[refused] = None
        except (ValueError, RuntimeError) as e:
            refusals[refused] = (type(e).__name__, str(e), policy.version)
    for i, name in enumerate(CASES):
        algorithm = get_algorithm(name)
        cfg = _cfg(name, hf_dir)
        batch = dataclasses.replace(base, advantages=algorithm.advantages(REWARDS, cfg.algorithm))
        for micro in MICRO_BATCH_SIZES:
            policy.version = TRAINER_VERSION
            cfg = cfg.model_copy(update={"trainer": TrainerConfig(world_size=world, micro_batch_size=micro)})
            metrics = train_on_batch(policy, batch, algorithm, cfg, PAD, dp_rank, dp, lag=1)
            rows = _grad_errors(policy, hf, references[i][1])
            results[(i, micro)] = (metrics, max(r[2] for r in rows))
            with torch.no_grad():
                for p, p0 in zip(policy.model.parameters(), initial, strict=True):
                    p.copy_(p0)
    policy.version = version
    return results, refusals


def _expected_metrics(lp, engine) -> dict[str, float]:
    lags = [lag for row in _lags() for lag in row]
    log_w = torch.cat([x.detach() - e for x, e in zip(lp, engine, strict=True)])
    w = torch.clamp(torch.exp(log_w), max=CAP)
    t = len(lags)
    assert t == sum(RESPONSE_LENGTHS) == 24 and lags.count(1) == 10
    lag1 = [abs(d) for d, lag in zip(log_w.tolist(), lags, strict=True) if lag == 1]
    return {"decoupled/behav_weight_mean": float(w.sum()) / t,
            "decoupled/capped_frac": int((torch.exp(log_w) > CAP).sum()) / t,
            "token_lag/tokens_lag0": 14, "token_lag/tokens_lag1": 10, "token_lag/mean": 10 / 24,
            "token_lag/max": 1, "token_lag/spanning_share": 0.5,
            "mismatch/lag1/abs_diff_mean": sum(lag1) / len(lag1)}


def references(model, responses) -> tuple[list[torch.Tensor], list[tuple[float, dict]], dict[str, float]]:
    """Test side, before the trainer runs: (engine log-probs, per case (reported loss, HF gradients), metrics)."""
    with torch.no_grad():
        engine = _engine(_hf_logprobs(model, responses))
    refs = []
    for name in CASES:
        model.zero_grad(set_to_none=True)
        lp = _hf_logprobs(model, responses)
        expected = _expected_metrics(lp, engine)
        loss, value = _reference_loss(name, lp, engine)
        loss.backward()
        refs.append((value, _per_expert({n: p.grad.clone() for n, p in model.named_parameters()})))
    assert 0 < expected["decoupled/capped_frac"] < 1
    return engine, refs, expected


def failures(results, refusals, refs, expected) -> list[str]:
    """What the trainer got wrong against the references (empty: nothing)."""
    out = []
    kind, message, version = refusals["oapl"]
    if not (kind == "ValueError" and "refuses groups" in message and version == TRAINER_VERSION):
        out.append(f"oapl on mixed-version groups: {refusals['oapl']}")
    kind, message, version = refusals["grpo"]
    if not (kind == "RuntimeError" and "staleness bound" in message and version == TRAINER_VERSION):
        out.append(f"a token past the bound: {refusals['grpo']}")
    for i, name in enumerate(CASES):
        ref_loss, ref_grads = refs[i]
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for micro in MICRO_BATCH_SIZES:
            case = f"{name} decoupled micro={micro}"
            metrics, worst = results[(i, micro)]
            for key, want in expected.items():
                got = metrics[key]
                if not (math.isfinite(got) and math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7)):
                    out.append(f"{case}: {key} {got} vs {want}")
            if not metrics["mismatch/lag0/abs_diff_mean"] < 1e-5:  # same weights: numerics only
                out.append(f"{case}: mismatch/lag0/abs_diff_mean {metrics['mismatch/lag0/abs_diff_mean']}")
            if not math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5, abs_tol=1e-6):
                out.append(f"{case}: loss {metrics['loss']} vs reference {ref_loss}")
            if worst > GRAD_TOL * scale:
                out.append(f"{case}: max gradient error {worst:.3g} > {GRAD_TOL} * {scale:.3g}")
    return out
