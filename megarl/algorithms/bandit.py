"""The didactic 3-arm bandit of REC section 3, run through the library's own registered algorithms.

Arms `a1, a2, a3` have rewards `[0, 0.8, 1]`; every group of `K` responses is sampled from the FIXED
behaviour policy `pi_b = [0.3, 0.6, 0.1]` (the trainer never syncs the sampler, REC's offline stress
test). The trained policy is a softmax over 3 logits, initialised at `pi_b`, updated by plain SGD on
each algorithm's loss (one "token" per response, `old_logprobs = engine_logprobs = ref = log pi_b`).
Vanilla group-relative REINFORCE follows `g -> sum_j pi_b(a_j) (r_j - mu_r) e_j` and drifts to the
sub-optimal `a2` (index 1); the clipped / regularised variants stay bounded near `pi_b` or move less.

    python -m megarl.algorithms.bandit --out docs/figures/bandit.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megarl.algorithms.losses import PolicyLossInput
from megarl.algorithms.registry import get_algorithm
from megarl.config.schema import AlgorithmConfig

ARM_REWARDS = (0.0, 0.8, 1.0)
BEHAVIOUR = (0.3, 0.6, 0.1)


@dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str
    overrides: dict[str, object] = field(default_factory=dict)
    lr_scale: float = 1.0  # multiplies the common SGD learning rate (for losses whose gradient scale differs)

    def config(self) -> AlgorithmConfig:
        return AlgorithmConfig(name=self.algorithm, **self.overrides)


VARIANTS: tuple[Variant, ...] = (
    Variant("REINFORCE", "reinforce"),
    Variant("REC-OneSide-NOIS (0.2, 0.2)", "rec_onesided_nois"),
    Variant("REC-OneSide-NOIS (0.6, 2.0)", "rec_onesided_nois", {"eps_low": 0.6, "eps_high": 2.0}),
    Variant("REC-OneSide-IS (0.2, 0.2)", "rec_onesided_is"),
    Variant("REC-TwoSide-NOIS (0.2, 0.2)", "rec_twosided_nois"),
    Variant("REC-Ring-NOIS (0.2, 0.2 | 0.6, 2.0)", "rec_ring_nois"),
    Variant("GRPO (0.2, 0.2)", "grpo"),
    Variant("REC-GSPO-NOIS (0.2, 0.2)", "rec_gspo_nois"),
    Variant("OPMD-sequence (beta 0.1)", "opmd_sequence"),
    Variant("OPMD-sequence (beta 1)", "opmd_sequence", {"beta": 1.0}),
    Variant("AsymRE (beta 0.1)", "asymre"),
    Variant("pairwise REINFORCE (T 1)", "pairwise_reinforce"),
    Variant("RED-Drop", "red_drop"),
    Variant("RED-Weight (T 1)", "red_weight"),
    Variant("RED-Weight (T 0.1, lr x0.1)", "red_weight", {"temperature": 0.1}, lr_scale=0.1),
    Variant("OAPL (beta1 1, beta2 0.1, lr x5)", "oapl", {"oapl_beta2": 0.1}, lr_scale=5.0),
    Variant("OAPL (beta1 0.1, beta2 0.1, lr x5)", "oapl", {"oapl_beta1": 0.1, "oapl_beta2": 0.1}, lr_scale=5.0),
    Variant("off-policy GRPO (beta 0.1, k3)", "off_policy_grpo"),
)


def run_bandit(
    algorithm: str, cfg: AlgorithmConfig, steps: int = 400, groups: int = 8, k: int = 8, lr: float = 0.5,
    seed: int = 0,
) -> torch.Tensor:
    """Train a softmax policy with `algorithm`'s advantages and loss on groups sampled from `BEHAVIOUR`.
    Returns the policy after each step, `[steps + 1, 3]` (row 0 = the initial `pi_b`). The sampled
    data depend only on `seed`, so every algorithm sees exactly the same groups."""
    algo = get_algorithm(algorithm)
    behaviour = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    arm_rewards = torch.tensor(ARM_REWARDS, dtype=torch.float64)
    logits = behaviour.log().clone().requires_grad_(True)
    optimizer = torch.optim.SGD([logits], lr=lr)
    sampler = torch.Generator().manual_seed(seed)
    n = groups * k
    history = [torch.softmax(logits.detach(), -1)]
    for _ in range(steps):
        actions = torch.multinomial(behaviour.expand(groups, 3), k, replacement=True, generator=sampler)  # [G, K]
        rewards = arm_rewards[actions]
        advantages = algo.advantages(rewards, cfg).reshape(-1)
        seq_mask = algo.sequence_mask(rewards, cfg).reshape(-1)
        flat = actions.reshape(-1)
        old = behaviour.log()[flat][:, None]  # [N, 1]: one-token responses
        inp = PolicyLossInput(
            logprobs=torch.log_softmax(logits, -1)[flat][:, None], old_logprobs=old, mask=torch.ones_like(old),
            advantages=advantages, num_seqs=n, num_tokens=n, engine_logprobs=old, ref_logprobs=old, seq_mask=seq_mask,
        )
        optimizer.zero_grad()
        loss, _ = algo.loss(inp, cfg)
        loss.backward()
        optimizer.step()
        history.append(torch.softmax(logits.detach(), -1))
    return torch.stack(history)


def run_all(
    steps: int = 1000, seed: int = 0, lr: float = 0.5, variants: tuple[Variant, ...] = VARIANTS
) -> dict[str, torch.Tensor]:
    """Every variant on the same sampled groups; returns label -> policy trajectory `[steps + 1, 3]`."""
    return {v.label: run_bandit(v.algorithm, v.config(), steps=steps, lr=lr * v.lr_scale, seed=seed) for v in variants}


def tail_mean(trajectory: torch.Tensor, fraction: float = 0.1) -> torch.Tensor:
    """`[steps + 1, 3] -> [3]`: the policy averaged over the last `fraction` of the steps (noisy variants)."""
    n = max(1, int(round((trajectory.shape[0] - 1) * fraction)))
    return trajectory[-n:].mean(0)


def _smooth(values: torch.Tensor, window: int) -> torch.Tensor:
    kernel = torch.ones(1, 1, window, dtype=values.dtype) / window
    padded = torch.cat([values[:1].expand(window - 1), values])
    return torch.nn.functional.conv1d(padded[None, None], kernel)[0, 0]


def plot(results: dict[str, torch.Tensor], out: Path, window: int = 20) -> None:
    """Left: trajectories of pi(a2) (solid) and pi(a3) (dashed), running mean over `window` steps, for a
    subset of variants; right: every variant's policy averaged over the last 10% of the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_traj, ax_bar) = plt.subplots(1, 2, figsize=(16, 7.5), gridspec_kw={"width_ratios": [1, 1.1]})
    shown = ("REINFORCE", "REC-OneSide-NOIS (0.2, 0.2)", "REC-OneSide-NOIS (0.6, 2.0)", "OPMD-sequence (beta 0.1)",
             "AsymRE (beta 0.1)", "RED-Weight (T 1)", "RED-Weight (T 0.1, lr x0.1)",
             "OAPL (beta1 0.1, beta2 0.1, lr x5)")
    colors = plt.get_cmap("tab10")
    for c, label in enumerate(x for x in shown if x in results):
        traj = results[label]
        ax_traj.plot(_smooth(traj[:, 1], window).numpy(), color=colors(c), label=label)
        ax_traj.plot(_smooth(traj[:, 2], window).numpy(), color=colors(c), linestyle="--")
    ax_traj.set_xlabel("SGD step (groups always sampled from pi_b = [0.3, 0.6, 0.1])")
    ax_traj.set_ylabel(f"probability, {window}-step running mean (solid: a2, r = 0.8; dashed: a3, r = 1)")
    ax_traj.set_ylim(0, 1)
    ax_traj.set_title("Policy trajectories")
    ax_traj.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    labels = list(results)
    finals = torch.stack([tail_mean(results[x]) for x in labels] + [torch.tensor(BEHAVIOUR)]).numpy()
    rows = labels + ["pi_b (the data)"]
    left = [0.0] * len(rows)
    for arm, (name, color) in enumerate(zip(("a1 (r=0)", "a2 (r=0.8)", "a3 (r=1)"),
                                            ("#bbbbbb", "#e07b39", "#2a9d5c"), strict=True)):
        ax_bar.barh(rows, finals[:, arm], left=left, color=color, label=name)
        left = [x + y for x, y in zip(left, finals[:, arm], strict=True)]
    ax_bar.invert_yaxis()
    ax_bar.set_xlim(0, 1)
    ax_bar.set_xlabel("policy, averaged over the last 10% of the steps")
    ax_bar.set_title(f"Policy after {len(results[labels[0]]) - 1} steps")
    ax_bar.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.suptitle("REC section 3 bandit: rewards [0, 0.8, 1], data from the fixed behaviour policy [0.3, 0.6, 0.1]")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures/bandit.png"), help="figure path")
    parser.add_argument("--steps", type=int, default=1000, help="SGD steps (8 groups of 8 samples each)")
    parser.add_argument("--lr", type=float, default=0.5, help="common SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the behaviour-policy sampler")
    parser.add_argument("--json", type=Path, default=None, help="also write the policies (last-10% mean) as JSON")
    args = parser.parse_args(argv)
    results = run_all(steps=args.steps, seed=args.seed, lr=args.lr)
    finals = {label: [round(float(p), 4) for p in tail_mean(traj)] for label, traj in results.items()}
    for label, probs in finals.items():
        print(f"{label:40s} a1 {probs[0]:.3f}  a2 {probs[1]:.3f}  a3 {probs[2]:.3f}")
    plot(results, args.out)
    if args.json:
        args.json.write_text(json.dumps(finals, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
