"""Reward functions for tests/test_reward_pool.py, imported by the pool's worker processes.

`scripted` acts on the response text: most responses are scored by exact match; a few keywords make it
misbehave the way a real reward function might (hang, raise, crash the process, return a bad value), or return
a flagged `(score, flag)` pair.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from megarl.rewards.exact_match import exact_match

NOT_CALLABLE = 3


def scripted(response_text: str, answer: str) -> float | tuple[float, str]:
    if response_text == "hang":
        time.sleep(3600)
    if response_text.startswith("boom"):
        raise ValueError("boom in the reward function")
    if response_text == "exit":
        os._exit(3)
    if response_text == "nan":
        return float("nan")
    if response_text.startswith("flag:"):  # "flag:<flag>": 0.0 marked with <flag>
        return 0.0, response_text.removeprefix("flag:")
    if response_text == "badflag":
        return 1.0, 3  # type: ignore[return-value]
    if response_text == "text":
        return "not a number"  # type: ignore[return-value]
    if response_text.startswith("meet:"):  # wait until two processes are inside this call at the same time
        folder = Path(response_text.removeprefix("meet:"))
        (folder / str(os.getpid())).touch()
        while len(list(folder.iterdir())) < 2:
            time.sleep(0.01)
        return float(os.getpid())
    if response_text == "torch?":
        return float("torch" in sys.modules)
    if response_text.startswith("slow:"):
        time.sleep(0.01)
        return exact_match(response_text.removeprefix("slow:"), answer)
    return exact_match(response_text, answer)


def odd_word_count(response_text: str, answer: str) -> float:
    """1.0 when the response has an odd number of words: about half of a random model's responses score, so
    evaluation tests see both outcomes."""
    return float(len(response_text.split()) % 2 == 1)
