"""One prompt of a rollout batch, as the rollout worker consumes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str  # the exact text the engine gets (chat template and instruction already applied)
    answer: str  # the gold answer, the reward function's second argument
    data_source: str = ""  # where the row came from (Guru's `data_source`, or the format name); "" for synthetic
    index: int = -1  # the row's index in the task's row list (all files, in order); -1 for synthetic problems
