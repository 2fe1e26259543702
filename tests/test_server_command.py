"""The fleet's vLLM command line (`megarl.rollout.fleet.server_command`) as a run config makes it: CUDA graphs on
GPU fleets and eager on CPU ones unless `rollout.enforce_eager` says otherwise, and `--max-model-len` the run's
prompt budget plus response budget, refused when the model has fewer positions. GPU specs are built here without a
GPU (`fleet_spec(cfg, gpu=True)`); nothing is started."""

from pathlib import Path

import pytest

from megarl.checks import check_against_model, sequence_length_problem
from megarl.config.load import ConfigError, load_config, validate
from megarl.models.hf_config import read_hf_config
from megarl.rollout.fleet import FleetSpec, fleet_spec, server_command

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "qwen3_30b_a3b_guru.yaml"
HF_DIR = f"model.hf_dir={ROOT / 'configs' / 'models' / 'qwen3-30b-a3b'}"


def _flag(command: list[str], name: str) -> str | None:
    """The value after `name` on the command line, or None when the flag is absent."""
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize(("gpu", "enforce_eager", "eager"), [
    (True, None, False), (False, None, True),  # the defaults: graphs on GPUs, eager on CPU
    (True, True, True), (False, False, False),  # the field overrides either way
])
def test_eager_only_on_cpu_or_when_asked(tmp_path, gpu, enforce_eager, eager):
    command = server_command(FleetSpec(model_dir=tmp_path, gpu=gpu, enforce_eager=enforce_eager), 8000)
    assert ("--enforce-eager" in command) is eager


def test_the_30b_recipe_serves_its_sequence_budget_with_graphs():
    """data.max_prompt_tokens 2048 + rollout.max_new_tokens 8192 (the recipe's numbers), not the model's 40,960."""
    cfg = load_config(RECIPE, [HF_DIR])
    gpu = server_command(fleet_spec(cfg, gpu=True), 8000)
    assert _flag(gpu, "--max-model-len") == "10240" and "--enforce-eager" not in gpu
    cpu = server_command(fleet_spec(cfg, gpu=False), 8000)
    assert _flag(cpu, "--max-model-len") == "10240" and "--enforce-eager" in cpu
    # CPU only: whole prefills, a step holding the longest sequence (megarl.rollout.fleet._cpu_args)
    assert "--no-enable-chunked-prefill" in cpu and _flag(cpu, "--max-num-batched-tokens") == "10240"
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu
    forced = server_command(fleet_spec(load_config(RECIPE, [HF_DIR, "rollout.enforce_eager=true"]), gpu=True), 8000)
    assert "--enforce-eager" in forced
    assert sequence_length_problem(cfg, read_hf_config(cfg.model.hf_dir)) is None  # 10,240 of 40,960 positions


@pytest.mark.parametrize(("overrides", "length"), [
    (["eval.max_new_tokens=12000"], "14048"),  # evaluation asks for longer responses: its budget counts
    (["eval.max_new_tokens=12000", "eval.interval=0"], "10240"),  # no evaluation: only the rollout's
    (["eval.max_new_tokens=100"], "10240"),  # shorter evaluation responses: the rollout's
    (["data.max_prompt_tokens=null"], None),  # unbounded prompts: vLLM takes the model's own length
])
def test_max_model_len_follows_the_budget_fields(overrides, length):
    cfg = load_config(RECIPE, [HF_DIR, *overrides])
    assert _flag(server_command(fleet_spec(cfg, gpu=True), 8000), "--max-model-len") == length


def test_arithmetic_prompts_leave_the_models_length():
    cfg = validate({"model": {"hf_dir": "x"}, "rollout": {"max_new_tokens": 4}, "data": {"max_prompt_tokens": 8}})
    assert "--max-model-len" not in server_command(fleet_spec(cfg, gpu=True), 8000)


def test_a_budget_beyond_the_models_positions_is_refused():
    cfg = load_config(RECIPE, [HF_DIR, "rollout.max_new_tokens=40000"])
    with pytest.raises(ConfigError, match=r"data\.max_prompt_tokens=2048 \+ rollout\.max_new_tokens=40000 = 42048 "
                                          r"tokens exceeds the model's max_position_embeddings=40960: .* lower "
                                          r"data\.max_prompt_tokens or rollout\.max_new_tokens to 40960 in all"):
        check_against_model(cfg, read_hf_config(cfg.model.hf_dir), cuda=True)
    cfg = load_config(RECIPE, [HF_DIR, "eval.max_new_tokens=39000"])
    with pytest.raises(ConfigError, match=r"data\.max_prompt_tokens=2048 \+ eval\.max_new_tokens=39000 = 41048"):
        check_against_model(cfg, read_hf_config(cfg.model.hf_dir), cuda=True)
    tiny = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 32,
            "max_position_embeddings": 128}
    arithmetic = validate({"model": {"hf_dir": "x"}, "rollout": {"max_new_tokens": 200}})
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens=200 tokens exceeds the model's "
                                          r"max_position_embeddings=128: .* lower rollout\.max_new_tokens to 128"):
        check_against_model(arithmetic, tiny, cuda=False)


def test_sequence_refill_gives_the_engine_a_static_shares_slots_and_twice_the_requests():
    """rollout.refill=sequences on the 30B recipe's layout, worked out by hand: 72 prompts on 8 replicas are a static
    share of 9 prompts, so 9 chunks of one prompt in flight a replica and 9 x 16 = 144 sequence slots (vLLM's
    --max-num-seqs); twice the chunks, 18, so 9 more groups wait in vLLM's queue. refill=groups: 9 chunks and vLLM's
    own default."""
    over = [HF_DIR, "data.prompts_per_step=72", "rollout.replicas=8", "rollout.samples_per_prompt=16",
            "rollout.chunk_prompts=1"]
    sequences = load_config(RECIPE, [*over, "rollout.refill=sequences"])
    assert sequences.sequence_slots() == 144 and sequences.rollout_chunks_in_flight() == 18
    assert _flag(server_command(fleet_spec(sequences, gpu=True), 8000), "--max-num-seqs") == "144"
    groups = load_config(RECIPE, over)
    assert groups.sequence_slots() is None and groups.rollout_chunks_in_flight() == 9
    assert "--max-num-seqs" not in server_command(fleet_spec(groups, gpu=True), 8000)
    # chunks of 4 prompts: ceil(9 / 4) = 3 chunks of 4 x 16 sequences = 192 slots, 6 chunks in flight
    chunked = load_config(RECIPE, [*over, "rollout.refill=sequences", "rollout.chunk_prompts=4"])
    assert chunked.sequence_slots() == 192 and chunked.rollout_chunks_in_flight() == 6
