"""`trainer.precision=bf16`: megatron-core's mixed precision, on the tiny dense Qwen3, 2 gloo ranks at DP=2 with
megatron's distributed optimizer (real megatron-core, no mocks), in one spawned pair:

- the model's parameters are bf16, its log-probs and entropy match `transformers` run in bf16 (tolerance below);
- over two optimizer steps, each rank's fp32 main-parameter shards move by exactly AdamW applied to the fp32 main
  gradients the optimizer was given (a hand-written AdamW, decoupled decay on matrices only, in the same
  operation order as torch's, so bit for bit), and every bf16 parameter is its fp32 main value rounded to bf16,
  identical on both ranks (the all-gather of the updated shards);
- the weight sync offers those bf16 parameters as they are, and a checkpoint round trip (`state_dict` into a fresh
  policy: bf16 model, fp32 main shards, Adam moments), and the same through a v4 checkpoint (megatron's
  `dist_checkpointing`), continues the run bit for bit.

Log-prob tolerance: both sides round the checkpoint's weights to bf16 alike (round to nearest even) and then
compute in bf16 with different kernels, fusions and accumulation orders (megatron's fused QKV and gate/up, its
fp32 softmax of the attention scores and fp32 RoPE tables; transformers' own), so every activation carries a
few different bf16 roundings (relative 2^-9 each). This model's logits are at most ~0.7 in magnitude (vocabulary
32, log-probs ~ -3.5), where one rounding is ~1.3e-3: measured, the log-probs differ by at most 2.4e-3 and by
8e-4 on average. Checked at 1e-2 per token (log-prob and entropy) and 3e-3 on the mean: a few roundings of the
largest logit. At this scale transformers' own fp32 and bf16 runs differ by a similar 3e-3, so the log-prob check
alone cannot tell bf16 from fp32: the parameters' dtype and the step's bit-level properties above are asserted.
"""

import io

import torch

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed

B, S = 4, 7
OPTIM = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def _batch(vocab: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S)
    mask[:, :2] = 0
    return {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1), "mask": mask,
            "weights": torch.randn(B, S, generator=g)}


def _train(policy, step: int, dp_rank: int, dp: int) -> dict[str, float]:
    """One optimizer step on step `step`'s global batch: this rank's DP share, one sequence per microbatch."""
    batch = _batch(policy.hf["vocab_size"], step)
    share = {k: v[dp_rank * B // dp:(dp_rank + 1) * B // dp] for k, v in batch.items()}
    mbs = [{k: v[i:i + 1] for k, v in share.items()} for i in range(B // dp)]
    total = batch["mask"].sum()

    def loss_fn(lp, ent, m):  # the microbatch's contribution to the global loss
        return ((lp * m["weights"] + 0.1 * ent) * m["mask"]).sum() / total, {}

    return policy.train_step(mbs, loss_fn)


def _round_trip(state):
    """What a checkpoint file gives back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _main_shards(policy) -> list[tuple[torch.nn.Parameter, torch.Tensor, slice]]:
    """`(bf16 model parameter, its fp32 main shard, the shard's range in the flattened parameter)` for every shard
    this rank's distributed optimizer steps."""
    out = []
    for sub in policy.optimizer.chained_optimizers:
        for model_group, main_group in zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups, strict=True):
            for model_param, main in zip(model_group, main_group, strict=True):
                r = sub._get_model_param_range_map(model_param)["param"]
                out.append((model_param, main, slice(r.start, r.end)))
    return out


def _bf16_rank(rank, world, hf_dir, port, root):
    from megarl.checkpoint import open_checkpoint, save_checkpoint
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        spec = bench_layer_spec(torch.cuda.is_available(), "bf16")  # a GPU without TE: local, asked for explicitly
        policy = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec=spec)
        out = {"dtypes": sorted({str(p.dtype) for p in policy.model.parameters()})}
        probe = _batch(hf["vocab_size"], 0)
        out["logprobs"] = policy.compute_logprobs(probe["tokens"], probe["targets"], micro=3)
        dp_rank, dp = dp_rank_and_size()
        steps = []
        for step in range(2):
            before = [main.detach().clone() for _, main, _ in _main_shards(policy)]
            metrics = _train(policy, step, dp_rank, dp)
            shards = _main_shards(policy)
            steps.append({"skipped": metrics["train/skipped_step"],
                          "main_before": before,
                          "main_grad": [main.grad.detach().clone() for _, main, _ in shards],
                          "main_after": [main.detach().clone() for _, main, _ in shards],
                          "decay": [OPTIM.weight_decay if p.ndim >= 2 else 0.0 for p, _, _ in shards],
                          "rounded": [torch.equal(p.detach().view(-1)[r], main.to(torch.bfloat16))
                                      for p, main, r in shards]})
        out["steps"] = steps
        out["params"] = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        # what a push sends: the bf16 parameters themselves (views, no cast)
        out["push_dtypes"] = sorted({str(t.dtype) for _, t in policy.iter_local_hf_slices()})
        # a checkpoint round trip restores the fp32 main parameters exactly: the next step is the same bits
        saved = _round_trip(policy.state_dict())
        path = save_checkpoint(root, 1, rank, world, {"version": policy.version}, {}, {"world_size": world},
                               keep_last=1, sharded_state=policy.sharded_state_dict())  # the same as a v4 checkpoint
        _train(policy, 2, dp_rank, dp)
        resumed = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec=spec)
        resumed.load_state_dict(saved)
        _train(resumed, 2, dp_rank, dp)
        from_ckpt = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec=spec)
        ckpt = open_checkpoint(path, {})
        from_ckpt.load_sharded_state_dict(ckpt.load_sharded(from_ckpt.sharded_state_dict(is_loading=True)), 2)
        _train(from_ckpt, 2, dp_rank, dp)
        out["resume_ckpt_equal"] = all(torch.equal(a, b) for a, b in zip(policy.model.parameters(),
                                                                          from_ckpt.model.parameters(), strict=True))
        out["resume_equal"] = all(torch.equal(a, b) for a, b in zip(policy.model.parameters(),
                                                                     resumed.model.parameters(), strict=True))
        return out
    finally:
        destroy_trainer_groups()


def _adamw(p, g, m, v, t: int, lr: float, betas: tuple[float, float], eps: float, wd: float):
    """AdamW (Loshchilov & Hutter), decoupled decay, bias-corrected moments, in torch's single-tensor operation
    order: returns the new `(p, m, v)`."""
    b1, b2 = betas
    p = p.mul(1 - lr * wd)
    m = m.lerp(g, 1 - b1)
    v = v.mul(b2).addcmul(g, g, value=1 - b2)
    step_size = lr / (1 - b1**t)
    denom = (v.sqrt() / (1 - b2**t) ** 0.5).add(eps)
    return p.addcdiv(m, denom, value=-step_size), m, v


def _hf_logprobs(hf_dir, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    probe = _batch(model.config.vocab_size, 0)
    with torch.no_grad():
        logsm = torch.log_softmax(model(probe["tokens"]).logits.float(), dim=-1)
    return logsm.gather(-1, probe["targets"][..., None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


def test_bf16_trains_as_megatron_mixed_precision(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "dense", kind="dense")
    ranks = run_distributed(_bf16_rank, 2, hf_dir, free_port(), tmp_path / "checkpoints", init_dist=False)
    check_bf16_run(ranks, hf_dir)


def check_bf16_run(ranks: list[dict], hf_dir, adam_tol: tuple[float, float] | None = None) -> None:
    """The properties of the module's docstring for what `_bf16_rank` returned from each rank. `adam_tol`:
    `(atol, rtol)` for the AdamW check where the optimizer's kernels are not the reference's (torch's multi-tensor
    AdamW on CUDA against the reference's single ops: fused multiply-adds may differ in the last bit); None: bit
    for bit (CPU, where both run torch's single-tensor AdamW)."""
    ref_lp, ref_ent = _hf_logprobs(hf_dir, torch.bfloat16)
    fp32_lp, _ = _hf_logprobs(hf_dir, torch.float32)
    for r in ranks:
        assert r["dtypes"] == ["torch.bfloat16"]
        lp, ent = (t.cpu() for t in r["logprobs"])
        print(f"bf16 log-probs vs transformers bf16: max {float((lp - ref_lp).abs().max()):.4f}, mean "
              f"{float((lp - ref_lp).abs().mean()):.4f}; transformers fp32 vs bf16: max "
              f"{float((fp32_lp - ref_lp).abs().max()):.4f}")
        torch.testing.assert_close(lp, ref_lp, atol=1e-2, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-2, rtol=0)
        assert float((lp - ref_lp).abs().mean()) <= 3e-3

    for r in ranks:
        m = [torch.zeros_like(x) for x in r["steps"][0]["main_before"]]
        v = [torch.zeros_like(x) for x in r["steps"][0]["main_before"]]
        equal = total = 0
        for t, step in enumerate(r["steps"], start=1):
            assert step["skipped"] == 0
            assert len(step["main_grad"]) > 0 and all(g.dtype == torch.float32 for g in step["main_grad"])
            for i, (p0, g, p1, wd) in enumerate(zip(step["main_before"], step["main_grad"], step["main_after"],
                                                    step["decay"], strict=True)):
                want, m[i], v[i] = _adamw(p0, g, m[i], v[i], t, OPTIM.lr, OPTIM.betas, OPTIM.eps, wd)
                equal, total = equal + int((p1 == want).sum()), total + p1.numel()
                if adam_tol is None:
                    assert torch.equal(p1, want), (t, i, float((p1 - want).abs().max()))
                else:
                    torch.testing.assert_close(p1, want, atol=adam_tol[0], rtol=adam_tol[1], msg=f"step {t}, {i}")
            assert all(step["rounded"])  # every bf16 parameter is its main value rounded
        print(f"AdamW: {equal:,} of {total:,} main-parameter values bit-equal to the reference's")
    assert any(wd == 0.0 for wd in ranks[0]["steps"][0]["decay"]) and any(
        wd > 0 for wd in ranks[0]["steps"][0]["decay"])  # both groups stepped: norms undecayed, matrices decayed
    # the shards were all-gathered: every data-parallel replica holds the same bf16 model
    for other in ranks[1:]:
        for name, p in ranks[0]["params"].items():
            assert torch.equal(p, other["params"][name]), name
    for r in ranks:
        assert r["push_dtypes"] == ["torch.bfloat16"]
        assert r["resume_equal"], "a bf16 checkpoint round trip did not continue the run bit for bit"
        assert r["resume_ckpt_equal"], "a bf16 v4 checkpoint did not continue the run bit for bit"
