"""The registered algorithms' names and the ones that refuse a train-inference correction, the decoupled objective
or mixed-version data (in-flight weight updates, docs/algorithms.md): plain data, no torch,
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

# name -> why the decoupled objective (`algorithm.decoupled`, `decoupled.py`) does not apply (the config refuses it)
NOT_DECOUPLABLE: dict[str, str] = {
    "oapl": "its loss regresses beta2 log(pi / pi_vllm) onto r - V_hat with the engine policy as the KL anchor: "
    "there is no ratio to clip against a proximal policy, and a behaviour weight breaks the regression target",
    "opmd_sequence": "its regulariser (logp - oldlogp)^2 anchors to the policy that sampled the data; the decoupled "
    "objective replaces oldlogp by the proximal policy (the trainer's current weights), whose regulariser gradient is "
    "0 at the one update per batch, so OPMD would silently become behaviour-weighted REINFORCE",
    "opmd_token": "its regulariser (logp_t - oldlogp_t)^2 anchors to the policy that sampled the data; the decoupled "
    "objective replaces oldlogp by the proximal policy (the trainer's current weights), whose regulariser gradient is "
    "0 at the one update per batch, so OPMD would silently become behaviour-weighted REINFORCE",
}

# name -> why it refuses a batch in which one group holds tokens of several policy versions (checked per batch)
SINGLE_VERSION_GROUPS: dict[str, str] = {
    "oapl": "OAPL's V_hat = beta1 log mean_i exp(r_i / beta1) estimates the value of ONE sampling policy from the "
    "group, and the same policy is the KL anchor of the regression (the paper empties its buffer at every sync so "
    "that V_hat sees one sampling distribution); a group whose tokens come from several versions has no such policy",
}
