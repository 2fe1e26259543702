"""Training-side scale options of `MegatronPolicy`, in one world of 2 gloo processes running several cases:

- `distributed_optimizer` (megatron-core's distributed optimizer: gradients reduce-scattered, AdamW state sharded
  element-wise over data parallel, parameters all-gathered): the tiny dense Qwen3 at DP=2 and the tiny MoE at
  EP=2 (dense DP=2, expert DP=1) take the same optimizer steps as megatron's unsharded optimizer, within 1e-6 in
  fp32 (the same element-wise AdamW on the same summed gradients; only the global norm, which sets the clip
  coefficient, is summed over other partial sums); each rank holds about half the dense Adam moments, and the
  two ranks' moments add up to exactly the unsharded ones (every element once); a save/load round trip of
  `policy.state_dict()` into a fresh policy, then one more step, equals the uninterrupted run bit for bit.
- `recompute` full / selective / full over the first `recompute_layers` layers only: the same loss and gradients
  as without, and the recomputation happens: megatron's config carries the fields, and forward hooks count the
  transformer layers (full; block: the first layer, not the last) or the core attention (selective) running twice
  per microbatch.
"""

import io

import pytest
import torch

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed

B, S = 4, 7  # global batch; 2 sequences per data-parallel rank, as 2 microbatches of 1
# decay on matrices, an active clip, and a warmup: the learning rate set per step must reach the shard optimizers
OPTIM = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0, warmup_steps=2)


def _batch(vocab: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S)
    mask[:, :2] = 0
    return {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1), "mask": mask,
            "weights": torch.randn(B, S, generator=g)}


def _train(policy, step: int) -> dict[str, float]:
    """One optimizer step on step `step`'s global batch: this rank's DP share, in 2 microbatches."""
    from megarl.parallel.groups import dp_rank_and_size

    batch = _batch(policy.hf["vocab_size"], step)
    dp_rank, dp = dp_rank_and_size()
    share = {k: v[dp_rank * B // dp:(dp_rank + 1) * B // dp] for k, v in batch.items()}
    mbs = [{k: v[i:i + 1] for k, v in share.items()} for i in range(len(share["tokens"]))]
    total = batch["mask"].sum()

    def loss_fn(lp, ent, m):  # the microbatch's contribution to the global loss
        return ((lp * m["weights"] + 0.1 * ent) * m["mask"]).sum() / total, {}

    return policy.train_step(mbs, loss_fn)


def _params(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def _grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in policy.model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _round_trip(state):
    """What a checkpoint file gives back (the live state dict would keep changing with the next step)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _count_forwards(policy) -> dict[str, int]:
    """Forward calls of the first transformer layer, of its core attention and of the last layer, counted by hooks."""
    counts = {"layer": 0, "core_attn": 0, "last_layer": 0}
    layer = policy.model.decoder.layers[0]
    for name, module in (("layer", layer), ("core_attn", layer.self_attention.core_attention),
                         ("last_layer", policy.model.decoder.layers[-1])):
        module.register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _optimizer_cases(hf_dir, resume: bool, root=None) -> dict:
    """Plain AdamW vs the distributed optimizer over 2 steps (and with `resume` a third, after a round trip
    of the sharded state into a fresh policy)."""
    from megarl.models.qwen_provider import read_hf_config
    from megarl.trainer.policy import MegatronPolicy

    hf = read_hf_config(hf_dir)
    out: dict = {}
    plain = MegatronPolicy(hf_dir, hf, OPTIM)
    counts = _count_forwards(plain)
    out["none_loss"] = _train(plain, 0)["loss"]
    out["none_counts"], none_grads = dict(counts), _grads(plain)
    _train(plain, 1)
    plain_p2, out["bytes_plain"] = _params(plain), plain.optimizer_state_bytes()
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    if resume:
        _train(plain, 2)
        plain_p3 = _params(plain)

    zero = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True)
    _train(zero, 0)
    _train(zero, 1)
    out["diff_step2"], out["bytes_zero"] = _max_diff(_params(zero), plain_p2), zero.optimizer_state_bytes()
    if resume:
        _overlap_param_gather_case(hf_dir, hf, zero, out)
    if resume:
        saved = _round_trip(zero.state_dict())
        ckpt_path = _save(zero, root, 1, {"world_size": 2, "tp": 1})
        _train(zero, 2)
        zero_p3 = _params(zero)
        out["diff_step3"] = _max_diff(zero_p3, plain_p3)
        del zero
        resumed = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True)
        resumed.load_state_dict(saved)
        _train(resumed, 2)
        out["diff_resumed"] = _max_diff(_params(resumed), zero_p3)
        out["version_resumed"] = resumed.version
        del resumed
        resumed = _resume(hf_dir, ckpt_path, distributed_optimizer=True)  # the same through a v4 checkpoint
        _train(resumed, 2)
        out["diff_resumed_ckpt"] = _max_diff(_params(resumed), zero_p3)
        try:  # a shard must not load into an unsharded optimizer
            plain.load_state_dict(saved)
            out["mismatch_error"] = ""
        except ValueError as err:
            out["mismatch_error"] = str(err)
    out["none_grads"] = none_grads
    return out


def _overlap_param_gather_case(hf_dir, hf, zero, out: dict) -> None:
    """`overlap_param_gather`: the same two steps as `zero` (distributed optimizer, gathered inside the step). After
    a step this rank's parameters still hold the other rank's shard from before it (gathered by the next forward's
    pre-hooks); a forward-only pass and a push's read (`iter_local_hf_slices`) see the updated parameters."""
    from megarl.trainer.policy import MegatronPolicy

    batch = _batch(hf["vocab_size"], 7)
    zero_lp = zero.compute_logprobs(batch["tokens"], batch["targets"])[0]
    zero_slices = {s.name: t.clone() for s, t in zero.iter_local_hf_slices()}
    overlap = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, overlap_param_gather=True)
    _train(overlap, 0)
    stale = _params(overlap)
    _train(overlap, 1)  # its forwards gather step 1's update first
    lp = overlap.compute_logprobs(batch["tokens"], batch["targets"])[0]
    out["overlap_lp_diff"] = float((lp - zero_lp).abs().max())
    slices = {s.name: t.clone() for s, t in overlap.iter_local_hf_slices()}
    out["overlap_slices_diff"] = max(float((slices[k] - zero_slices[k]).abs().max()) for k in zero_slices)
    out["overlap_params_diff"] = _max_diff(_params(overlap), _params(zero))
    fresh = MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, overlap_param_gather=True)
    _train(fresh, 0)
    before = _params(fresh)
    fresh.iter_local_hf_slices()  # gathers
    out["overlap_deferred"] = _max_diff(before, _params(fresh))  # > 0: the gather really waited for a reader
    out["overlap_stale_vs_gathered"] = _max_diff(stale, before)  # the same deferred state both times
    del overlap, fresh


def _regroup(tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """The same 2-rank world, regrouped to another trainer layout."""
    from megatron.core import parallel_state

    from megarl.parallel.cpu_compat import init_rng_tracker

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    init_rng_tracker()


def _save(policy, root, step: int, layout: dict):
    """A v4 checkpoint of `policy` after step `step` (megarl.checkpoint.save_checkpoint, every rank)."""
    import torch.distributed as dist

    from megarl.checkpoint import rng_state, save_checkpoint

    return save_checkpoint(root, step, dist.get_rank(), dist.get_world_size(),
                           {"version": policy.version, "rng": rng_state()}, {}, layout, keep_last=2,
                           sharded_state=policy.sharded_state_dict())


def _resume(hf_dir, path, **kwargs):
    """A fresh policy at the current layout, loaded from the checkpoint at `path` as a resumed run loads it."""
    import torch.distributed as dist

    from megarl.checkpoint import open_checkpoint
    from megarl.models.qwen_provider import read_hf_config
    from megarl.trainer.policy import MegatronPolicy

    policy = MegatronPolicy(hf_dir, read_hf_config(hf_dir), OPTIM, **kwargs)
    ckpt = open_checkpoint(path, {"world_size": 1, "tp": 4})  # the saving layout is never required to match
    policy.load_sharded_state_dict(ckpt.load_sharded(policy.sharded_state_dict(is_loading=True)),
                                   ckpt.rank_state(dist.get_rank())["version"])
    return policy


def _cross_layout(hf_dir, root, save_layout: dict, load_layout: dict, **kwargs) -> dict:
    """Steps 0-3 at `save_layout` (checkpoint after step 1), then a fresh policy at `load_layout` resumed from
    it for steps 2-3: both runs' per-step losses."""
    from megarl.models.qwen_provider import read_hf_config
    from megarl.trainer.policy import MegatronPolicy

    _regroup(**save_layout)
    run = MegatronPolicy(hf_dir, read_hf_config(hf_dir), OPTIM, **kwargs)
    losses = [_train(run, 0)["loss"], _train(run, 1)["loss"]]
    path = _save(run, root, 1, {"world_size": 2, **save_layout})
    losses += [_train(run, 2)["loss"], _train(run, 3)["loss"]]
    del run
    _regroup(**load_layout)
    resumed = _resume(hf_dir, path, **kwargs)
    return {"uninterrupted": losses, "resumed": [_train(resumed, 2)["loss"], _train(resumed, 3)["loss"]],
            "version": resumed.version}


def _recompute_cases(hf_dir, none_grads: dict[str, torch.Tensor]) -> dict:
    from megarl.models.qwen_provider import read_hf_config
    from megarl.trainer.policy import MegatronPolicy

    hf = read_hf_config(hf_dir)
    out = {}
    for mode in ("full", "selective", "block1"):  # block1: recompute='full' of the first layer only
        options = {"recompute": "full", "recompute_layers": 1} if mode == "block1" else {"recompute": mode}
        policy = MegatronPolicy(hf_dir, hf, OPTIM, **options)
        counts = _count_forwards(policy)
        metrics = _train(policy, 0)
        c = policy.model.config
        out[mode] = {"counts": dict(counts), "loss": metrics["loss"],
                     "grad_diff": _max_diff(_grads(policy), none_grads),
                     "config": (c.recompute_granularity, c.recompute_method, c.recompute_num_layers,
                                list(c.recompute_modules or []))}
    return out


def _scale_rank(rank, world, dense_dir, moe_dir, port, root):
    from megatron.core import parallel_state

    from megarl.parallel.cpu_compat import init_rng_tracker
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)  # dense: DP = 2
    try:
        dense = _optimizer_cases(dense_dir, resume=True, root=root / "same")
        dense["recompute"] = _recompute_cases(dense_dir, dense.pop("none_grads"))
        parallel_state.destroy_model_parallel()  # the same world, regrouped: EP = 2 (dense DP 2, expert DP 1)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
        init_rng_tracker()
        moe = _optimizer_cases(moe_dir, resume=False)
        moe.pop("none_grads")
        layouts = {"dense_tp2_to_dp2": _cross_layout(dense_dir, root / "dense", {"tp": 2}, {}),
                   "moe_ep2_to_pp2": _cross_layout(moe_dir, root / "moe", {"ep": 2}, {"pp": 2},
                                                   distributed_optimizer=True)}
        return {"dense": dense, "moe": moe, "layouts": layouts}
    finally:
        destroy_trainer_groups()


@pytest.fixture(scope="module")
def scale_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    dense, moe = make_tiny_checkpoint(root / "dense", kind="dense"), make_tiny_checkpoint(root / "moe", kind="moe")
    return run_distributed(_scale_rank, 2, dense, moe, free_port(), root / "checkpoints", init_dist=False)


def _report(runs, kind):
    for rank, r in enumerate(runs):
        print(f"{kind} rank {rank}: params {r[kind]['param_bytes']} B; optimizer state plain {r[kind]['bytes_plain']} "
              f"B, distributed {r[kind]['bytes_zero']} B")


def test_distributed_optimizer_dense_dp2(scale_runs):
    runs = [r["dense"] for r in scale_runs]
    _report(scale_runs, "dense")
    for r in runs:  # the same element-wise AdamW; the clip coefficient's norm summed in another order
        assert r["diff_step2"] <= 1e-6 and r["diff_step3"] <= 1e-6, r
        assert r["diff_resumed"] == 0.0 and r["version_resumed"] == 3, r  # exact resume
        assert r["diff_resumed_ckpt"] == 0.0, r  # and through megatron's distributed checkpoint
        assert "trainer.distributed_optimizer" in r["mismatch_error"]
        assert r["bytes_plain"]["expert"] == r["bytes_zero"]["expert"] == 0
        assert r["bytes_zero"]["dense"] <= 0.55 * r["bytes_plain"]["dense"], r  # about half per rank
        # Adam: exp_avg and exp_avg_sq of every parameter, fp32
        assert r["bytes_plain"]["dense"] == 2 * r["param_bytes"], r
    assert runs[0]["bytes_plain"] == runs[1]["bytes_plain"]
    # every element's moments are held by exactly one of the two data-parallel replicas
    assert runs[0]["bytes_zero"]["dense"] + runs[1]["bytes_zero"]["dense"] == runs[0]["bytes_plain"]["dense"]


def test_overlap_param_gather_defers_the_gather_to_the_next_reader(scale_runs):
    for r in (run["dense"] for run in scale_runs):
        assert r["overlap_deferred"] > 0 and r["overlap_stale_vs_gathered"] == 0.0, r  # deferred, deterministically
        # after two steps: the forward-only pass, the push's slices and the parameters equal the in-step gather's
        assert r["overlap_lp_diff"] == 0.0 and r["overlap_slices_diff"] == 0.0 and r["overlap_params_diff"] == 0.0, r


def test_distributed_optimizer_moe_ep2(scale_runs):
    runs = [r["moe"] for r in scale_runs]
    _report(scale_runs, "moe")
    for r in runs:
        assert r["diff_step2"] <= 1e-6, r
        assert r["bytes_plain"]["expert"] > 0
        assert sum(r["bytes_plain"].values()) == 2 * r["param_bytes"], r
        # experts: expert-data-parallel size 1, nothing to share; dense: split between the 2 replicas
        assert r["bytes_zero"]["expert"] == r["bytes_plain"]["expert"], r
        assert r["bytes_zero"]["dense"] <= 0.55 * r["bytes_plain"]["dense"], r
    assert runs[0]["bytes_zero"]["dense"] + runs[1]["bytes_zero"]["dense"] == runs[0]["bytes_plain"]["dense"]


@pytest.mark.parametrize("case", ["dense_tp2_to_dp2", "moe_ep2_to_pp2"])
def test_resume_at_another_layout_continues_the_losses(scale_runs, case):
    """A checkpoint saved at one layout (dense: TP2; MoE: EP2 with the distributed optimizer) and resumed at
    another (TP1 x DP2; PP2) continues with the losses the uninterrupted run had at steps 2 and 3."""
    for r in scale_runs:
        got = r["layouts"][case]
        assert got["version"] == 4, got
        for resumed, reference in zip(got["resumed"], got["uninterrupted"][2:], strict=True):
            assert abs(resumed - reference) <= 1e-6 * max(1.0, abs(reference)), got
        assert got["uninterrupted"][2] != got["uninterrupted"][1]  # the steps change the model


@pytest.mark.parametrize("mode", ["full", "selective", "block1"])
def test_recompute_same_loss_and_gradients(scale_runs, mode):
    for r in scale_runs:
        dense = r["dense"]
        got = dense["recompute"][mode]
        assert got["grad_diff"] == 0.0 and got["loss"] == dense["none_loss"], got
        # 2 microbatches on this rank: each layer (core attention) forward runs once more in backward
        if mode == "full":
            assert got["config"][:3] == ("full", "uniform", 1)
            assert got["counts"] == {"layer": 4, "core_attn": 4, "last_layer": 4}
        elif mode == "block1":  # trainer.recompute_layers=1 of the tiny model's 2: the first layer reruns, not the last
            assert got["config"][:3] == ("full", "block", 1)
            assert got["counts"] == {"layer": 4, "core_attn": 4, "last_layer": 2}
        else:
            assert got["config"] == ("selective", None, None, ["core_attn"])
            assert got["counts"] == {"layer": 2, "core_attn": 4, "last_layer": 2}
        assert dense["none_counts"] == {"layer": 2, "core_attn": 2, "last_layer": 2}
