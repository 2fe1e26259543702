"""`megarl export`: a run checkpoint written by real trainer ranks back to a Hugging Face checkpoint.

For MoE EP=2, dense TP=2, dense PP=2 and tied-embedding PP=2 (world 2, gloo), trainer ranks load a tiny HF
checkpoint into megatron-core and save two run checkpoints with `megarl.checkpoint.save_checkpoint`: step 0 as
loaded, and step 1 after adding seeded noise to every HF block of every parameter copy (the noise is defined in
HF coordinates, so the expected HF tensors are known exactly: original + noise, rounded to the checkpoint's
dtype; the ranks round their fp32 weights the same way). The dense TP=2 case starts from a bfloat16 copy of
the checkpoint: the trainer holds fp32, export must write bfloat16 again. Export (a fresh spawn of the
checkpoint's layout) must
1. give back every tensor of the original safetensors bit-exactly (names, dtypes, shapes, bytes) for step 0
   (MoE EP=2, dense TP=2, tied PP=2: no lm_head, the embedding written once, from the first stage; skipped
   for dense PP=2 to save a spawn: its step-1 check below is bit-exact too),
   and original + noise bit-exactly for step 1;
2. load in `transformers.AutoModelForCausalLM` with no missing or unexpected keys, and its log-probs of the
   step-1 export equal the trainer's own log-probs of the perturbed megatron model, computed in the ranks:
   atol 1e-4 (both fp32 on CPU, different kernels and reduction orders; differences are ~1e-6).
The PP=2 case goes through the command line (`register` / `run`), with the model directory taken from the
run's config.yaml and a shard size that splits the model into several files plus an index.
Errors are checked without spawning: not a checkpoint, a missing rank file, an occupied --out, a wrong model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from megarl.models.hf_export import (
    ExportError,
    SafetensorsStream,
    export_checkpoint,
    parse_size,
    plan_shards,
    read_checkpoint_meta,
    register,
    run,
    to_local_spec,
)
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from megarl.sync.slices import HFSlice
from tests.dist_utils import free_port, run_distributed

B, S = 3, 9
ATOL = 1e-4  # log-probs, fp32 on both sides


def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _noise(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The perturbation of HF tensor `name`: the same on every rank whatever block of it the rank holds."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.05 * torch.randn(shape, generator=g)


def _block_noise(block: HFSlice) -> torch.Tensor:
    return _noise(block.name, block.full_shape)[tuple(slice(a, b) for a, b in block.box)]


def _perturbed(original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 weight + noise, rounded to the checkpoint's dtype (exact for fp32), back in fp32."""
    return (original.float() + noise).to(original.dtype).float()


def _train_rank(rank, world, hf_dir, layout, run_dir, dtype, port):
    """Load the HF checkpoint, save step 0; perturb every HF block, save step 1; return the perturbed log-probs."""
    from megarl.checkpoint import rng_state, save_checkpoint
    from megarl.config.schema import OptimizerConfig
    from megarl.models.hf_layout import layout_for
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(layout, rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        policy = MegatronPolicy(hf_dir, hf, OptimizerConfig())
        meta = {"world_size": world, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "expert_tp": layout.expert_tp,
                "model_config_sha256": hashlib.sha256((Path(hf_dir) / "config.json").read_bytes()).hexdigest()}
        root = Path(run_dir) / "checkpoints"

        def save(step):
            save_checkpoint(root, step, rank, world, {"version": policy.version, "rng": rng_state()},
                            {"pending": {}, "algorithm": None}, meta, keep_last=0,
                            sharded_state=policy.sharded_state_dict())

        save(0)
        layout_map = layout_for(policy.model, hf)  # every copy: a tied embedding's last-stage copy too
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                for index, block in layout_map.blocks(name, tuple(param.shape)):
                    view = param[index]
                    view.copy_(_perturbed(view.to(dtype), _block_noise(block)))
        logprobs, _ = policy.compute_logprobs(*_tokens(hf["vocab_size"]))
        save(1)
        return logprobs
    finally:
        destroy_trainer_groups()


def _hf_logprobs(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens, targets = _tokens(model.config.vocab_size)
    with torch.no_grad():
        logsm = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    return logsm.gather(-1, targets[..., None]).squeeze(-1)


def _exported(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(out / file)
        assert {weight_map[n] for n in part} == {file}, f"{file}: index and file disagree"
        tensors |= part
    assert tensors.keys() == weight_map.keys()
    return tensors


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _as_bf16(src: Path, out: Path) -> Path:
    """A bfloat16 copy of checkpoint `src` (tensors and the config's dtype), tokenizer files included."""
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("kind", "layout", "dtype", "as_loaded", "via_cli"), [
    ("moe", TrainerLayout(ep=2), torch.float32, True, False),
    ("dense", TrainerLayout(tp=2), torch.bfloat16, True, False),
    ("dense", TrainerLayout(pp=2), torch.float32, False, True),
    ("dense-tied", TrainerLayout(pp=2), torch.float32, True, False),
    ("moe", TrainerLayout(expert_tp=2), torch.float32, False, False),  # each expert's columns over both ranks
], ids=["moe-ep2", "dense-tp2-bf16", "dense-pp2-cli", "tied-pp2", "moe-etp2"])
def test_export_round_trip_and_trained_state(tmp_path, kind, layout, dtype, as_loaded, via_cli):
    hf_dir = make_tiny_checkpoint(tmp_path / kind, kind=kind)
    if dtype == torch.bfloat16:
        hf_dir = _as_bf16(hf_dir, tmp_path / f"{kind}-bf16")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"hf_dir": str(hf_dir)}}))
    per_rank = run_distributed(_train_rank, 2, hf_dir, layout, run_dir, dtype, free_port(), init_dist=False)
    original = load_file(hf_dir / "model.safetensors")
    assert {t.dtype for t in original.values()} == {dtype}

    if as_loaded:  # (a) every tensor back, bit-exactly, with the model's other files
        out0 = export_checkpoint(run_dir / "checkpoints" / "step_00000000", hf_dir, tmp_path / "out0")
        _assert_same_tensors(_exported(out0), original)
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (out0 / name).read_bytes() == (hf_dir / name).read_bytes(), name
        assert not (tmp_path / "out0.tmp").exists()
    if kind == "moe" and layout.ep == 2:  # a model directory that does not fit the rank files (no sha256 in meta.json
        # to catch it early)
        step0 = run_dir / "checkpoints" / "step_00000000"
        meta = json.loads((step0 / "meta.json").read_text())
        (step0 / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "model_config_sha256"}))
        dense = make_tiny_checkpoint(tmp_path / "dense", kind="dense")
        with pytest.raises(ExportError, match=r"cannot be built at the checkpoint's layout tp=1 pp=1 ep=2 expert_tp=1 "
                           r"\(wrong"):
            export_checkpoint(step0, dense, tmp_path / "wrong")
        assert not (tmp_path / "wrong").exists() and not (tmp_path / "wrong.tmp").exists()

    # (b) a trained state: exactly original + noise, and transformers agrees with the trainer's log-probs
    out1 = tmp_path / "out1"
    step1 = run_dir / "checkpoints" / "step_00000001"
    if via_cli:  # model directory from the run's config.yaml; several shards and an index
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers(dest="command"))
        assert run(parser.parse_args(["export", str(step1), "--out", str(out1), "--shard-size", "500KB"])) == 0
        files = json.loads((out1 / "model.safetensors.index.json").read_text())["weight_map"].values()
        assert len(set(files)) > 1 and not (out1 / "model.safetensors").exists()
        # no tensor of the tiny model exceeds the limit alone: each file holds at most 500 KB of data + its header
        assert all((out1 / f).stat().st_size <= 500_000 + 8192 for f in set(files))
    else:
        export_checkpoint(step1, hf_dir, out1)
    expected = {n: _perturbed(t, _noise(n, tuple(t.shape))).to(t.dtype) for n, t in original.items()}
    _assert_same_tensors(_exported(out1), expected)
    hf_lp = _hf_logprobs(out1)
    for lp in per_rank:  # every rank (both pipeline stages) holds the full log-probs
        torch.testing.assert_close(lp, hf_lp, atol=ATOL, rtol=0)
    # the perturbation is visible in the log-probs, so the comparison above checks the trained weights
    assert (hf_lp - _hf_logprobs(hf_dir)).abs().max() > 100 * ATOL


# ---- no processes needed ------------------------------------------------------------------------------------------
def _fake_checkpoint(path: Path, world: int = 2, present: tuple[int, ...] = (0, 1)) -> Path:
    path.mkdir(parents=True)
    files = {}
    for rank in present:
        (path / f"rank_{rank:05d}.pt").write_bytes(b"x" * 10)
        files[f"rank_{rank:05d}.pt"] = 10
    meta = {"format": "megarl-checkpoint-v1", "world_size": world, "tp": 1, "pp": 1, "ep": 2, "files": files}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_checkpoints_before_expert_tp_export_at_their_tp(tmp_path):
    """meta.json without expert_tp (written before the field): the experts were split as megatron's default, tp."""
    old = _fake_checkpoint(tmp_path / "old")
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "tp": 2, "ep": 1}))
    assert read_checkpoint_meta(old)["expert_tp"] == 2
    (old / "meta.json").write_text(json.dumps({**meta, "tp": 2, "ep": 1, "expert_tp": 1}))
    assert read_checkpoint_meta(old)["expert_tp"] == 1


def test_errors_name_the_problem_and_the_fix(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model", kind="dense")
    with pytest.raises(ExportError, match="no such directory"):
        export_checkpoint(tmp_path / "nowhere", model, tmp_path / "out")
    run_dir = tmp_path / "run"
    good = _fake_checkpoint(run_dir / "checkpoints" / "step_00000004")
    with pytest.raises(ExportError, match=r"not a megarl checkpoint \(no meta.json\).*step_00000004"):
        export_checkpoint(run_dir, model, tmp_path / "out")  # the run directory instead of a checkpoint
    with pytest.raises(ExportError, match=r"rank_00001.pt is missing.*copy the whole step directory"):
        export_checkpoint(_fake_checkpoint(tmp_path / "partial", present=(0,)), model, tmp_path / "out")
    (good / "rank_00001.pt").write_bytes(b"x" * 3)
    with pytest.raises(ExportError, match=r"rank_00001.pt: 3 bytes, meta.json recorded 10"):
        export_checkpoint(good, model, tmp_path / "out")
    (good / "rank_00001.pt").write_bytes(b"x" * 10)
    with pytest.raises(ExportError, match=r"config.yaml not found.*--model-dir"):
        export_checkpoint(good, None, tmp_path / "out")
    meta = json.loads((good / "meta.json").read_text())
    (good / "meta.json").write_text(json.dumps({**meta, "model_config_sha256": "0" * 64}))
    with pytest.raises(ExportError, match="not the config.json the run trained"):
        export_checkpoint(good, model, tmp_path / "out")
    (good / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty.*--overwrite"):
        export_checkpoint(good, model, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine" and not (tmp_path / "busy.tmp").exists()
    # the command line reports the error and exits 2
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert run(parser.parse_args(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])) == 2


def test_safetensors_stream_shards_and_sizes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a.bias": torch.randn(7, generator=g),
               "c": torch.randn(2, 2, 2, generator=g).half()}
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    entries = [(n, names[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    stream = SafetensorsStream(tmp_path / "x.safetensors", entries)
    for name, tensor in tensors.items():
        stream.write(name, tensor)
    stream.close()
    _assert_same_tensors(load_file(tmp_path / "x.safetensors"), tensors)
    # shards: consecutive, at most the limit unless one tensor alone exceeds it
    shards = plan_shards(entries, shard_size=40)
    assert [[e[0] for e in s] for s in shards] == [["b.weight"], ["a.bias"], ["c"]]
    assert [len(s) for s in plan_shards(entries, shard_size=10**6)] == [3]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500kb") == 500_000
    assert parse_size(123) == 123


def test_transformer_engine_names_map_to_the_local_spec():
    local = {"decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight"}
    te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 1,
          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 2,
          "decoder.layers.0.self_attention.linear_qkv.weight": 3,
          "decoder.layers.0.self_attention.linear_qkv._extra_state": None}
    assert to_local_spec(te, local) == {"decoder.layers.0.input_layernorm.weight": 1,
                                        "decoder.layers.0.pre_mlp_layernorm.weight": 2,
                                        "decoder.layers.0.self_attention.linear_qkv.weight": 3}


def test_grouped_gemm_expert_names_map_to_the_local_spec():
    """A checkpoint trained with TE's grouped GEMM (`TEGroupedMLP`: `linear_fc1.weight{j}`, one `_extra_state`) loads
    into the local spec's `SequentialMLP` that CPU export builds: expert j's tensors keep their values."""
    p = "decoder.layers.1.mlp.experts."
    local = {f"{p}local_experts.{j}.linear_fc{fc}.weight" for j in range(2) for fc in (1, 2)} | {
        "decoder.layers.1.mlp.router.weight"}
    grouped = {f"{p}linear_fc1.weight0": "fc1-e0", f"{p}linear_fc1.weight1": "fc1-e1",
               f"{p}linear_fc2.weight0": "fc2-e0", f"{p}linear_fc2.weight1": "fc2-e1",
               f"{p}linear_fc1._extra_state": None, f"{p}linear_fc2._extra_state": None,
               "decoder.layers.1.mlp.router.weight": "router"}
    assert to_local_spec(grouped, local) == {
        f"{p}local_experts.0.linear_fc1.weight": "fc1-e0", f"{p}local_experts.1.linear_fc1.weight": "fc1-e1",
        f"{p}local_experts.0.linear_fc2.weight": "fc2-e0", f"{p}local_experts.1.linear_fc2.weight": "fc2-e1",
        "decoder.layers.1.mlp.router.weight": "router"}
