"""Resuming a job whose megatron-core optimizer is Transformer Engine's `FusedAdam` (issue 54): when TE imports,
megatron-core 0.16.1 builds TE's `FusedAdam` (`megatron/core/optimizer/__init__.py:12-16`, `:361-363`), which keeps
Adam's step in the param groups and refuses per-parameter state keys other than `exp_avg`, `exp_avg_sq`,
`master_param` (TE 2.9 `fused_adam.py:191-195`, `:420-442`). No TE installs here (no GPU), so megatron is made to
build `tests/te_standin.py`'s STAND-IN for TE 2.9's `FusedAdam` (its state contract, plain-torch step) exactly where
it would build TE's: `te_standin.install_in_megatron()` rebinds the names megatron's import-time TE `try` binds
(`Adam`, `USING_PYTORCH_OPTIMIZER` in `megatron.core.optimizer`; `Adam`, `HAVE_APEX_OR_TE`, `USING_TE_OPTIMIZER`,
`USING_APEX_OPTIMIZER` in `megatron.core.optimizer.distrib_optimizer`). Nothing of megatron or torch.distributed is
mocked: a real tiny Qwen3-MoE policy (bf16, megatron's DDP and distributed optimizer, expert parallel 2: two chained
optimizers) on 2 gloo ranks.

Each rank trains two steps, reads its optimizer's Adam moments, fp32 main shards and step counts (the reference),
saves them through `MegatronPolicy.sharded_state_dict` and `dist_checkpointing` (megarl's v4 checkpoint), resumes a
fresh policy from that checkpoint (`sharded_state_dict(is_loading=True)` + `load_sharded_state_dict`), and checks
the resumed optimizer holds the reference bit for bit and the next step is the same bits as the uninterrupted run.
The same on torch's AdamW (megatron without TE: what the CPU suite trains) in the same ranks. Before the fix,
the TE resume failed with `KeyError: 'step'` (megarl gave each fresh state torch's per-parameter `step`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed
from tests.te_standin import FusedAdamStandIn, install_in_megatron

B, S = 4, 6
OPTIM = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def _train(policy: Any, step: int, dp_rank: int, dp: int) -> dict[str, float]:
    """One optimizer step on a seeded global batch: this rank's data-parallel share, one sequence a microbatch."""
    vocab = policy.hf["vocab_size"]
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    batch = {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1), "mask": torch.ones(B, S),
             "weights": torch.randn(B, S, generator=g)}
    share = {k: v[dp_rank * B // dp:(dp_rank + 1) * B // dp] for k, v in batch.items()}
    mbs = [{k: v[i:i + 1] for k, v in share.items()} for i in range(B // dp)]
    total = batch["mask"].sum()

    def loss_fn(lp, ent, m):  # noqa: ANN001, ANN202 - the microbatch's contribution to the global loss
        return ((lp * m["weights"] + 0.1 * ent) * m["mask"]).sum() / total, {}

    return policy.train_step(mbs, loss_fn)


def _optimizer_reading(policy: Any) -> dict[str, Any]:
    """What the optimizer holds, read off it directly (no state dict): per chained optimizer, its inner class, its
    groups' step counts, and per stepped tensor its Adam moments, its fp32 value and its state's keys."""
    out = []
    for sub in policy.optimizer.chained_optimizers:
        inner = sub.optimizer
        tensors = [(p.detach().clone(), {k: v.detach().clone() if torch.is_tensor(v) else v
                                         for k, v in inner.state[p].items()})
                   for group in inner.param_groups for p in group["params"]]
        out.append({"cls": type(inner).__name__,
                    "group_steps": [g.get("step") for g in inner.param_groups if g["params"]],
                    "main": [t for t, _ in tensors],
                    "keys": sorted({k for _, s in tensors for k in s}),
                    "exp_avg": [s["exp_avg"] for _, s in tensors],
                    "exp_avg_sq": [s["exp_avg_sq"] for _, s in tensors],
                    "param_steps": [float(s["step"]) for _, s in tensors if "step" in s]})
    return {"optimizers": out}


def _policy(hf_dir: Any, hf: dict[str, Any]) -> Any:
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.trainer.policy import MegatronPolicy

    spec = bench_layer_spec(torch.cuda.is_available(), "bf16")  # local on a GPU without TE, asked for explicitly
    return MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec=spec)


def _save_and_resume(rank: int, world: int, hf_dir: Any, hf: dict[str, Any], root: Any) -> dict[str, Any]:
    """Two steps, the reading, a v4 save, a resume into a fresh policy, then one more step on both."""
    from megarl.checkpoint import open_checkpoint, save_checkpoint
    from megarl.parallel.groups import dp_rank_and_size

    dp_rank, dp = dp_rank_and_size()
    policy = _policy(hf_dir, hf)
    for step in range(2):
        assert _train(policy, step, dp_rank, dp)["train/skipped_step"] == 0
    saved = _optimizer_reading(policy)
    path = save_checkpoint(root, 2, rank, world, {"version": policy.version}, {}, {"world_size": world},
                           keep_last=1, sharded_state=policy.sharded_state_dict())
    resumed = _policy(hf_dir, hf)
    to_load = resumed.sharded_state_dict(is_loading=True)
    fresh = _optimizer_reading(resumed)  # before the load: the state megarl's init gave the fresh optimizer
    resumed.load_sharded_state_dict(open_checkpoint(path, {}).load_sharded(to_load), 2)
    loaded = _optimizer_reading(resumed)
    _train(policy, 2, dp_rank, dp)
    _train(resumed, 2, dp_rank, dp)
    same_next = all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), resumed.model.parameters(),
                                                     strict=True))
    return {"saved": saved, "fresh": fresh, "loaded": loaded, "same_next_step": same_next,
            "after_next": _optimizer_reading(resumed)}


def _rank(rank: int, world: int, hf_dir: Any, port: int, root: Any) -> dict[str, Any]:
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups

    init_trainer_groups(TrainerLayout(ep=2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        restore = install_in_megatron()  # megatron as built where TE imports: TE's FusedAdam (the stand-in)
        try:
            te = _save_and_resume(rank, world, hf_dir, hf, root / "te")
        finally:
            restore()
        torch_run = _save_and_resume(rank, world, hf_dir, hf, root / "torch")  # megatron without TE / Apex
        return {"te": te, "torch": torch_run}
    finally:
        destroy_trainer_groups()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("te_resume")
    hf_dir = make_tiny_checkpoint(tmp / "moe", kind="moe")
    return run_distributed(_rank, 2, hf_dir, free_port(), tmp / "checkpoints", init_dist=False)


def _assert_resumed_equals_saved(run: dict[str, Any]) -> None:
    assert len(run["saved"]["optimizers"]) == 2  # dense and expert optimizers, chained
    for saved, loaded in zip(run["saved"]["optimizers"], run["loaded"]["optimizers"], strict=True):
        assert loaded["cls"] == saved["cls"] and loaded["keys"] == saved["keys"]
        assert loaded["param_steps"] == saved["param_steps"]
        assert any(bool(m.any()) for m in saved["exp_avg"])  # trained: not the zeros a fresh optimizer holds
        for key in ("main", "exp_avg", "exp_avg_sq"):
            for a, b in zip(saved[key], loaded[key], strict=True):
                assert torch.equal(a, b), key
    assert run["same_next_step"], "the resumed run's next step differs from the uninterrupted run's"


def test_resume_on_te_fused_adam(ranks: list[dict[str, Any]]) -> None:
    """TE's contract (the stand-in): the moments come back bit for bit, the step count lives in the param groups
    (2 after two steps, 3 after the next) and no per-parameter `step` is ever created, fresh or loaded."""
    for r in ranks:
        run = r["te"]
        for reading in (run["saved"], run["fresh"], run["loaded"], run["after_next"]):
            for opt in reading["optimizers"]:
                assert opt["cls"] == FusedAdamStandIn.__name__
                assert opt["keys"] == ["exp_avg", "exp_avg_sq"] and opt["param_steps"] == []
        assert all(o["group_steps"] == [2] * len(o["group_steps"]) for o in run["saved"]["optimizers"])
        assert [o["group_steps"] for o in run["loaded"]["optimizers"]] == [
            o["group_steps"] for o in run["saved"]["optimizers"]]  # restored from the checkpoint's groups
        assert all(o["group_steps"] == [3] * len(o["group_steps"]) for o in run["after_next"]["optimizers"])
        # megarl's init before a load: megatron's own init_state_fn, zero moments
        assert all(not bool(m.any()) for o in run["fresh"]["optimizers"] for m in o["exp_avg"] + o["exp_avg_sq"])
        _assert_resumed_equals_saved(run)


def test_resume_on_torch_adamw(ranks: list[dict[str, Any]]) -> None:
    """torch's AdamW (megatron without TE): the per-parameter `step` torch keeps is restored, one tensor each."""
    for r in ranks:
        run = r["torch"]
        for opt in run["loaded"]["optimizers"]:
            assert opt["cls"] == "AdamW" and opt["keys"] == ["exp_avg", "exp_avg_sq", "step"]
            assert opt["param_steps"] and set(opt["param_steps"]) == {2.0}
        for opt in run["after_next"]["optimizers"]:
            assert set(opt["param_steps"]) == {3.0}  # unshared: each incremented once
        _assert_resumed_equals_saved(run)


def test_standin_steps_as_adamw() -> None:
    """The stand-in's plain-torch step against torch's AdamW (an independent implementation of the same update,
    decoupled decay), over three steps on two groups; and its state contract: a per-parameter `step` is refused by
    `state_dict` and `load_state_dict` with KeyError, as TE 2.9's."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g)]
    mine = [torch.nn.Parameter(w.clone()) for w in ws]
    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = FusedAdamStandIn([{"params": [mine[0]]}, {"params": [mine[1]], "weight_decay": 0.0}], lr=1e-2,
                           betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    torch_opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]], "weight_decay": 0.0}], lr=1e-2,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(w.shape, generator=g) for w in ws]
        for p, q, gr in zip(mine, ref, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(mine, ref, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(opt.state[p]["exp_avg"], torch_opt.state[q]["exp_avg"])
    assert [grp["step"] for grp in opt.param_groups] == [3, 3]
    assert set(opt.state[mine[0]]) == {"exp_avg", "exp_avg_sq"}
    saved = opt.state_dict()
    other = FusedAdamStandIn([{"params": [torch.nn.Parameter(w.clone()) for w in ws[:1]]},
                              {"params": [torch.nn.Parameter(ws[1].clone())], "weight_decay": 0.0}])
    other.load_state_dict(saved)
    assert [grp["step"] for grp in other.param_groups] == [3, 3]
    opt.state[mine[0]]["step"] = torch.tensor(3.0)  # torch's per-parameter step, as megarl used to add
    with pytest.raises(KeyError, match="step"):
        opt.state_dict()
    saved["state"][0]["step"] = torch.tensor(3.0)
    with pytest.raises(KeyError, match="step"):
        other.load_state_dict(saved)
