"""The least recompute that fits and the best trainer layout (`megarl/trainer/layout_search.py`), searched over the
memory plan: the answers are checked by their defining property against the plan itself (the first that fits, the
one before does not), and `trainer.recompute_layers` against a hand count of what a recomputed layer keeps."""

from __future__ import annotations

import pytest

from megarl.config.schema import Config, ModelConfig, RolloutConfig, TrainerConfig
from megarl.trainer import layout_search as search
from megarl.trainer.memory_plan import GB, activation_bytes, layer_elements

DENSE8 = dict(model_type="qwen3", vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, intermediate_size=512, tie_word_embeddings=False)


def _cfg(tmp_path, gb: float, **trainer) -> Config:
    return Config(model=ModelConfig(hf_dir=str(tmp_path)), rollout=RolloutConfig(max_new_tokens=2048),
                  trainer=TrainerConfig(max_tokens_per_microbatch=8192, gpu_memory_gb=gb, **trainer))


def test_recompute_layers_keep_only_the_rerun_layers_inputs():
    """Hand count: with k of L layers recomputed, the stage keeps k layer inputs (h per token), the other L - k
    layers' whole activations, one rebuilt layer at a time, and the stage's input/output (2h per token)."""
    tokens, longest, layers, h = 4096, 2048, 8, 256
    per_layer = layer_elements(DENSE8, 1, False, False) + 2 * 4 * longest  # + the local spec's attention scores
    for k in (1, 3, 8):
        want = 4 * tokens * (k * h + (layers - k) * per_layer + per_layer + 2 * h)
        got = activation_bytes(DENSE8, tokens, longest, layers, 1, flash=False, recompute="full", recompute_layers=k)
        assert got == int(want), k
    assert activation_bytes(DENSE8, tokens, longest, layers, 1, False, "full", recompute_layers=8) == \
        activation_bytes(DENSE8, tokens, longest, layers, 1, False, "full")  # every layer = no recompute_layers


def test_least_recompute_is_the_first_that_fits(tmp_path):
    # sized so that no recompute does not fit, full over every layer does
    cfg = _cfg(tmp_path, 1.0)  # flash attention (the GPU plan): no selective step
    worst = {k: search._worst(DENSE8, cfg, recompute="full", recompute_layers=k) for k in range(1, 9)}
    none = search._worst(DENSE8, cfg, recompute="none")
    budget = (worst[8] + worst[4]) / 2  # between recomputing 4 and all 8 layers
    cfg = _cfg(tmp_path, budget / search.HEADROOM / GB)
    assert none > budget
    fit = search.least_recompute(DENSE8, cfg)
    assert fit is not None and fit.recompute == "full" and fit.recompute_layers is not None
    k = fit.recompute_layers
    assert worst[k] <= budget < worst[k - 1]  # the fewest layers that fit
    assert fit.worst_bytes == worst[k] and 4 < k < 8


def test_best_layout_prefers_no_pipeline_then_least_recompute(tmp_path):
    cfg = _cfg(tmp_path, 80.0, world_size=4)
    best = search.best_layouts(DENSE8, cfg, top=10)
    assert best[0].pp == 1 and best[0].recompute == "none"  # a tiny model fits anywhere: no pipeline, no recompute
    assert [f.pp for f in best] == sorted(f.pp for f in best)
    assert {(f.tp, f.pp) for f in best} <= {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    # under flash attention 'selective' saves nothing and is never proposed
    assert "selective" not in search.useful_recomputes(cfg)
    assert "selective" in search.useful_recomputes(_cfg(tmp_path, 80.0, layer_spec="local"))


def test_recompute_layers_need_full_recompute():
    with pytest.raises(ValueError, match="trainer.recompute_layers=4 needs trainer.recompute=full"):
        TrainerConfig(recompute_layers=4)
    assert TrainerConfig(recompute="full", recompute_layers=4).recompute_layers == 4
