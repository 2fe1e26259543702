"""Synthetic verifiable task: small-number addition, `"3 + 4 ="` -> `"7"`.

Prompts are drawn with a seeded generator, so batch `l` of a run is the same whatever the schedule;
the answer is a single token of the tiny tokenizer, so exact match is well defined and an untrained
model scores about 1/vocab.
"""

from __future__ import annotations

import random

from megarl.data.problem import Problem

__all__ = ["Problem", "problem_batch"]


def problem_batch(batch_index: int, size: int, max_operand: int, seed: int) -> list[Problem]:
    """The `batch_index`-th batch of `size` problems with operands in 0..max_operand (deterministic)."""
    rng = random.Random(f"{seed}:{batch_index}")
    out = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Problem(prompt=f"{a} + {b} =", answer=str(a + b)))
    return out
