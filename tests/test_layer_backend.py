"""Which layer spec a trainer rank builds (`megarl/models/layer_backend.py`), and the one line a GPU rank without
Transformer Engine is refused with. The inputs are what a rank sees (a CUDA device, an importable
`transformer_engine`), so the refusal a TE-less GPU rank meets is exercised here on a CPU machine, through the same
functions the rank (`MegatronPolicy`) and the preflight's rank step call."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megarl.config.schema import Config, ModelConfig, RolloutConfig, TrainerConfig
from megarl.models.layer_backend import (
    TRAINER_CONTAINER,
    TransformerEngineMissing,
    gpu_layer_spec_note,
    precision_problem,
    resolve_layer_spec,
    te_installed,
)
from megarl.models.qwen_provider import te_fusions
from megarl.preflight.versions import layer_spec_problems
from tests.te_attention_standin import available_backends

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


NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _megatron_attention_env(monkeypatch: pytest.MonkeyPatch, backend: object) -> dict[str, str]:
    """The NVTE_* variables megatron-core 0.16.1 itself sets for `attention_backend` when a GPTModel is built
    (`LanguageModule._set_attention_backend`, megatron/core/models/common/language_module/language_module.py:92-126,
    which reads only `self.config.attention_backend`), from an environment without them."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    for name in NVTE:
        monkeypatch.delenv(name, raising=False)
    LanguageModule._set_attention_backend(SimpleNamespace(config=SimpleNamespace(attention_backend=backend)))
    return {name: os.environ[name] for name in NVTE}


def test_te_spec_leaves_the_attention_kernel_to_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's spec asks megatron for `AttnBackend.auto`: every TE attention kernel stays allowed, so TE 2.9 (the
    stand-in of its choice) finds one for a bf16 THD training call on Hopper without the `flash_attn` package (the
    trainer image's case). A forced flash backend (the spec before) turned the fused and unfused kernels off and left
    none there: the first forward raised "No dot product attention backend is available"."""
    from megatron.core.transformer.enums import AttnBackend

    env = _megatron_attention_env(monkeypatch, te_fusions(apex_wgrad=False)["attention_backend"])
    assert env == dict.fromkeys(NVTE, "1")
    hopper = dict(dtype=torch.bfloat16, qkv_format="thd", compute_capability=(9, 0))
    assert available_backends(env, **hopper) == ["fused"]
    assert available_backends(env, **hopper, flash_attn_v2=True) == ["flash", "fused"]
    forced = _megatron_attention_env(monkeypatch, AttnBackend.flash)
    assert available_backends(forced, **hopper) == []  # what the forced choice met without flash_attn


@pytest.mark.parametrize("qkv_format", ["thd", "sbhd"])
def test_fp32_leaves_te_only_its_unfused_kernel(qkv_format: str) -> None:
    """Why `precision_problem` refuses fp32 on TE's spec: in fp32 TE 2.9 keeps only its unfused kernel, none with
    THD packing (`trainer.pack_sequences`), and the unfused one keeps the [b, heads, s, s] scores `megarl plan` does
    not count under TE; bf16 runs either way."""
    env = dict.fromkeys(NVTE, "1")
    fp32 = available_backends(env, torch.float32, qkv_format, (9, 0), flash_attn_v2=True)
    assert fp32 == ([] if qkv_format == "thd" else ["unfused"])
    assert "fused" in available_backends(env, torch.bfloat16, qkv_format, (9, 0))
    assert precision_problem("te", "fp32") is not None
    assert precision_problem("te", "bf16") is None and precision_problem("local", "fp32") is None


@pytest.mark.parametrize(("cuda", "te", "precision", "setting"), [
    (False, False, "fp32", "auto"), (False, False, "bf16", "auto"),  # CPU: auto is the local spec
    (True, False, "bf16", "local"), (True, True, "bf16", "auto"),
    (True, True, "fp32", "local"),  # TE's spec refuses fp32: the fp32 references run the local spec
])
def test_benchmarks_and_gpu_tests_ask_for_a_spec_their_precision_runs_on(monkeypatch: pytest.MonkeyPatch, cuda: bool,
                                                                        te: bool, precision: str, setting: str):
    import megarl.models.layer_backend as layer_backend

    monkeypatch.setattr(layer_backend, "te_installed", lambda: te)
    assert layer_backend.bench_layer_spec(cuda, precision) == setting
    built = resolve_layer_spec(setting, cuda, te)
    assert precision_problem(built, precision) is None
