"""`megarl plan` against published figures and against real tensors.

- The public Qwen3-30B-A3B / Qwen3-8B / Qwen2.5-7B architectures give the parameter counts of their model
  cards (total, non-embedding, activated), and exactly 30,532,122,624 parameters for Qwen3-30B-A3B.
- Tiny real checkpoints (Qwen3-MoE, Qwen3, Qwen2, tied Qwen3) written by `transformers`: the planned HF
  tensors are the safetensors' names and shapes; each vLLM TP rank's bytes equal the hand count of
  tests/test_weight_sync.py (MoE) and, summed over ranks, every split tensor once plus every replicated one
  per rank.
- Real megatron-core models built in 4 gloo processes (dense TPxPP, TPxDP, Qwen2 biases, tied embeddings,
  padded vocabulary, MoE EPxPP and EP 4): each rank's local parameter names and shapes are the planned ones.
"""

import argparse
import io
import json
import math
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from safetensors import safe_open

from megarl.checks import check_against_model
from megarl.config.load import ConfigError
from megarl.config.schema import Config
from megarl.models.hf_config import read_hf_config
from megarl.models.shapes import active_params, hf_tensor_shapes, megatron_local_shapes, pipeline_stage_of, total_params
from megarl.models.tiny import make_tiny_checkpoint
from megarl.plan_report import make_plan, run
from tests.dist_utils import free_port, run_distributed
from tests.test_weight_sync import _hand_bytes_per_rank

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"


def _embedding_params(hf: dict) -> int:
    return hf["vocab_size"] * hf["hidden_size"] * (1 if hf.get("tie_word_embeddings") else 2)


def test_qwen3_30b_a3b_exact_total():
    hf = read_hf_config(MODELS / "qwen3-30b-a3b")
    assert total_params(hf) == 30_532_122_624
    assert 2 * total_params(hf) == 61_064_245_248  # bf16
    assert f"{2 * total_params(hf) / 1e9:.2f}" == "61.06"


def _card(params: int, figure: str) -> bool:
    """Model cards print billions rounded (Qwen3) or truncated (Qwen2.5): within one unit of the last digit."""
    return abs(params / 1e9 - float(figure)) < 10.0 ** -len(figure.split(".")[1])


@pytest.mark.parametrize(("model", "total", "non_embedding", "active"), [
    ("qwen3-30b-a3b", "30.5", "29.9", "3.3"),  # model card: 30.5B total, 3.3B activated, 29.9B non-embedding
    ("qwen3-8b", "8.2", "6.95", None),  # model card: 8.2B, 6.95B non-embedding
    ("qwen2.5-7b", "7.61", "6.53", None),  # model card: 7.61B, 6.53B non-embedding
])
def test_model_card_figures(model, total, non_embedding, active):
    hf = read_hf_config(MODELS / model)
    assert _card(total_params(hf), total)
    assert _card(total_params(hf) - _embedding_params(hf), non_embedding)
    if active:
        assert _card(active_params(hf), active)


def _save_variant(out: Path, kind: str) -> Path:
    """A tiny Qwen2 (q/k/v biases, no q/k norms) or tied-embedding Qwen3, saved by transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    base = json.loads((out.parent / "dense" / "config.json").read_text())
    shape = {k: base[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "intermediate_size", "max_position_embeddings")}
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=64, tie_word_embeddings=True))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_moe_dir):
    """The session's tiny MoE (tests/fleet_fixture.py), a tiny dense Qwen3 and the two variants of it."""
    root = tmp_path_factory.mktemp("plan")
    dirs = {"moe": tiny_moe_dir, "dense": make_tiny_checkpoint(root / "dense", kind="dense")}
    dirs |= {kind: _save_variant(root / kind, kind) for kind in ("qwen2", "tied")}
    return dirs


def _real_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - not a dict


def _config(hf_dir: Path, **layout) -> Config:
    trainer = {k: v for k, v in layout.items() if k in ("world_size", "tp", "pp", "ep", "expert_tp")}
    rollout = {k.removeprefix("rollout_"): v for k, v in layout.items() if k.startswith("rollout_")}
    return Config.model_validate({"model": {"hf_dir": str(hf_dir)}, "trainer": trainer, "rollout": rollout})


@pytest.mark.parametrize("kind", ["moe", "dense", "qwen2", "tied"])
def test_totals_and_vllm_ranks_match_real_tensors(tiny, kind):
    hf = read_hf_config(tiny[kind])
    real = _real_shapes(tiny[kind])
    assert hf_tensor_shapes(hf) == real
    numel = {name: math.prod(shape) for name, shape in real.items()}
    assert total_params(hf) == sum(numel.values())
    for tp in (1, 2):
        plan = make_plan(hf, _config(tiny[kind], rollout_tp=tp, rollout_replicas=3), dtype="fp32")
        # norms, q/k norms and the router are whole on every vLLM rank; every other tensor is split once
        replicated = {n for n, shape in real.items()
                      if (len(shape) == 1 and not n.endswith(".bias")) or n.endswith("mlp.gate.weight")}
        assert sum(plan.rollout_rank_params) == sum(numel.values()) + (tp - 1) * sum(numel[n] for n in replicated)
        assert plan.sync_bytes_total == 3 * 4 * sum(plan.rollout_rank_params)
        if tp == 1:
            assert plan.rollout_rank_params == [total_params(hf)]
        if kind == "moe":  # the hand count the live weight-sync test checks the received bytes against
            assert [4 * n for n in plan.rollout_rank_params] == _hand_bytes_per_rank(hf, tp)


# (model, tp, pp, ep, expert_tp): every case runs on 4 trainer ranks
CASES = [("dense", 2, 2, 1, 1), ("dense31", 2, 1, 1, 1), ("qwen2", 2, 1, 1, 1), ("tied", 2, 1, 1, 1),
         ("tied", 2, 2, 1, 1), ("moe", 1, 2, 2, 1), ("moe", 1, 1, 4, 1), ("moe", 1, 1, 2, 2), ("moe", 1, 2, 1, 2)]
WORLD = 4


def _megatron_shapes(rank, world, hfs, cases, ports):
    """This rank's megatron-core parameter shapes for every case (groups rebuilt per case)."""
    from megarl.models.qwen_provider import build_gpt_model
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups

    out = []
    for (kind, tp, pp, ep, etp), port in zip(cases, ports, strict=True):
        init_trainer_groups(TrainerLayout(tp=tp, pp=pp, ep=ep, expert_tp=etp), rank, world, "127.0.0.1", port)
        try:
            model = build_gpt_model(hfs[kind], tp, pp, ep, expert_tp=etp)
            out.append({n: tuple(p.shape) for n, p in model.named_parameters()})
        finally:
            destroy_trainer_groups()
    return out


def test_trainer_ranks_match_real_megatron_models(tiny):
    hfs = {kind: read_hf_config(d) for kind, d in tiny.items()}
    hfs["dense31"] = {**hfs["dense"], "vocab_size": 31}  # padded to 32 at tp 2: the last shard ends in padding
    results = run_distributed(_megatron_shapes, WORLD, hfs, CASES, [free_port() for _ in CASES], init_dist=False)
    for i, (kind, tp, pp, ep, etp) in enumerate(CASES):
        hf = hfs[kind]
        cfg = _config(tiny.get(kind, tiny["dense"]), world_size=WORLD, tp=tp, pp=pp, ep=ep, expert_tp=etp)
        plan = make_plan(hf, cfg, dtype="fp32")
        for rank in range(WORLD):
            real = results[rank][i]
            stage = pipeline_stage_of(rank, cfg.trainer)
            assert megatron_local_shapes(hf, tp, pp, ep, stage, etp) == real, (kind, rank)
            assert plan.trainer_rank_params[rank] == sum(math.prod(s) for s in real.values())


def _args(config, *overrides, dtype="bf16", needs="table"):
    return argparse.Namespace(config=str(config), overrides=list(overrides), dtype=dtype, link_gbps=50.0, needs=needs)


@pytest.fixture(scope="module")
def table_30b() -> str:
    """What `megarl plan` prints for the 30B recipe as shipped (bf16, the hand-written table's needs): planned once
    for the two tests that read it (seconds of pure Python for 18,867 tensors)."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert run(_args(ROOT / "configs" / "qwen3_30b_a3b_guru.yaml", f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}")) == 0
    return out.getvalue()


def test_plan_command_on_the_30b_recipe(capsys, table_30b):
    recipe = ROOT / "configs" / "qwen3_30b_a3b_guru.yaml"
    out = table_30b
    assert "30,532,122,624 (30.53 B) parameters = 61,064,245,248 bytes = 61.06 GB in bf16" in out
    assert "checked as for a GPU job" in out
    # vLLM's backends: `nccl` sends each of the 4 TP ranks the whole model; `nccl_m2n` reshards only o_proj
    # (48 layers x 2048 x 32*128 bf16 = 805,306,368 bytes, of which each rank gets a quarter)
    assert re.search(r"nccl +61\.06 GB per rank +1\.221 s", out)
    assert re.search(r"nccl_m2n +60\.46 GB per rank", out)  # 61,064,245,248 - 805,306,368 * 3 / 4 bytes
    assert re.search(r"megarl +15\.29 GB per rank +0\.306 s", out)
    # one stage of 32 ranks: 8 expert ranks of whole experts (expert-TP 1) leave expert data parallel 4
    assert "trainer: 32 ranks = tp 1 x pp 1 x dp 32" in out
    assert "experts: ep 8 x expert-tp 1 x expert-dp 4 per stage, 16 experts per rank" in out
    # bf16 with the distributed optimizer (the recipe): 5,164,972,032 parameters per rank, of which 3,623,878,656
    # experts (16 of 128 in each of 48 layers: 48 x 16 x 3 x 768 x 2048); weights 2 B = 10.33 GB, gradient buffers
    # 4 B = 20.66 GB; main 4 B and Adam 8 B of dense / 32 + experts / 4 per rank = 954 M: 3.82 and 7.63 GB
    assert 48 * 16 * 3 * 768 * 2048 == 3_623_878_656
    assert round(4 * ((5_164_972_032 - 3_623_878_656) / 32 + 3_623_878_656 / 4) / 1e9, 1) == 3.8
    assert re.search(r" +0 +10\.3 GB +20\.7 GB +3\.8 GB +7\.6 GB +[\d.]+ GB +1 +1\.6 GB +3\.0 GB +[\d.]+ GB", out)
    # the layout search: this is the best layout the suite trains, with the least recompute that fits
    assert "least recompute that fits this layout: tp 1 x pp 1 x ep 8, recompute full, recompute_layers=42" in out
    assert "best layout: tp 1 x pp 1 x ep 8, recompute full, recompute_layers=42 of 48" in out
    assert "trainer.precision=bf16" in out
    assert run(_args(recipe, f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}", "trainer.expert_tp=2")) == 0
    assert "experts: ep 8 x expert-tp 2 x expert-dp 2 per stage, 16 experts per rank" in capsys.readouterr().out
    # the recipe's layout is one the CPU stack trains (trainer.tp=1); trainer.tp=2 with a MoE model is a GPU-only
    # layout: the CPU check refuses it, plan checks it as for the GPU
    from megarl.config.load import load_config

    cfg = load_config(recipe, [f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}", "trainer.tp=2"])
    with pytest.raises(ConfigError, match="sequence parallel"):
        check_against_model(cfg, read_hf_config(cfg.model.hf_dir), cuda=False)
    assert run(_args(recipe, f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}", dtype="fp32")) == 0
    assert "122,128,490,496 bytes = 122.13 GB in fp32" in capsys.readouterr().out


def test_plan_from_vllms_own_loaders_equals_the_table(capsys, tmp_path, monkeypatch, table_30b):
    """`--needs recorded` on the 30B recipe: vLLM's own loaders (its 4 TP ranks, recorded here with no weights; in a
    whole-suite run test_loader_reads has recorded this layout already, in this process) give every vLLM rank the
    same blocks' bytes as the hand-written table, and so the same comparison with vLLM's backends."""
    monkeypatch.setenv("MEGARL_LOADER_READS_CACHE", str(tmp_path))  # no record left by an earlier run of the suite
    recipe = ROOT / "configs" / "qwen3_30b_a3b_guru.yaml"
    hf_dir = f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}"
    table = table_30b
    assert run(_args(recipe, hf_dir, needs="recorded")) == 0
    recorded = capsys.readouterr().out
    assert "recorded from vLLM's own loaders" in recorded and "recorded from" not in table

    def rank_rows(out):  # the rollout table's "<tp rank> <params> <bytes>" rows, the backends' and senders' lines
        return [line for line in out.splitlines()
                if re.match(r" +\d +[\d,]+ \([\d.]+ B\) +[\d,]+$", line) or re.match(r" +(megarl|nccl)", line)]

    assert len(rank_rows(table)) == 4 + 4 and rank_rows(recorded) == rank_rows(table)  # 4 ranks, 3 backends, senders


def test_plan_refuses_layouts_megatron_refuses(capsys):
    recipe = ROOT / "configs" / "qwen3_30b_a3b_guru.yaml"
    hf_dir = f"model.hf_dir={MODELS / 'qwen3-30b-a3b'}"
    # 16 ranks = tp 1 x pp 2 x dp 8: experts split over 2 expert-TP ranks need expert_tp*ep*pp = 32 ranks
    assert run(_args(recipe, hf_dir, "trainer.world_size=16", "trainer.pp=2", "trainer.expert_tp=2")) == 2
    assert ("trainer.expert_tp=2 x trainer.ep=8 x trainer.pp=2 = 32 does not divide trainer.world_size=16"
            in capsys.readouterr().err)
    assert run(_args(recipe, hf_dir, "trainer.pp=5", "trainer.world_size=80")) == 2  # 48 layers over 5 stages
    assert "trainer.pp=5 does not divide num_hidden_layers=48" in capsys.readouterr().err
    assert run(_args(recipe, hf_dir, "rollout.tp=3")) == 2  # check_against_model's own rule
    assert "rollout.tp=3 does not divide num_attention_heads=32" in capsys.readouterr().err


def test_dense_recipe_plans(capsys):
    assert run(_args(ROOT / "configs" / "qwen2.5_7b_guru.yaml", f"model.hf_dir={MODELS / 'qwen2.5-7b'}")) == 0
    # TP 2 x PP 2 x DP 2 in bf16 with the distributed optimizer: main parameters and Adam halved over DP 2
    assert "worst rank 33.0 GB vs trainer.gpu_memory_gb=80: fits" in capsys.readouterr().out
