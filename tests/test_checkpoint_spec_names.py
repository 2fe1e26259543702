"""A MoE checkpoint saved on Transformer Engine's layer spec loads on megatron's local spec (resume and `megarl
export`), and the reverse (issue 54, the audit's trainer row; `megarl/models/spec_keys.py`).

megatron-core 0.16.1 names the pre-MLP norm of a MoE layer differently in the two specs' sharded state dicts
(`megatron/core/models/gpt/gpt_layer_specs.py`): TE's spec builds `pre_mlp_layernorm=backend.layer_norm() if
num_experts` (line 291, `TENorm`) and its key map (lines 294-301) leaves it `decoder.layers.pre_mlp_layernorm.weight`;
the local spec maps `"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"` for every layer (lines 417-420). The
distributed optimizer's `fully_reshardable` keys (`optimizer.state.exp_avg.<model key>`) follow. `TENorm` (a TE
module) also has an `_extra_state` the local torch norm lacks, saved as a `ShardedObject` next to its weight.

No TE installs here, so the TE-spec checkpoint is made from a real tiny Qwen3-MoE policy (local spec, bf16,
megatron's DDP and distributed optimizer, one gloo rank, one training step so the Adam moments are not zero): its
sharded state dict with the norm keys renamed to TE's names and an `_extra_state` object added per layer, as TE's MoE
layer saves them, through megarl's own `save_checkpoint`. Then:
(a) a fresh local-spec policy resumes from it: parameters, fp32 main parameters and Adam moments equal the ones read
    off the saving policy, bit for bit;
(b) `megarl export` of it (`export_checkpoint`) writes the saving policy's weights under their HF names;
(c) a checkpoint saved on the local spec still resumes the same;
(d) the reverse: a load request named as TE's MoE layer names it (the norm keys, the norm's `_extra_state`) is filled
    from the local-spec checkpoint, the `_extra_state` keeping the module's own value.
Before the fix, (a) and (b) failed in `dist_checkpointing.load` on the missing local norm key, (d) on the TE one
(and, with the norm keys aligned alone, on the `_extra_state` object the local checkpoint lacks).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from megarl.config.schema import OptimizerConfig
from megarl.models.hf_export import export_checkpoint
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from tests.dist_utils import free_port, run_distributed

B, S = 2, 6
OPTIM = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
LOCAL_NORM, TE_NORM = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"  # gpt_layer_specs.py:291, :419
TE_NORM_EXTRA = "pre_mlp_layernorm._extra_state"


def _policy(hf_dir: Path, hf: dict[str, Any]) -> Any:
    from megarl.trainer.policy import MegatronPolicy

    return MegatronPolicy(hf_dir, hf, OPTIM, distributed_optimizer=True, precision="bf16", layer_spec="local")


def _train(policy: Any) -> None:
    vocab = policy.hf["vocab_size"]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    batch = {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1), "mask": torch.ones(B, S),
             "weights": torch.randn(B, S, generator=g)}
    mbs = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(B)]

    def loss_fn(lp, ent, m):  # noqa: ANN001, ANN202 - the microbatch's contribution to the loss
        return ((lp * m["weights"] + 0.1 * ent) * m["mask"]).sum() / (B * S), {}

    assert policy.train_step(mbs, loss_fn)["train/skipped_step"] == 0


def _reading(policy: Any) -> dict[str, Any]:
    """Read off the policy directly: its parameters, and per chained optimizer its fp32 main tensors and moments."""
    optimizers = []
    for sub in policy.optimizer.chained_optimizers:
        inner = sub.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        optimizers.append({"main": [p.detach().clone() for p in params],
                           "exp_avg": [inner.state[p]["exp_avg"].clone() for p in params],
                           "exp_avg_sq": [inner.state[p]["exp_avg_sq"].clone() for p in params]})
    return {"params": {n: p.detach().clone() for n, p in policy.model.named_parameters()}, "optimizers": optimizers}


def _as_te_moe_names(sharded_state: dict[str, Any]) -> dict[str, Any]:
    """`sharded_state` (in place) named as Transformer Engine's MoE layer names it: the pre-MLP norm's keys, model
    and optimizer (`gpt_layer_specs.py:291`, `:294-301`), and per layer the `TENorm`'s `_extra_state` object (made
    like the layer's other `_extra_state` objects, with the same layer offsets)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for entry in nested_values(sharded_state):
        key = getattr(entry, "key", None)
        if isinstance(key, str) and key.endswith("." + LOCAL_NORM):
            entry.key = key.removesuffix(LOCAL_NORM) + TE_NORM
    model = sharded_state["model"]
    for name in [n for n in model if n.endswith(".pre_mlp_layernorm.weight")]:
        layer = name.removesuffix("pre_mlp_layernorm.weight")
        like = model[layer + "self_attention.linear_proj._extra_state"]
        model[layer + TE_NORM_EXTRA] = dataclasses.replace(
            like, key=like.key.replace("self_attention.linear_proj._extra_state", TE_NORM_EXTRA))
    return sharded_state


def _resume(hf_dir: Path, hf: dict[str, Any], path: Path, te_request: bool = False) -> dict[str, Any] | str:
    """A fresh policy resumed from `path` (`te_request`: the load request named as TE's MoE layer names it), read
    off; or the load's error, as a line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.checkpoint import open_checkpoint

    resumed = _policy(hf_dir, hf)
    request = resumed.sharded_state_dict(is_loading=True)
    if te_request:
        _as_te_moe_names(request)
    try:
        state = open_checkpoint(path, {}).load_sharded(request)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported by the test (torch's is a BaseException)
        return f"{type(err).__name__}: {err}"
    extra = {n: state["model"].pop(n) for n in list(state["model"]) if n.endswith(TE_NORM_EXTRA)}
    resumed.load_sharded_state_dict(state, 1)
    return {**_reading(resumed), "te_norm_extra_states": extra}


def _rank(rank: int, world: int, hf_dir: Path, port: int, root: Path) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megarl.checkpoint import SHARDED_DIR, save_checkpoint
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = _policy(hf_dir, hf)
        _train(policy)
        hf_weights: dict[str, torch.Tensor] = {}
        for block, tensor in policy.iter_local_hf_slices():
            full = hf_weights.setdefault(block.name, torch.zeros(block.full_shape, dtype=tensor.dtype))
            full[tuple(slice(a, b) for a, b in block.box)] = tensor
        meta = {"world_size": world, "tp": 1, "pp": 1, "ep": 1, "expert_tp": 1, "precision": "bf16",
                "model_config_sha256": hashlib.sha256((hf_dir / "config.json").read_bytes()).hexdigest()}

        def save(spec: str, sharded_state: dict[str, Any]) -> Path:
            return save_checkpoint(root / spec, 1, rank, world, {"version": policy.version}, {}, meta, keep_last=1,
                                   sharded_state=sharded_state)

        paths = {"te": save("te", _as_te_moe_names(policy.sharded_state_dict())),
                 "local": save("local", policy.sharded_state_dict())}
        keys = {spec: sorted({e.key for e in load_sharded_metadata(str(p / SHARDED_DIR)).values()})
                for spec, p in paths.items()}
        return {"saved": _reading(policy), "hf_weights": hf_weights, "paths": paths, "keys": keys,
                "te_resumed": _resume(hf_dir, hf, paths["te"]), "local_resumed": _resume(hf_dir, hf, paths["local"]),
                "te_request_on_local": _resume(hf_dir, hf, paths["local"], te_request=True)}
    finally:
        destroy_trainer_groups()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("spec_names")
    hf_dir = make_tiny_checkpoint(tmp / "moe", kind="moe")
    (result,) = run_distributed(_rank, 1, hf_dir, free_port(), tmp / "checkpoints", init_dist=False)
    return {**result, "hf_dir": hf_dir, "tmp": tmp}


def _assert_equals_saved(resumed: dict[str, Any] | str, saved: dict[str, Any]) -> None:
    assert isinstance(resumed, dict), resumed  # else: the load's error
    assert resumed["params"].keys() == saved["params"].keys()
    for name, tensor in saved["params"].items():
        assert torch.equal(resumed["params"][name], tensor), name
    assert len(saved["optimizers"]) == len(resumed["optimizers"])
    for mine, theirs in zip(resumed["optimizers"], saved["optimizers"], strict=True):
        for part in ("main", "exp_avg", "exp_avg_sq"):
            assert len(mine[part]) == len(theirs[part])
            for a, b in zip(mine[part], theirs[part], strict=True):
                assert torch.equal(a, b), part


def test_checkpoints_hold_each_specs_names(run: dict[str, Any]) -> None:
    """The premise: the TE-named checkpoint holds only TE's norm names, model and optimizer; the local one only
    the local names; the moments are trained (not a fresh optimizer's zeros)."""
    for spec, mine, theirs in (("te", TE_NORM, LOCAL_NORM), ("local", LOCAL_NORM, TE_NORM)):
        keys = run["keys"][spec]
        for prefix in ("", "optimizer.state.param.", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
            assert f"{prefix}decoder.layers.{mine}" in keys, (spec, prefix)
            assert f"{prefix}decoder.layers.{theirs}" not in keys, (spec, prefix)
    assert f"decoder.layers.{TE_NORM_EXTRA}" in run["keys"]["te"]
    assert any(bool(m.any()) for o in run["saved"]["optimizers"] for m in o["exp_avg"])


def test_local_spec_resumes_a_te_moe_checkpoint(run: dict[str, Any]) -> None:
    _assert_equals_saved(run["te_resumed"], run["saved"])


def test_local_spec_checkpoint_still_resumes(run: dict[str, Any]) -> None:
    _assert_equals_saved(run["local_resumed"], run["saved"])


def test_te_moe_request_loads_a_local_checkpoint(run: dict[str, Any]) -> None:
    """The reverse direction (a GPU job resuming a CPU checkpoint): TE's norm keys are filled from the local
    names, and TENorm's `_extra_state`, absent from a local checkpoint, keeps the module's own value."""
    resumed = run["te_request_on_local"]
    _assert_equals_saved(resumed, run["saved"])
    layers = len([n for n in run["saved"]["params"] if n.endswith(".pre_mlp_layernorm.weight")])
    assert len(resumed["te_norm_extra_states"]) == layers >= 2
    assert all(v is None for v in resumed["te_norm_extra_states"].values())  # the request's own (a stand-in's: None)


def test_export_of_a_te_moe_checkpoint(run: dict[str, Any]) -> None:
    """`megarl export` (local spec) of the TE-named checkpoint: every HF tensor is the saving policy's weight."""
    out = export_checkpoint(run["paths"]["te"], run["hf_dir"], run["tmp"] / "export")
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(run["hf_weights"])
    for name, weight in run["hf_weights"].items():
        assert torch.equal(exported[name], weight.to(exported[name].dtype)), name
    assert any("post_attention_layernorm" in n for n in exported)  # the norm the two specs name differently
