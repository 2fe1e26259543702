"""Reward registry: registered names and dotted paths resolve; bad names / paths / non-callables are config errors
naming them; a raising dotted-path function's RewardError names it; RewardConfig validates reward.name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megarl.config.schema import RewardConfig
from megarl.rewards.exact_match import exact_match
from megarl.rewards.gsm8k import gsm8k_strict
from megarl.rewards.math_verify_reward import math_verify
from megarl.rewards.pool import RewardError, RewardPool
from megarl.rewards.registry import REWARD_FUNCTIONS, RewardConfigError, check_reward_name, load_reward, reward_function


def test_registered_names_load_their_functions():
    assert load_reward("exact_match") is exact_match
    assert load_reward("math_verify") is math_verify
    assert load_reward("gsm8k_strict") is gsm8k_strict
    assert set(REWARD_FUNCTIONS) >= {"exact_match", "math_verify", "gsm8k_strict", "gsm8k_flexible"}
    for name in REWARD_FUNCTIONS:
        assert callable(load_reward(name))


def test_dotted_path_is_passed_through_and_loads():
    assert reward_function("tests.reward_fns:scripted") == "tests.reward_fns:scripted"
    assert load_reward("megarl.rewards.exact_match:exact_match") is exact_match


@pytest.mark.parametrize("name", ["exact-match", "math_verify()", "my_pkg.rewards", "a:b:c", ""])
def test_bad_form_is_a_config_error_naming_it(name):
    with pytest.raises(RewardConfigError, match="neither a registered reward") as error:
        check_reward_name(name)
    assert repr(name) in str(error.value) and "math_verify" in str(error.value)


@pytest.mark.parametrize(("name", "why"), [("no_such_pkg_xyz.rewards:score", "cannot import"),
                                           ("tests.reward_fns:missing", "cannot import"),
                                           ("tests.reward_fns:NOT_CALLABLE", "not callable")])
def test_unimportable_or_non_callable_path_is_a_config_error_naming_it(name, why):
    with pytest.raises(RewardConfigError, match=why) as error:
        load_reward(name)
    assert repr(name) in str(error.value)


def test_reward_config_validates_the_name():
    assert RewardConfig(name="gsm8k_flexible").name == "gsm8k_flexible"
    assert RewardConfig(name="my_pkg.rewards:score").name == "my_pkg.rewards:score"  # imported when the run starts
    with pytest.raises(ValidationError, match="'exactmatch' is neither a registered reward"):
        RewardConfig(name="exactmatch")


@pytest.mark.timeout(120)
def test_raising_dotted_function_error_names_the_function():
    with RewardPool(reward_function("tests.reward_fns:scripted"), workers=1) as pool:
        with pytest.raises(RewardError, match="reward function tests.reward_fns:scripted raised ValueError"):
            pool.score([("boom", "1")])
