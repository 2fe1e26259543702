"""Reward functions by name: `reward.name` is a registered name or a dotted path `package.module:callable`.

Signature of every reward function (called in a `RewardPool` worker process, one item at a time):

    fn(response_text: str, answer: str) -> float | tuple[float, str]

`response_text` is the decoded response (special tokens removed), `answer` the problem's gold answer string. It
returns the score, or `(score, flag)` where `flag` (a short string, e.g. `UNPARSABLE`) marks the item so the run can
count it (`ScoredRewards.flags`). It must not need a timeout of its own: the pool kills a worker that passes
`reward.timeout_s` and scores that item 0. This module holds only strings, so the config schema can import it
without importing any reward's dependencies.
"""

from __future__ import annotations

import re

from megarl.rewards.extract import GOLD_UNPARSABLE, UNPARSABLE  # noqa: F401 - the flags, re-exported here
from megarl.rewards.pool import _load

REWARD_FUNCTIONS = {  # reward.name -> 'module:callable'
    "exact_match": "megarl.rewards.exact_match:exact_match",
    "math_verify": "megarl.rewards.math_verify_reward:math_verify",
    "math_verify_boxed": "megarl.rewards.math_verify_reward:math_verify_boxed",
    "gsm8k_strict": "megarl.rewards.gsm8k:gsm8k_strict",
    "gsm8k_flexible": "megarl.rewards.gsm8k:gsm8k_flexible",
}
_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


class RewardConfigError(ValueError):
    """`reward.name` is neither a registered name nor an importable 'package.module:callable'."""


def check_reward_name(name: str) -> str:
    """`name` if it is registered or has the dotted form (nothing is imported), else RewardConfigError."""
    if name in REWARD_FUNCTIONS or _DOTTED.match(name):
        return name
    raise RewardConfigError(
        f"reward.name {name!r} is neither a registered reward ({', '.join(sorted(REWARD_FUNCTIONS))}) nor a dotted "
        "path 'package.module:callable' (e.g. 'my_pkg.rewards:score')"
    )


def reward_function(name: str) -> str:
    """The 'module:callable' string `RewardPool` takes for `reward.name` (form checked, nothing imported)."""
    return REWARD_FUNCTIONS.get(check_reward_name(name), name)


def load_reward(name: str):  # noqa: ANN201 - the callable itself
    """Import the reward function `name` resolves to, or raise RewardConfigError naming it and why."""
    function = reward_function(name)
    try:
        return _load(function)
    except ValueError as exc:
        raise RewardConfigError(f"reward.name {name!r}: {exc}") from None
