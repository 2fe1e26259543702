"""Which layer spec a trainer rank builds (`megarl/models/layer_backend.py`), and the one line a GPU rank without
Transformer Engine is refused with. The inputs are what a rank sees (a CUDA device, an importable
`transformer_engine`), so the refusal a TE-less GPU rank meets is exercised here on a CPU machine, through the same
functions the rank (`MegatronPolicy`) and the preflight's rank step call."""

from __future__ import annotations

import pytest

from megarl.config.schema import Config, ModelConfig, RolloutConfig, TrainerConfig
from megarl.models.layer_backend import (
    TRAINER_CONTAINER,
    TransformerEngineMissing,
    gpu_layer_spec_note,
    resolve_layer_spec,
    te_installed,
)
from megarl.preflight.versions import layer_spec_problems

# (setting, cuda, te) -> the spec built, or None: refused
TABLE = [
    ("auto", True, True, "te"), ("auto", True, False, None), ("auto", False, False, "local"),
    ("auto", False, True, "local"),
    ("te", True, True, "te"), ("te", True, False, None), ("te", False, True, None),
    ("local", True, True, "local"), ("local", True, False, "local"), ("local", False, False, "local"),
]


@pytest.mark.parametrize(("setting", "cuda", "te", "built"), TABLE)
def test_layer_spec_table(setting, cuda, te, built):
    if built is None:
        with pytest.raises(TransformerEngineMissing) as err:
            resolve_layer_spec(setting, cuda, te)
        assert "\n" not in str(err.value) and "trainer.layer_spec" in str(err.value)
    else:
        assert resolve_layer_spec(setting, cuda, te) == built


def test_gpu_rank_without_te_is_refused_with_one_line_naming_the_container_and_the_debug_switch():
    with pytest.raises(TransformerEngineMissing) as err:
        resolve_layer_spec("auto", cuda=True, te=False)
    line = str(err.value)
    assert "\n" not in line
    assert TRAINER_CONTAINER in line and "trainer.layer_spec=local" in line and "Transformer Engine" in line


def test_preflight_rank_step_reports_the_same_line_on_a_gpu_node_only():
    [finding] = layer_spec_problems("auto", "rank", gpu=True, te=False)
    with pytest.raises(TransformerEngineMissing, match=TRAINER_CONTAINER):
        resolve_layer_spec("auto", True, False)
    assert TRAINER_CONTAINER in finding
    assert layer_spec_problems("local", "rank", gpu=True, te=False) == []  # asked for explicitly
    assert layer_spec_problems("auto", "serve", gpu=True, te=False) == []  # the fleet builds no megatron model
    assert layer_spec_problems("auto", "rank", gpu=False, te=False) == []  # a CPU node runs the local spec
    assert layer_spec_problems("auto", "rank", gpu=True, te=True) == []


def test_this_machine_builds_the_local_spec():
    """The CPU suite's ranks resolve `auto` to the local spec (no CUDA here), whatever TE is."""
    import torch

    assert not torch.cuda.is_available()
    assert resolve_layer_spec("auto", torch.cuda.is_available(), te_installed()) == "local"


def test_check_gpu_says_which_layouts_need_te():
    assert TRAINER_CONTAINER in gpu_layer_spec_note("auto") and "need" in gpu_layer_spec_note("auto")
    assert "local layer spec" in gpu_layer_spec_note("local")


def test_memory_plan_counts_attention_scores_on_the_local_spec(tmp_path):
    """`trainer.layer_spec=local` on GPUs keeps the [b, heads, s, s] scores: the plan counts
    2 x heads/tp x s elements per token and layer more activations than under flash attention (hand count)."""
    from megarl.trainer.memory_plan import trainer_memory

    hf = dict(model_type="qwen3", vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, intermediate_size=512, tie_word_embeddings=False)

    def plan(spec: str):
        trainer = TrainerConfig(world_size=1, layer_spec=spec, max_tokens_per_microbatch=4096)
        return trainer_memory(hf, Config(model=ModelConfig(hf_dir=str(tmp_path)), trainer=trainer,
                                         rollout=RolloutConfig(max_new_tokens=2048)))[0]

    flash, local = plan("auto"), plan("local")
    tokens, longest = flash.tokens, 2048  # two responses of 2,048 tokens per microbatch
    assert tokens == 4096
    assert local.activations - flash.activations == 4 * tokens * 4 * (2 * 4 * longest)  # fp32 x layers x scores


def test_grad_reduce_in_bf16_needs_bf16_training():
    with pytest.raises(ValueError, match="trainer.grad_reduce_in_bf16 needs trainer.precision=bf16"):
        TrainerConfig(grad_reduce_in_bf16=True)
    assert TrainerConfig(precision="bf16", grad_reduce_in_bf16=True).grad_reduce_in_bf16
