"""Math rewards (math-verify, GSM8K strict/flexible) on hand-labelled cases, directly and through a real RewardPool
(spawned workers): equivalent forms score 1, wrong / missing answers 0 (flagged unparsable), and pathological
inputs time out within the pool's timeout without stalling the other items."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.rewards.extract import final_answer_text, last_boxed
from megarl.rewards.gsm8k import gsm8k_flexible, gsm8k_strict
from megarl.rewards.math_verify_reward import math_verify, math_verify_boxed
from megarl.rewards.pool import RewardPool
from megarl.rewards.registry import GOLD_UNPARSABLE, UNPARSABLE, reward_function

pytestmark = pytest.mark.timeout(180)

EQUAL = [  # (response, gold): mathematically the same answer, must score 1
    ("The probability is \\boxed{0.5}.", "\\frac{1}{2}"),
    ("So $x = \\boxed{\\frac{1}{2}}$", "0.5"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{1000}", "1,000"),
    ("The solution set is \\boxed{[1, 2)}", "[1,2)"),
    ("The length is \\boxed{10\\text{ cm}}", "10"),
    ("\\boxed{x^2+1}", "1+x^2"),
    ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
    ("<think>maybe \\boxed{3}?</think>The answer is \\boxed{5}", "5"),
    ("first \\boxed{4}, corrected: \\boxed{\\frac{10}{2}}", "5"),  # the last boxed answer counts
    ("Janet makes 18 dollars.\n#### 18", "18"),
]
WRONG = [  # must score 0
    ("\\boxed{0.4}", "\\frac{1}{2}"),
    ("\\boxed{[1, 2]}", "[1,2)"),  # closed vs half-open interval
    ("\\boxed{x^2-1}", "x^2+1"),
    ("<think>\\boxed{5}</think>so \\boxed{6}", "5"),  # the answer inside the thinking does not count
    ("\\boxed{5} then \\boxed{6}", "5"),
]
UNPARSED = [("", "5"), ("<think>I think it is \\boxed{5} but", "5"), ("no answer here", "5")]


@pytest.mark.parametrize(("response", "gold"), EQUAL)
def test_equivalent_forms_score_one(response, gold):
    assert math_verify(response, gold) == 1.0
    assert math_verify_boxed(response, gold) == 1.0


@pytest.mark.parametrize(("response", "gold"), WRONG)
def test_wrong_answers_score_zero(response, gold):
    assert math_verify(response, gold) == 0.0


@pytest.mark.parametrize(("response", "gold"), UNPARSED)
def test_missing_answers_score_zero_flagged_unparsable(response, gold):
    assert math_verify_boxed(response, gold) == (0.0, UNPARSABLE)


def test_free_text_answer_counts_only_without_the_boxed_requirement():
    assert math_verify("The answer is 5", "5") == 1.0  # math-verify's own extraction
    assert math_verify_boxed("The answer is 5", "5") == (0.0, UNPARSABLE)  # a boxed answer is needed
    assert math_verify("", "5") == (0.0, UNPARSABLE)


def test_unparsable_gold_is_flagged_apart():
    assert math_verify("\\boxed{5}", "") == (0.0, GOLD_UNPARSABLE)


def test_last_boxed_and_think_split():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}} c") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{x") is None and last_boxed("none") is None
    assert last_boxed("\\fbox{7}") == "7"
    assert final_answer_text("<think>a</think>b</think>c") == "c"
    assert final_answer_text("<think>unfinished") is None
    assert final_answer_text("plain") == "plain"


@pytest.mark.parametrize(("response", "gold", "strict", "flexible"), [
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0),
    ("#### $1,234.", "1234", 1.0, 1.0),
    ("The answer is 12.", "12", (0.0, UNPARSABLE), 1.0),
    ("12 apples, then 3 more, so 15", "15", (0.0, UNPARSABLE), 1.0),
    ("#### 13", "12", 0.0, 0.0),
    ("#### -7", "-7", 1.0, 1.0),
    ("#### 2.50", "2.5", 1.0, 1.0),
    ("no number", "3", (0.0, UNPARSABLE), (0.0, UNPARSABLE)),
    ("First try:\n#### 5\nThat was wrong, 3 * 4 = 12.\n#### 12", "12", 1.0, 1.0),  # the LAST `#### N` counts
    ("#### 12\nNo wait, 12 + 1 = 13.\n#### 13", "12", 0.0, 0.0),
])
def test_gsm8k_extractors(response, gold, strict, flexible):
    assert gsm8k_strict(response, gold) == strict
    assert gsm8k_flexible(response, gold) == flexible


# Both never finish inside math-verify/sympy (checked: > 20 s each): a tower of powers and a deeply nested expression.
PATHOLOGICAL = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}"]


def test_math_verify_through_the_pool_counts_unparsable_and_times_out_pathological_inputs():
    n = len(EQUAL)
    items = [*EQUAL, ("", "5"), (PATHOLOGICAL[0], "5"), *WRONG[:2], (PATHOLOGICAL[1], "1"), ("\\boxed{2}", "2")]
    timeout_s = 3.0
    with RewardPool(reward_function("math_verify"), workers=2, timeout_s=timeout_s) as pool:
        start = time.perf_counter()
        scored = pool.score(items)
        elapsed = time.perf_counter() - start
        assert scored.rewards == [1.0] * n + [0.0] * 5 + [1.0]
        assert scored.flags == {UNPARSABLE: [n]}
        assert scored.timed_out == [n + 1, n + 4]
        assert elapsed < 2 * timeout_s + 30  # at most two timeouts and two worker restarts (sympy import)
        assert pool.score([("\\boxed{3}", "3")]).rewards == [1.0]  # the replaced workers score again


def test_math_verify_works_off_the_main_thread():
    # math-verify's own SIGALRM timeouts fail outside the main thread (its parse would return nothing): they are off
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(math_verify("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(60)
    assert results == [1.0]
