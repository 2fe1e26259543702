"""megatron-core, loaded from a tiny HF checkpoint under TP / EP, against `transformers` itself:
log-probs and entropy of the same tokens, parameter gradients of the same loss, and the HF blocks
each rank exports for the weight sync (their union must rebuild every HF tensor bit-exactly).

Tolerance: both sides run fp32 on CPU, but with different kernels and reduction orders (fused QKV
vs separate projections, TP partial sums, the vocab-parallel softmax); differences are ~1e-6, so
values are compared at atol 1e-4 and gradients at atol 1e-5 / rtol 1e-3.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from tests.dist_utils import free_port, run_distributed

B, S = 4, 7


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(B, S)
    mask[:, :2] = 0
    mask[1, 5:] = 0
    weights = torch.randn(B, S, generator=g)
    return tokens, targets, mask, weights


def _loss(logprobs, entropy, mask, weights):
    return ((logprobs * weights + 0.1 * entropy) * mask).sum() / mask.sum()


def _per_expert(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 fuses experts in memory (`experts.gate_up_proj [E, 2I, H]` = [gate; up] per expert,
    `experts.down_proj [E, H, I]`); the checkpoint format names them one by one."""
    out = {}
    for name, t in named.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _hf_reference(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens, targets, mask, weights = _batch(model.config.vocab_size)
    logsm = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    lp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    _loss(lp, ent, mask, weights).backward()
    grads = _per_expert({n: p.grad.clone() for n, p in model.named_parameters()})
    params = load_file(hf_dir / "model.safetensors")  # the checkpoint itself is the reference for exports
    assert params.keys() == grads.keys()
    return lp.detach(), ent.detach(), grads, params


def _megatron_rank(rank, world, hf_dir, tp, ep, port):
    from megarl.models.hf_layout import layout_for
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(tp, 1, ep), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig(lr=1e-3, grad_clip=1e9))
        tokens, targets, mask, weights = _batch(hf["vocab_size"])
        lp, ent = policy.compute_logprobs(tokens, targets)
        exported = [(block, t.clone()) for block, t in policy.iter_local_hf_slices()]
        dp_rank, dp = dp_rank_and_size()
        rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        mb = {"tokens": tokens[rows], "targets": targets[rows], "mask": mask[rows], "weights": weights[rows]}

        def loss_fn(lp_, ent_, m):  # this DP share's contribution to the global loss
            return ((lp_ * m["weights"] + 0.1 * ent_) * m["mask"]).sum() / mask.sum(), {}

        policy.train_step([mb], loss_fn)
        layout = layout_for(policy.model, hf)
        grads = [(block, p.grad[idx].clone()) for n, p in policy.model.named_parameters()
                 for idx, block in layout.blocks(n, tuple(p.shape))]
        return lp, ent, exported, grads
    finally:
        destroy_trainer_groups()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_tiny_checkpoint(root / kind, kind=kind) for kind in ("dense", "moe")}


@pytest.mark.parametrize(("kind", "tp", "ep"), [("dense", 2, 1), ("moe", 1, 2)])
def test_megatron_matches_transformers(checkpoints, kind, tp, ep):
    hf_dir = checkpoints[kind]
    ref_lp, ref_ent, ref_grads, ref_params = _hf_reference(hf_dir)
    outs = run_distributed(_megatron_rank, 2, hf_dir, tp, ep, free_port(), init_dist=False)
    for lp, ent, _, _ in outs:
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    # exported blocks: together they cover every HF tensor, and each equals the checkpoint bit-exactly
    covered = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in ref_params.items()}
    for _, _, exported, _ in outs:
        for block, data in exported:
            index = tuple(slice(a, b) for a, b in block.box)
            assert torch.equal(data, ref_params[block.name][index]), block
            covered[block.name][index] = True
    assert all(c.all() for c in covered.values()), [n for n, c in covered.items() if not c.all()]
    # gradients of the same loss, summed over data-parallel ranks, equal transformers' gradients
    for _, _, _, grads in outs:
        for block, g in grads:
            index = tuple(slice(a, b) for a, b in block.box)
            torch.testing.assert_close(g, ref_grads[block.name][index], atol=1e-5, rtol=1e-3, msg=block.name)
