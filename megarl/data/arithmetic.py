"""Synthetic verifiable task: small-number addition, `"3 + 4 ="` -> `"7"` (or, digit by digit, `"1 2"` for 12).

Prompts are drawn with a seeded generator, so batch `l` of a run is the same whatever the schedule. With
`digits=False` the answer is a single token of the tiny tokenizer and an untrained model scores about 1/vocab.
With `digits=True` the answer is written one digit per token and a correct response must also end with the EOS
token (the decoded text must equal the answer exactly): responses of 2-3 tokens of varying length, so
sequence-level losses, EOS handling and padding run end to end, and an untrained model scores about 1/vocab^2.
"""

from __future__ import annotations

import random

from megarl.data.problem import Problem

__all__ = ["Problem", "problem_batch"]


def problem_batch(batch_index: int, size: int, max_operand: int, seed: int, digits: bool = False) -> list[Problem]:
    """The `batch_index`-th batch of `size` problems with operands in 0..max_operand (deterministic); `digits`:
    answers spelled one digit per token ("1 2")."""
    rng = random.Random(f"{seed}:{batch_index}")
    out = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        answer = " ".join(str(a + b)) if digits else str(a + b)
        out.append(Problem(prompt=f"{a} + {b} =", answer=answer))
    return out
