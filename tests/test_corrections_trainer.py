"""A train-inference correction through the REAL trainer (`train_on_batch` -> `MegatronPolicy.train_step`, one gloo
rank, tiny dense Qwen3): the batch of tests/test_trainer_invariance.py (engine log-probs = the reference log-probs
shifted by fixed offsets, token ratios 1.82 / 0.90 / 1.11 / 0.55), split into 1 x 8 and 4 x 2 microbatches.

The reference is independent: `transformers` log-probs of each sequence alone and each loss written out here with
its correction weight from the definition. Checked: the loss, every parameter gradient (tolerances of the invariance
test: loss rtol 1e-5, gradients 1e-5 of the largest), and the `correction/*` metrics against hand counts (finite,
present, no ratio within 1e-2 in log space of a cap or band edge, so 1e-6 numerics cannot flip a weight).
The same trainer process then runs the decoupled objective's cases (tests/decoupled_trainer_cases.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.config.schema import AlgorithmConfig, Config, CorrectionConfig, ModelConfig, OptimizerConfig, TrainerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests import decoupled_trainer_cases
from tests.dist_utils import free_port, run_distributed
from tests.test_megatron_vs_hf import _per_expert
from tests.test_trainer_invariance import (
    EPS,
    PAD,
    REWARDS,
    _batch,
    _engine_logprobs,
    _grad_errors,
    _hf_logprobs,
    _responses,
)

# (algorithm, correction): a token-level loss with token TIS, REINFORCE with sequence MIS, GSPO with IcePop
CASES = [
    ("grpo", CorrectionConfig(kind="tis_token", cap=1.5)),
    ("reinforce", CorrectionConfig(kind="mis_seq", lower=0.6, upper=1.5)),
    ("rec_gspo_is", CorrectionConfig(kind="icepop", lower=0.6, upper=1.5)),
]
MICRO_BATCH_SIZES = (8, 2)
GRAD_TOL = 1e-5


def _algo_cfg(name: str, correction: CorrectionConfig) -> AlgorithmConfig:
    return AlgorithmConfig(name=name, eps_low=EPS, eps_high=EPS, correction=correction)


def _weights(lp: list[torch.Tensor], engine: list[torch.Tensor], corr: CorrectionConfig) -> list[torch.Tensor]:
    """w_i^t from the definitions (rho = exp(logp_trainer - logp_engine), no gradient)."""
    out = []
    for x, e in zip(lp, engine, strict=True):
        rho = torch.exp(x.detach() - e)
        prod = float(torch.exp((x.detach() - e).sum()))
        if corr.kind == "tis_token":
            out.append(torch.clamp(rho, max=corr.cap))
        elif corr.kind == "mis_seq":
            out.append(torch.full_like(rho, float(corr.lower <= prod <= corr.upper)))
        else:
            assert corr.kind == "icepop"
            out.append(torch.where((rho >= corr.lower) & (rho <= corr.upper), rho, torch.zeros_like(rho)))
    return out


def _reference_loss(name, lp, engine, corr) -> tuple[torch.Tensor, float]:
    """Whole batch at once, old_logprobs = the engine's (the default), token-mean for the token-level losses:
    (a loss whose gradient is the corrected one, the loss value the trainer reports)."""
    r, cfg = REWARDS, _algo_cfg(name, corr)
    w = _weights(lp, engine, corr)
    n, tokens = len(lp), sum(len(x) for x in lp)
    mean, std = r.mean(-1, keepdim=True), r.std(-1, unbiased=False, keepdim=True)
    adv = ((r - mean) / (std + cfg.adv_eps) if name == "grpo" else r - mean).reshape(-1)
    if name == "rec_gspo_is":  # GSPO-token form: gradient -(1/N) A s M w_t / |y| (value sg(s) mean_t w_t)
        total, value = 0.0, 0.0  # the reported value stays GSPO's objective: -(1/N) sum min(s A, clip(s) A)
        for x, e, a, wi in zip(lp, engine, adv, w, strict=True):
            s = torch.exp((x - e).mean())
            m = float((a > 0 and s <= 1 + EPS) or (a < 0 and s >= 1 - EPS))
            total = total - a * m * s.detach() * (wi * torch.exp(x - x.detach())).mean()
            value -= float(torch.minimum(s.detach() * a, torch.clamp(s.detach(), 1 - EPS, 1 + EPS) * a)) / n
        return total / n, value
    total = 0.0
    for x, e, a, wi in zip(lp, engine, adv, w, strict=True):
        if name == "grpo":  # -w min(ratio A, clip(ratio) A)
            ratio = torch.exp(x - e)
            total = total - (wi * torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)).sum()
        else:  # REINFORCE: -A w logp
            total = total - (a * wi * x).sum()
    return total / tokens, float(total.detach()) / tokens


def _expected_metrics(lp, engine, corr) -> dict[str, float]:
    w = torch.cat(_weights(lp, engine, corr))
    rho = torch.cat([torch.exp(x.detach() - e) for x, e in zip(lp, engine, strict=True)])
    t = len(w)
    truncated = int((rho > corr.cap).sum()) if corr.kind == "tis_token" else 0
    return {"correction/weight_mean": float(w.sum()) / t, "correction/truncated_frac": truncated / t,
            "correction/masked_frac": int((w == 0).sum()) / t}


def _check_margins(lp, engine, corr) -> None:
    token = torch.cat([x.detach() - e for x, e in zip(lp, engine, strict=True)])
    seq = torch.stack([(x.detach() - e).sum() for x, e in zip(lp, engine, strict=True)])
    edges = torch.tensor([math.log(corr.cap), math.log(corr.lower), math.log(corr.upper)])
    for logratio in (token, seq):
        assert (logratio[:, None] - edges).abs().min() > 1e-2


def _rank(rank, world, port, hf_dir, responses, engine, references, decoupled_engine, decoupled_refs):
    import dataclasses

    from megarl.algorithms.registry import get_algorithm
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy
    from megarl.trainer.step import train_on_batch

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)
    results = {}
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig(lr=1e-3, grad_clip=1e9))
        initial = [p.detach().clone() for p in policy.model.parameters()]
        dp_rank, dp = dp_rank_and_size()
        for i, (name, corr) in enumerate(CASES):
            algorithm, algo_cfg = get_algorithm(name), _algo_cfg(name, corr)
            batch = dataclasses.replace(_batch(responses, engine), advantages=algorithm.advantages(REWARDS, algo_cfg))
            for micro in MICRO_BATCH_SIZES:
                cfg = Config(model=ModelConfig(hf_dir=hf_dir), algorithm=algo_cfg,
                             trainer=TrainerConfig(world_size=world, micro_batch_size=micro))
                metrics = train_on_batch(policy, batch, algorithm, cfg, PAD, dp_rank, dp, lag=0)
                rows = _grad_errors(policy, hf, references[i][1])
                results[(i, micro)] = (metrics, max(r[2] for r in rows))
                with torch.no_grad():
                    for p, p0 in zip(policy.model.parameters(), initial, strict=True):
                        p.copy_(p0)
        decoupled = decoupled_trainer_cases.run_in_rank(policy, hf, hf_dir, world, dp_rank, dp, responses,
                                                        decoupled_engine, decoupled_refs)
    finally:
        destroy_trainer_groups()
    return results, decoupled


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "dense", kind="dense")


@pytest.fixture(scope="module")
def trainer_run(dense_checkpoint):
    """One trainer process for the module's tests: the correction cases and the decoupled ones."""
    from transformers import AutoModelForCausalLM

    responses = _responses()
    model = AutoModelForCausalLM.from_pretrained(dense_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        engine = _engine_logprobs(_hf_logprobs(model, responses))
    references, expected = [], []
    for name, corr in CASES:
        model.zero_grad(set_to_none=True)
        lp = _hf_logprobs(model, responses)
        _check_margins(lp, engine, corr)
        expected.append(_expected_metrics(lp, engine, corr))
        loss, value = _reference_loss(name, lp, engine, corr)
        loss.backward()
        references.append((value, _per_expert({n: p.grad.clone() for n, p in model.named_parameters()})))
    assert all(0 < e["correction/truncated_frac"] + e["correction/masked_frac"] < 1 for e in expected)

    model.zero_grad(set_to_none=True)
    decoupled_engine, decoupled_refs, decoupled_expected = decoupled_trainer_cases.references(model, responses)
    ((results, decoupled),) = run_distributed(_rank, 1, free_port(), dense_checkpoint, responses, engine, references,
                                              decoupled_engine, decoupled_refs, init_dist=False)
    return results, references, expected, decoupled, decoupled_refs, decoupled_expected


def test_corrections_through_the_real_trainer(trainer_run):
    results, references, expected = trainer_run[:3]
    failures = []
    for i, (name, corr) in enumerate(CASES):
        ref_loss, ref_grads = references[i]
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for micro in MICRO_BATCH_SIZES:
            case = f"{name} + {corr.kind} micro={micro}"
            metrics, worst = results[(i, micro)]
            for key, want in expected[i].items():
                got = metrics[key]
                if not (math.isfinite(got) and math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7)):
                    failures.append(f"{case}: {key} {got} vs {want}")
            if not math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5, abs_tol=1e-6):
                failures.append(f"{case}: loss {metrics['loss']} vs reference {ref_loss}")
            if worst > GRAD_TOL * scale:
                failures.append(f"{case}: max gradient error {worst:.3g} > {GRAD_TOL} * {scale:.3g}")
    assert not failures, "\n".join(failures)


def test_decoupled_objective_through_the_real_trainer(trainer_run):
    (results, refusals), refs, expected = trainer_run[3:]
    failures = decoupled_trainer_cases.failures(results, refusals, refs, expected)
    assert not failures, "\n".join(failures)
