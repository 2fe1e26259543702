"""What vLLM's own weight loaders read (`megarl.sync.loader_reads`), against independent expectations.

The reads are recorded by running vLLM 0.32's model classes and their `load_weights` in real processes under
vLLM's parallel state (one gloo process per TP rank, models on the meta device, data-less probes):
1. Qwen2, Qwen3 and Qwen3-MoE at TP 1, 2 and 4 equal the hand-written table `vllm_rank_slices`
   (KV heads replicated at TP 4 > 2 KV heads, vocabulary rows padded to 64 and split), and so does the 30B
   recipe's Qwen3-30B-A3B (`configs/models/qwen3-30b-a3b`, 18,867 tensors) at its vLLM TP 4.
2. Llama, a family megarl has no trainer side for, at TP 1 and 2 equals the expectation derived below by hand
   from how tensor parallelism splits a Llama block.
3. Qwen3-MoE at TP 2 with vLLM expert parallel: each rank reads only its own experts, whole.
One group of 4 processes records all models, layouts and TP sizes (a vLLM import per process dominates; at TP 1 and 2
the other processes only take part in building vLLM's groups); the file cache is exercised by reading a layout back
in a fresh memory cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.models.tiny import make_tiny_checkpoint
from megarl.sync import loader_reads as lr
from megarl.sync.plan import vllm_rank_slices
from megarl.sync.slices import HFSlice

# Llama: 4 query heads of 64 and ONE KV head (replicated on every TP rank), vocabulary 100 (padded to 128)
LLAMA = dict(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=128, tie_word_embeddings=False)
# Qwen2 with head_dim = hidden / heads (vLLM's Qwen2 ignores a config's head_dim), vocabulary 100
QWEN2 = dict(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = ("dense", "moe", "qwen2")
RECIPE_30B = Path(__file__).parent.parent / "configs" / "models" / "qwen3-30b-a3b" / "config.json"


def _save(cls_name: str, config_name: str, kwargs: dict, out: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    getattr(transformers, cls_name)(getattr(transformers, config_name)(**kwargs)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path) -> dict[str, tuple[dict, lr.Tensors]]:
    """kind -> (config.json dict, checkpoint tensor shapes) for the tiny Qwen3 / Qwen3-MoE (megarl.models.tiny; the
    MoE is the session's, tests/fleet_fixture.py), a Qwen2 and a Llama."""
    root = tmp_path_factory.mktemp("loader_reads_models")
    dirs = {"dense": make_tiny_checkpoint(root / "dense", kind="dense"), "moe": tiny_moe_dir}
    dirs["qwen2"] = _save("Qwen2ForCausalLM", "Qwen2Config", QWEN2, root / "qwen2")
    dirs["llama"] = _save("LlamaForCausalLM", "LlamaConfig", LLAMA, root / "llama")
    out = {k: (json.loads((d / "config.json").read_text()), lr.checkpoint_tensors(d)) for k, d in dirs.items()}
    big = json.loads(RECIPE_30B.read_text())  # no checkpoint here: names and shapes from the table at TP 1
    out["qwen3-30b-a3b"] = (big, {s.name: s.full_shape for s in vllm_rank_slices(big, 1, 0)})
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loader_reads_cache")


@pytest.fixture(scope="module")
def recorded(models, cache_dir: Path) -> dict[tuple[str, int, bool], lr.RankReads]:
    """Every model of this test at TP 1, 2 and 4 (Llama up to TP 2, Qwen3-MoE with expert parallel at TP 2, the 30B
    recipe's Qwen3-30B-A3B at its TP 4), recorded by ONE group of 4 processes (one vLLM import each, for all the
    TP sizes); (kind, tp, ep) -> reads."""
    wanted = [(k, tp, False) for tp in (1, 2, 4) for k in FAMILIES + (("llama",) if tp <= 2 else ("qwen3-30b-a3b",))]
    wanted.append(("moe", 2, True))
    reads = lr.record_layouts([(*models[k], tp, ep) for k, tp, ep in wanted], cache_dir)
    return dict(zip(wanted, reads, strict=True))


def _boxes(slices: list[HFSlice]) -> dict[str, tuple]:
    return {s.name: s.box for s in slices}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_recorded_reads_equal_the_table(models, recorded, tp):
    for kind in FAMILIES + (("qwen3-30b-a3b",) if tp == 4 else ()):
        hf, tensors = models[kind]
        assert sorted(recorded[kind, tp, False]) == list(range(tp))  # every rank of this TP size, no other
        assert {s.name for r in range(tp) for s in recorded[kind, tp, False][r]} == set(tensors)  # all read somewhere
        for rank in range(tp):
            want = _boxes(vllm_rank_slices(hf, tp, rank))
            assert _boxes(recorded[kind, tp, False][rank]) == want, (kind, tp, rank)


def _llama_expected(tp: int, rank: int) -> dict[str, tuple]:
    """Hand-derived Llama TP layout: q/k/v rows by heads (the single KV head replicated), o_proj columns by query
    heads, gate/up rows and down columns by intermediate size, norms whole, embedding and head by vocabulary rows
    of the vocabulary padded to 128 (a multiple of 64) split evenly."""
    h, d, inter, vocab = 256, 64, 512, 100
    q = 4 * d // tp
    per = 128 // tp
    rows = (rank * per, min((rank + 1) * per, vocab))
    out = {"model.embed_tokens.weight": (rows, (0, h)), "lm_head.weight": (rows, (0, h)),
           "model.norm.weight": ((0, h),)}
    for layer in range(2):
        p = f"model.layers.{layer}"
        out |= {f"{p}.input_layernorm.weight": ((0, h),), f"{p}.post_attention_layernorm.weight": ((0, h),),
                f"{p}.self_attn.q_proj.weight": ((rank * q, (rank + 1) * q), (0, h)),
                f"{p}.self_attn.k_proj.weight": ((0, d), (0, h)), f"{p}.self_attn.v_proj.weight": ((0, d), (0, h)),
                f"{p}.self_attn.o_proj.weight": ((0, h), (rank * q, (rank + 1) * q)),
                f"{p}.mlp.gate_proj.weight": ((rank * inter // tp, (rank + 1) * inter // tp), (0, h)),
                f"{p}.mlp.up_proj.weight": ((rank * inter // tp, (rank + 1) * inter // tp), (0, h)),
                f"{p}.mlp.down_proj.weight": ((0, h), (rank * inter // tp, (rank + 1) * inter // tp))}
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_reads_equal_a_hand_derived_layout(models, recorded, tp):
    assert set(_llama_expected(1, 0)) == set(models["llama"][1])  # every checkpoint tensor is accounted for
    for rank in range(tp):
        assert _boxes(recorded["llama", tp, False][rank]) == _llama_expected(tp, rank), (tp, rank)


def test_file_cache_serves_a_recorded_layout(models, recorded, cache_dir, monkeypatch):
    monkeypatch.setattr(lr, "_MEMORY", {})  # a fresh process: only the file cache is left

    def no_recording(*args, **kwargs):
        raise AssertionError("the layout was recorded again instead of read from the file cache")

    monkeypatch.setattr("megarl.parallel.spawn.run_ranks", no_recording)
    hf, tensors = models["llama"]
    key = lr.layout_key(hf, tensors, 2, False)
    assert (cache_dir / f"{key}.json").exists()
    assert _boxes(lr.loader_reads(hf, tensors, 2, cache_dir=cache_dir)[1]) == _llama_expected(2, 1)


def _expert(name: str) -> int | None:
    return int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None


def test_expert_parallel_ranks_read_only_their_experts_whole(models, recorded):
    """vLLM expert parallel over the TP ranks (`--enable-expert-parallel`, EP size = TP = 2): with vLLM's default
    linear placement rank r owns experts [4r, 4r + 4) of 8 and reads each of their tensors whole, no other
    expert; attention, norms, router and vocabulary keep the TP 2 layout of the table."""
    hf, tensors = models["moe"]
    for rank in range(2):
        got = _boxes(recorded["moe", 2, True][rank])
        experts = {_expert(n) for n in got} - {None}
        assert experts == set(range(4 * rank, 4 * rank + 4)), rank
        for name, box in got.items():
            if _expert(name) is not None:
                assert box == tuple((0, s) for s in tensors[name]), name
        table = {n: b for n, b in _boxes(vllm_rank_slices(hf, 2, rank)).items() if _expert(n) is None}
        assert {n: b for n, b in got.items() if _expert(n) is None} == table
