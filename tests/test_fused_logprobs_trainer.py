"""Through the REAL trainer (`MegatronPolicy`, megatron's schedules): the output layer fused with the log-prob
(`fused_logprobs`, the default) gives the same per-token log-probs and entropies (`compute_logprobs` and the
values the loss sees in `train_step`), the same loss and the same gradient of every parameter, the output
layer's (or the tied embedding's) included, as the unfused output layer + `vocab_parallel_logprobs_entropy`.
Layouts: TP 1, TP 2 (a vocabulary of 31 padded to 32: rank 1's shard ends in a padding row), PP 2, the tied
tiny model at PP 1 (the output weight IS the embedding; TP 1 and 2) and PP 2 (the last stage's copy). Chunks of 5 tokens
(microbatches of 2 x 7 tokens: 3 chunks, the last partial); in three layouts also vocabulary blocks of 5 or 7 rows
(`trainer.logprob_vocab_block`). Sequence parallelism (MoE at TP > 1) cannot be built
on CPU (megatron's torch norms refuse it without Transformer Engine / Apex): its gather / reduce-scatter is tested
at the function level (tests/test_fused_output_logprobs.py).

Tolerance, fp32: values and gradients to 1e-6 (atol and rtol); the two paths differ only in summation order
(the output weight's gradient summed over [b, s] chunks vs megatron's [s, b] rows). A forward hook on the output
layer checks which path ran: it returns the hidden states (fused) or the logits (unfused).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed
from tests.test_megatron_vs_hf import B, _batch  # the same batch as the megatron-vs-transformers tests

CHUNK = 5
# (name, world size, layout, checkpoint kind)
LAYOUTS = [
    ("tp1", 1, TrainerLayout(), "dense"),
    ("tp2-vocab31", 2, TrainerLayout(tp=2), "dense-vocab31"),
    ("pp2", 2, TrainerLayout(pp=2), "dense"),
    ("tied-tp1", 1, TrainerLayout(), "dense-tied"),
    ("tied-pp2", 2, TrainerLayout(pp=2), "dense-tied"),
    ("tied-tp2", 2, TrainerLayout(tp=2), "dense-tied"),
]
# the fused path tiled over vocabulary blocks too (`trainer.logprob_vocab_block`): 5 and 7 rows divide no shard
VOCAB_BLOCKS = {"tp2-vocab31": 5, "pp2": 7, "tied-tp2": 5}
TOL = dict(atol=1e-6, rtol=1e-6)


def _run(policy, hf, fused: bool) -> dict:
    """compute_logprobs and one train_step with the given path; the weights are put back afterwards."""
    from megarl.parallel.groups import dp_rank_and_size

    if policy.is_last_stage:
        policy.fused_logprobs = fused
    widths = []
    hook = (policy.model.output_layer.register_forward_hook(lambda _m, _i, out: widths.append(out[0].shape[-1]))
            if policy.is_last_stage else None)
    tokens, targets, mask, weights = _batch(hf["vocab_size"])
    lp, ent = policy.compute_logprobs(tokens, targets, micro=3)  # 2 uneven microbatches
    dp_rank, dp = dp_rank_and_size()
    share = {"tokens": tokens, "targets": targets, "mask": mask, "weights": weights}
    share = {k: v[dp_rank * B // dp:(dp_rank + 1) * B // dp] for k, v in share.items()}
    half = B // dp // 2
    mbs = [{k: v[:half] for k, v in share.items()}, {k: v[half:] for k, v in share.items()}]
    seen = []

    def loss_fn(lp_, ent_, m):  # log-probs and entropy both carry gradient
        seen.append((lp_.detach().clone(), ent_.detach().clone()))
        return ((lp_ * m["weights"] + 0.1 * ent_) * m["mask"]).sum() / mask.sum(), {"tokens": m["mask"].sum()}

    initial = [p.detach().clone() for p in policy.model.parameters()]
    metrics = policy.train_step(mbs, loss_fn)
    grads = {n: p.main_grad.clone() for n, p in policy.model.named_parameters()}  # megatron DDP's summed gradients
    with torch.no_grad():
        for p, p0 in zip(policy.model.parameters(), initial, strict=True):
            p.copy_(p0)
    if hook is not None:
        hook.remove()
    return {"lp": lp, "ent": ent, "seen": seen, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "grads": grads, "widths": set(widths)}


def _rank(rank, world, layouts, ports, hf_dirs):
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    results = {}
    for (label, size, layout, kind), port in zip(layouts, ports, strict=True):
        if rank >= size:
            continue
        init_trainer_groups(layout, rank, size, "127.0.0.1", port)
        try:
            hf = read_hf_config(hf_dirs[kind])
            policy = MegatronPolicy(hf_dirs[kind], hf, OptimizerConfig(lr=1e-3, grad_clip=1e9), logprob_chunk=CHUNK,
                                    logprob_vocab_block=VOCAB_BLOCKS.get(label))
            default_fused = policy.fused_logprobs  # the default: fused wherever there is an output layer
            out = {fused: _run(policy, hf, fused) for fused in (True, False)}
            hidden, vocab_shard = hf["hidden_size"], None
            if policy.is_last_stage:
                vocab_shard = policy.model.output_layer.output_size_per_partition
            results[label] = (policy.is_last_stage, default_fused, hidden, vocab_shard, out)
        finally:
            destroy_trainer_groups()
    return results


def _with_vocab(src: Path, out: Path, vocab: int) -> Path:
    """A copy of checkpoint `src` keeping only the first `vocab` tokens (a vocabulary TP does not divide)."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    tensors = load_file(src / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:vocab].clone()
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:vocab].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    made = {kind: make_tiny_checkpoint(root / kind, kind=kind) for kind in ("dense", "dense-tied")}
    made["dense-vocab31"] = _with_vocab(made["dense"], root / "dense-vocab31", 31)
    return made


def test_fused_equals_unfused_through_the_trainer(checkpoints):
    per_rank = run_distributed(_rank, 2, LAYOUTS, [free_port() for _ in LAYOUTS], checkpoints, init_dist=False)
    for label, size, *_ in LAYOUTS:
        for rank, results in enumerate(per_rank[:size]):
            last, default_fused, hidden, vocab_shard, out = results[label]
            fused, unfused = out[True], out[False]
            where = f"{label} rank {rank}"
            assert default_fused == last, where
            if last:  # the path that ran: the output layer returned hidden states, or logits
                assert fused["widths"] == {hidden} and unfused["widths"] == {vocab_shard}, where
            torch.testing.assert_close(fused["lp"], unfused["lp"], **TOL, msg=where)
            torch.testing.assert_close(fused["ent"], unfused["ent"], **TOL, msg=where)
            assert len(fused["seen"]) == len(unfused["seen"]) == (2 if last else 0), where
            for (lp, ent), (lp_u, ent_u) in zip(fused["seen"], unfused["seen"], strict=True):
                torch.testing.assert_close(lp, lp_u, **TOL, msg=where)
                torch.testing.assert_close(ent, ent_u, **TOL, msg=where)
            assert fused["loss"] == pytest.approx(unfused["loss"], rel=1e-6, abs=1e-6), where
            assert fused["grad_norm"] == pytest.approx(unfused["grad_norm"], rel=1e-6), where
            assert fused["grads"].keys() == unfused["grads"].keys()
            for name, g in fused["grads"].items():
                torch.testing.assert_close(g, unfused["grads"][name], **TOL, msg=f"{where} {name}")
            output_weights = [n for n in fused["grads"]
                              if n.endswith(("output_layer.weight", "word_embeddings.weight"))]
            assert output_weights and all(fused["grads"][n].abs().max() > 0 for n in output_weights), where
