"""megatron-core, loaded from a tiny HF checkpoint under TP / EP, against `transformers` itself:
log-probs and entropy of the same tokens, parameter gradients of the same loss, and the HF blocks
each rank exports for the weight sync (their union must rebuild every HF tensor bit-exactly).
Layouts: world 2 (dense TP=2 / PP=2, MoE EP=2, MoE expert TP=2 at TP=1, Qwen2 with q/k/v biases at TP=2, tied
embeddings at PP=2) and world 4 (dense TP=2 x PP=2, MoE EP=2 x PP=2: expert data parallel 1, dense data parallel
2, also with megatron's distributed optimizer; tied TP=2 x PP=2), and the MoE at DP 2 without EP (expert data parallel
2) with the distributed optimizer, through megatron's DDP and optimizer as the
trainer runs them.
Tied embeddings: transformers has ONE parameter `model.embed_tokens.weight` whose gradient is the embedding's plus
the output layer's; megatron's two copies (first and last stage) must each hold that gradient and that step.

Tolerance: both sides run fp32 on CPU, but with different kernels and reduction orders (fused QKV
vs separate projections, TP partial sums, the vocab-parallel softmax); differences are ~1e-6, so
values are compared at atol 1e-4 and gradients at atol 1e-5 / rtol 1e-3.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
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


def _optimizer(grad_clip: float) -> OptimizerConfig:
    # Adam's first step moves every element by lr * g / (|g| + eps): the ~1.2e-7 gradient differences between the
    # two implementations move an element with a near-zero gradient by up to lr * 1.2e-7 / eps. eps = 1e-5 bounds
    # that by 1.2e-5, below the 2e-5 tolerance of the update check (2% of lr). weight_decay = 1 makes decoupled
    # decay visible at that tolerance: lr * 1 * |w| = 1e-3 on norms (must NOT decay) and up to 2.5e-4 on matrices.
    return OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=1.0, grad_clip=grad_clip)


def _hf_reference(hf_dir: Path, clip_fraction: float):
    """transformers on the whole batch: log-probs, entropy, the gradient norm, the clipped gradients and the
    parameters after one AdamW step (decay on matrices only, as the policy does); HF checkpoint names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens, targets, mask, weights = _batch(model.config.vocab_size)
    logsm = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    lp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    _loss(lp, ent, mask, weights).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    clip = clip_fraction * norm
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    grads = _per_expert({n: p.grad.clone() for n, p in model.named_parameters()})
    cfg = _optimizer(clip)
    params = list(model.parameters())
    torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                       {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                      lr=cfg.lr, betas=cfg.betas, eps=cfg.eps).step()
    stepped = _per_expert({n: p.detach().clone() for n, p in model.named_parameters()})
    initial = load_file(hf_dir / "model.safetensors")  # the checkpoint itself is the reference for exports
    assert initial.keys() == grads.keys() == stepped.keys()
    return lp.detach(), ent.detach(), norm, clip, grads, initial, stepped


def _megatron_rank(rank, world, hf_dir, layout, clip, port, options=None):
    from megarl.models.hf_layout import layout_for
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(layout, rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        # MegatronPolicy's DDP / optimizer settings; a GPU without TE builds the local spec, asked for explicitly
        options = {"layer_spec": bench_layer_spec(torch.cuda.is_available(), (options or {}).get("precision", "fp32")),
                   **(options or {})}
        policy = MegatronPolicy(hf_dir, hf, _optimizer(clip), **options)
        tokens, targets, mask, weights = _batch(hf["vocab_size"])
        lp, ent = policy.compute_logprobs(tokens, targets, micro=3)  # 2 uneven microbatches
        exported = [(block, t.clone()) for block, t in policy.iter_local_hf_slices()]
        dp_rank, dp = dp_rank_and_size()
        share = {"tokens": tokens, "targets": targets, "mask": mask, "weights": weights}
        share = {k: v[dp_rank * B // dp:(dp_rank + 1) * B // dp] for k, v in share.items()}
        half = B // dp // 2  # two microbatches per data-parallel rank: gradients must be summed over both
        mbs = [{k: v[:half] for k, v in share.items()}, {k: v[half:] for k, v in share.items()}]

        def loss_fn(lp_, ent_, m):  # this microbatch's contribution to the global loss
            return ((lp_ * m["weights"] + 0.1 * ent_) * m["mask"]).sum() / mask.sum(), {"tokens": m["mask"].sum()}

        metrics = policy.train_step(mbs, loss_fn)
        if options.get("distributed_optimizer"):
            _gather_reduced_gradients(policy)
        layout_map = layout_for(policy.model, hf)
        grads = [(block, p.main_grad[idx].clone()) for n, p in policy.model.named_parameters()
                 for idx, block in layout_map.blocks(n, tuple(p.shape))]
        stepped = [(block, t.clone()) for block, t in policy.iter_local_hf_slices()]
        # every copy a rank holds (a tied embedding's last-stage copy too), read through the import layout
        copies = [(block, p.detach()[idx].clone()) for n, p in policy.model.named_parameters()
                  for idx, block in layout_map.blocks(n, tuple(p.shape))]
        return lp, ent, exported, grads, stepped, metrics, policy.version, copies
    finally:
        destroy_trainer_groups()


def _gather_reduced_gradients(policy) -> None:
    """With megatron's distributed optimizer each data-parallel rank's gradient buffer holds the reduced (and
    clipped) gradient only in its own shard of each bucket (reduce-scatter): all-gather the shards, so that every
    `param.main_grad` holds the whole gradient, as without the distributed optimizer."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    ddp = policy.ddp_model
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        group = buffer.data_parallel_group
        for bucket in buffer.buckets:
            shard = shard_buffer(bucket.grad_data, group.size())[group.rank()].clone()
            dist.all_gather_into_tensor(bucket.grad_data, shard, group=group)


def _with_vocab(src: Path, out: Path, vocab: int) -> Path:
    """A copy of checkpoint `src` keeping only the first `vocab` tokens (a vocabulary TP does not divide)."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    tensors = load_file(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:  # a tied checkpoint has no lm_head
            tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    made = {kind: make_tiny_checkpoint(root / kind, kind=kind) for kind in ("dense", "moe", "qwen2", "dense-tied")}
    made["dense-vocab31"] = _with_vocab(made["dense"], root / "dense-vocab31", 31)
    return made


def _assert_blocks_match(per_rank_blocks, reference: dict[str, torch.Tensor], exact: bool, **tol) -> None:
    """Every rank's `(HFSlice, tensor)` blocks equal the reference, and together they cover every tensor."""
    covered = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in reference.items()}
    for blocks in per_rank_blocks:
        for block, data in blocks:
            index = tuple(slice(a, b) for a, b in block.box)
            if exact:
                assert torch.equal(data, reference[block.name][index]), block
            else:
                torch.testing.assert_close(data, reference[block.name][index], msg=block.name, **tol)
            covered[block.name][index] = True
    assert all(c.all() for c in covered.values()), [n for n, c in covered.items() if not c.all()]


def _tied_vllm_rank_elements(hf: dict, tp: int) -> list[int]:
    """Elements each vLLM TP rank of the tied tiny Qwen3 loads, written out from the architecture (not from the
    planner): no lm_head, the embedding rows vLLM gives the rank (vocabulary padded to 64 rows, then split)."""
    h, d, heads, kv, inter = (hf["hidden_size"], hf["head_dim"], hf["num_attention_heads"],
                              hf["num_key_value_heads"], hf["intermediate_size"])
    layer = 2 * h + (heads + 2 * kv) * d // tp * h + h * heads * d // tp + 2 * d + 3 * inter // tp * h
    rows = [max(0, min(hf["vocab_size"], (r + 1) * 64 // tp) - r * 64 // tp) for r in range(tp)]
    return [hf["num_hidden_layers"] * layer + h + n * h for n in rows]


def _assert_tied_sync_plan(per_rank_blocks, hf: dict, first_stage: set[int]) -> None:
    """The weight sync from a tied PP>1 layout: each vLLM rank gets exactly its elements, the embedding only
    from first-stage ranks (the last stage's copy is not offered), no lm_head anywhere."""
    from megarl.sync.plan import plan_transfers, vllm_rank_slices

    holdings = {r: [block for block, _ in blocks] for r, blocks in enumerate(per_rank_blocks)}
    for tp in (1, 2):
        needs = {k: vllm_rank_slices(hf, tp, k) for k in range(tp)}
        assert not any(b.name == "lm_head.weight" for blocks in needs.values() for b in blocks)
        plan = plan_transfers(holdings, needs)
        received = [sum(t.block.numel for t in plan if t.receiver == k) for k in range(tp)]
        assert received == _tied_vllm_rank_elements(hf, tp)
        assert {t.sender for t in plan if t.block.name == "model.embed_tokens.weight"} <= first_stage


@pytest.mark.parametrize(("kind", "layout", "world", "options"), [
    ("dense", TrainerLayout(tp=2), 2, {}),
    ("dense-vocab31", TrainerLayout(tp=2), 2, {}),  # padded to 32: TP rank 1's shard ends in a padding row
    ("dense", TrainerLayout(pp=2), 2, {}),
    ("moe", TrainerLayout(ep=2), 2, {}),
    # expert tensor parallel 2 with attention unsplit (tp 1): each expert's columns over both ranks, which are also
    # 2 data-parallel replicas of the dense part (expert-DP 1): gradients summed over different groups
    ("moe", TrainerLayout(expert_tp=2), 2, {}),
    ("qwen2", TrainerLayout(tp=2), 2, {}),  # Qwen2 / Qwen2.5: q/k/v biases split with their query groups, no q/k norms
    ("dense", TrainerLayout(tp=2, pp=2), 4, {}),
    ("moe", TrainerLayout(ep=2, pp=2), 4, {}),
    # megatron's distributed optimizer: dense gradients reduce-scattered over DP 2, experts (expert DP 1) not split;
    # and DDP reducing once after backward instead of per bucket during it
    ("moe", TrainerLayout(ep=2, pp=2), 4, {"distributed_optimizer": True}),
    # expert data parallel 2 (no EP: every rank holds every expert): the experts' gradients reduce-scattered and their
    # Adam state sharded over the expert-data-parallel group, as the 30B recipe's expert DP 2 (TP 1 x EP 8 x PP 2)
    ("moe", TrainerLayout(), 2, {"distributed_optimizer": True}),
    ("dense", TrainerLayout(pp=2), 2, {"overlap_grad_reduce": False}),
    # tied embeddings: embedding on the first stage, its copy as the output layer on the last stage
    ("dense-tied", TrainerLayout(pp=2), 2, {}),
    ("dense-tied", TrainerLayout(tp=2, pp=2), 4, {}),
], ids=["dense-tp2", "dense-vocab31-tp2", "dense-pp2", "moe-ep2", "moe-etp2", "qwen2-tp2", "dense-tp2-pp2",
        "moe-ep2-pp2", "moe-ep2-pp2-distopt", "moe-edp2-distopt", "dense-pp2-no-overlap", "tied-pp2", "tied-tp2-pp2"])
def test_megatron_matches_transformers(checkpoints, kind, layout, world, options):
    hf_dir = checkpoints[kind]
    ref_lp, ref_ent, ref_norm, clip, ref_grads, initial, stepped = _hf_reference(hf_dir, clip_fraction=0.5)
    outs = run_distributed(_megatron_rank, world, hf_dir, layout, clip, free_port(), options, init_dist=False)
    for lp, ent, *_ in outs:  # every rank (every pipeline stage too) returns the full log-probs
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    # exported blocks: together they cover every HF tensor, and each equals the checkpoint bit-exactly
    _assert_blocks_match([o[2] for o in outs], initial, exact=True)
    if kind == "dense-tied":
        _assert_tied_export(outs, initial, hf_dir, world)
        _assert_tied_copies_equal(outs)
    _assert_step_matches(outs, ref_norm, ref_grads, stepped)


def test_tied_embeddings_with_the_distributed_optimizer(checkpoints):
    """Tied PP=2 x DP=2 with megatron's distributed optimizer: each stage's copy is stepped in shards by the DP
    ranks and all-gathered; every copy on the 4 ranks lands on transformers' step, the copies bit-identical."""
    hf_dir = checkpoints["dense-tied"]
    _, _, ref_norm, clip, ref_grads, _, stepped = _hf_reference(hf_dir, clip_fraction=0.5)
    outs = run_distributed(_megatron_rank, 4, hf_dir, TrainerLayout(pp=2), clip, free_port(),
                           {"distributed_optimizer": True}, init_dist=False)
    _assert_tied_copies_equal(outs)
    _assert_step_matches(outs, ref_norm, ref_grads, stepped)


def _assert_tied_copies_equal(outs) -> None:
    """After the step, every rank's copy of each block of the tied weight (first-stage embedding, last-stage output
    layer, data-parallel replicas) is bit-identical."""
    copies: dict[tuple, list[torch.Tensor]] = {}
    for o in outs:
        for block, data in o[7]:
            if block.name == "model.embed_tokens.weight":
                copies.setdefault(block.box, []).append(data)
    assert copies and all(len(c) >= 2 for c in copies.values())  # held on both stages
    for box, tensors in copies.items():
        assert all(torch.equal(t, tensors[0]) for t in tensors), box


def _assert_tied_export(outs, initial: dict[str, torch.Tensor], hf_dir: Path, world: int) -> None:
    """The weight sync / export of a tied PP=2 layout offers the tied weight once, from the embedding's stage."""
    from megarl.models.qwen_provider import read_hf_config

    names = [block.name for o in outs for block, _ in o[2]]
    assert "lm_head.weight" not in names
    embed = [block for o in outs for block, _ in o[2] if block.name == "model.embed_tokens.weight"]
    assert sum(block.numel for block in embed) == initial["model.embed_tokens.weight"].numel()
    # the last stage's output layer is a second copy (read through the import layout), loaded from the embedding
    assert any(block.name == "model.embed_tokens.weight" for block, _ in outs[-1][7])
    _assert_tied_sync_plan([o[2] for o in outs], read_hf_config(hf_dir), first_stage=set(range(world // 2)))


def _assert_step_matches(outs, ref_norm: float, ref_grads, stepped) -> None:
    """The same loss, microbatched and data-parallel: gradients summed over both, clipped by the global norm."""
    for *_, metrics, version, _ in outs:
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        assert metrics["tokens"] == float(_batch(32)[2].sum())  # summed over microbatches and DP ranks
        assert version == 1
    _assert_blocks_match([o[3] for o in outs], ref_grads, exact=False, atol=1e-5, rtol=1e-3)
    # one AdamW step (weight decay on matrices) lands on transformers' parameters after the same step
    _assert_blocks_match([o[4] for o in outs], stepped, exact=False, atol=2e-5, rtol=0)
    # every copy on every rank (the tied output layer too) is the stepped parameter
    _assert_blocks_match([o[7] for o in outs], stepped, exact=False, atol=2e-5, rtol=0)
