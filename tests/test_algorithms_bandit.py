"""REC section 3's 3-arm bandit through the library's registered losses: vanilla group-relative REINFORCE
on data from the fixed behaviour policy [0.3, 0.6, 0.1] drifts to the sub-optimal arm a2 (index 1,
reward 0.8); one-side clipping keeps the policy bounded near the behaviour policy."""

import pytest
import torch

from megarl.algorithms.bandit import ARM_REWARDS, BEHAVIOUR, run_bandit, tail_mean
from megarl.config.schema import AlgorithmConfig


def test_vanilla_reinforce_drifts_to_the_suboptimal_arm():
    traj = run_bandit("reinforce", AlgorithmConfig(name="reinforce"), steps=300, seed=0)
    assert traj[0].tolist() == pytest.approx(list(BEHAVIOUR))
    final = traj[-1]
    assert int(final.argmax()) == 1 and final[1] > 0.99  # a2 (r = 0.8), not the optimal a3 (r = 1)
    assert final[2] < 0.01
    # the paper's limit: g -> sum_j pi_b(a_j) (r_j - mu_r) e_j favours a2 (0.6 * 0.22 > 0.1 * 0.42)
    mu = sum(p * r for p, r in zip(BEHAVIOUR, ARM_REWARDS, strict=True))
    g = [p * (r - mu) for p, r in zip(BEHAVIOUR, ARM_REWARDS, strict=True)]
    assert g[1] > g[2] > 0 > g[0]


def test_first_step_gradient_is_the_group_relative_reinforce_update():
    """One SGD step of lr 1 from pi_b moves the logits by g = (1/N) sum_i (r_i - rbar_group) (e_{a_i} - pi_b),
    recomputed here from the same sampled groups."""
    groups, k, seed = 8, 8, 3
    traj = run_bandit("reinforce", AlgorithmConfig(name="reinforce"), steps=1, groups=groups, k=k, lr=1.0, seed=seed)
    behaviour = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    actions = torch.multinomial(behaviour.expand(groups, 3), k, replacement=True,
                                generator=torch.Generator().manual_seed(seed))
    g = torch.zeros(3, dtype=torch.float64)
    for row in actions.tolist():
        rbar = sum(ARM_REWARDS[a] for a in row) / k
        for a in row:
            e = torch.zeros(3, dtype=torch.float64)
            e[a] = 1
            g += (ARM_REWARDS[a] - rbar) * (e - behaviour) / (groups * k)
    torch.testing.assert_close(traj[1], torch.softmax(behaviour.log() + g, -1))


def test_one_side_clipping_stays_near_the_behaviour_policy():
    traj = run_bandit("rec_onesided_nois", AlgorithmConfig(name="rec_onesided_nois"), steps=200, seed=0)
    policy = tail_mean(traj)
    # a2 stops near 1 + eps_high = 1.2 times its behaviour probability, a3 near 1.2 x 0.1; a1 keeps mass
    assert policy[1] == pytest.approx(0.72, abs=0.02) and policy[2] == pytest.approx(0.12, abs=0.02)
    assert policy[0] > 0.1
