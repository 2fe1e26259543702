"""The registered algorithms' names and the ones that refuse a train-inference correction: plain data, no torch,
below the config layer. `megarl/config/schema.py` validates `algorithm.name` (and a correction's pairing) against
it on any machine, the launch side included; `registry.py`, which pairs each name with its functions, registers
exactly these names (checked when it is imported). Add an algorithm here and in the registry.
"""

from __future__ import annotations

ALGORITHM_NAMES: tuple[str, ...] = (
    "reinforce",
    "grpo",
    "rec_onesided_is",
    "rec_onesided_nois",
    "rec_twosided_is",
    "rec_twosided_nois",
    "rec_ring_is",
    "rec_ring_nois",
    "rec_gspo_nois",
    "rec_gspo_is",
    "gspo",
    "opmd_sequence",
    "opmd_token",
    "asymre",
    "pairwise_reinforce",
    "red_drop",
    "red_weight",
    "oapl",
    "off_policy_grpo",
)

# name -> why its loss must not take `PolicyLossInput.token_weight` (the config refuses the pairing)
NOT_REWEIGHTABLE: dict[str, str] = {
    "oapl": "it regresses beta2 log(pi / pi_vllm) to the advantage directly, and an importance weight breaks that "
    "regression target",
}
