"""The recipes in configs/: every one validates against its model's architecture (the GPU recipes as GPU jobs),
and the paper recipes carry the papers' settings (written out here from notes/algorithms.md and the papers)."""

from pathlib import Path

import pytest

from megarl.checks import check_against_model
from megarl.config.load import load_config
from megarl.models.hf_config import read_hf_config

CONFIGS = sorted(Path("configs").glob("*.yaml"))

# recipe -> the settings its paper gives (REC Table 1/2 and B.7, OAPL section 5 / appendix A.1, Revisiting GRPO
# section 5); values are (section, field) -> expected
PAPER_SETTINGS = {
    "rec_gsm8k_qwen2.5_1.5b.yaml": {  # REC Table 1 (GSM8K), Table 2, finding F1, Fig. 2 "mixed" (16, 8)
        ("optimizer", "lr"): 1e-6, ("data", "prompts_per_step"): 96, ("rollout", "samples_per_prompt"): 8,
        ("optimizer", "weight_decay"): 0.01, ("optimizer", "warmup_steps"): 0, ("optimizer", "betas"): (0.9, 0.999),
        ("optimizer", "grad_clip"): 1.0, ("algorithm", "name"): "rec_onesided_nois", ("algorithm", "eps_low"): 0.6,
        ("algorithm", "eps_high"): 2.0, ("sync", "interval"): 16, ("sync", "offset"): 8,
        ("rollout", "temperature"): 1.0, ("rollout", "top_p"): 1.0,
    },
    "qwen2.5_7b_guru.yaml": {  # REC Table 1 (Guru Qwen2.5 7B), Table 2
        ("optimizer", "lr"): 1e-6, ("data", "prompts_per_step"): 64, ("rollout", "samples_per_prompt"): 16,
        ("optimizer", "weight_decay"): 0.1, ("optimizer", "warmup_steps"): 80, ("optimizer", "grad_clip"): 1.0,
    },
    "qwen3_30b_a3b_guru.yaml": {  # REC Table 1 (Guru Qwen3 30B-A3B) and appendix B.7
        ("optimizer", "lr"): 2e-6, ("data", "prompts_per_step"): 72, ("rollout", "samples_per_prompt"): 16,
        ("optimizer", "weight_decay"): 0.1, ("optimizer", "warmup_steps"): 80, ("algorithm", "name"): "rec_gspo_is",
        ("algorithm", "eps_low"): 6e-4, ("algorithm", "eps_high"): 8e-4, ("sync", "interval"): 8,
    },
    "oapl_math_qwen3_4b.yaml": {  # OAPL section 5 and appendix A.1
        ("algorithm", "name"): "oapl", ("rollout", "samples_per_prompt"): 8, ("data", "prompts_per_step"): 128,
        ("optimizer", "betas"): (0.9, 0.95), ("sync", "interval"): 50, ("algorithm", "oapl_beta1"): 1.0,
        ("rollout", "max_new_tokens"): 16384, ("rollout", "temperature"): 1.0, ("rollout", "top_p"): 1.0,
    },
    "off_policy_grpo_gsm8k_qwen2.5_0.5b.yaml": {  # Revisiting GRPO section 5 (GSM8K): v=10, i=1
        ("algorithm", "name"): "off_policy_grpo", ("optimizer", "lr"): 5e-6, ("algorithm", "beta"): 0.1,
        ("rollout", "samples_per_prompt"): 16, ("data", "prompts_per_step"): 28, ("sync", "interval"): 10,
        ("sync", "offset"): 0, ("rollout", "temperature"): 0.1, ("rollout", "max_new_tokens"): 200,
    },
}


def test_every_paper_recipe_is_shipped():
    assert set(PAPER_SETTINGS) <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_fits_its_model(path):
    cfg = load_config(path)
    if cfg.model.tiny is None:  # the GPU recipes: their model.hf_dir holds the public model's config.json
        check_against_model(cfg, read_hf_config(cfg.model.hf_dir), cuda=True)
    for (section, field), expected in PAPER_SETTINGS.get(path.name, {}).items():
        value = getattr(getattr(cfg, section), field)
        assert value == (pytest.approx(expected) if isinstance(expected, float) else expected), (section, field)


def test_the_documented_inflight_overrides_fit_the_30b_recipe():
    """docs/cluster.md's in-flight command for the 30B recipe: its overrides validate against the model as a GPU
    job and give the projection's best setting (in-flight, sync (8, 1), sequence refill, decoupled)."""
    doc = Path("docs/cluster.md").read_text()
    line = next(ln for ln in doc.splitlines() if "guru_inflight" in ln and "sbatch slurm/guru_moe.sh" in ln)
    overrides = line.split('MEGARL_OVERRIDES="', 1)[1].split('"', 1)[0].split()
    cfg = load_config("configs/qwen3_30b_a3b_guru.yaml", overrides)
    check_against_model(cfg, read_hf_config("configs/models/qwen3-30b-a3b"), cuda=True)
    assert cfg.sync.inflight and cfg.algorithm.decoupled.enabled and cfg.rollout.refill == "sequences"
    assert (cfg.sync.interval, cfg.sync.offset) == (8, 1)
