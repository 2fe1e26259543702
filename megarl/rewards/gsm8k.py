"""GSM8K answer extractors: strict (`#### N` only, the dataset's own answer format) and flexible (last number).

Both compare numbers after removing thousands separators, `$` and a trailing `.`; a response with no answer of
the expected form scores 0 flagged `unparsable` (see `megarl.rewards.registry`).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from megarl.rewards.extract import GSM8K_ANSWER, UNPARSABLE

_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _number(text: str) -> Decimal | None:
    """`text` as a number with `,`, `$` and spaces removed, or None."""
    try:
        return Decimal(text.replace(",", "").replace("$", "").replace(" ", "").rstrip("."))
    except InvalidOperation:
        return None


def _compare(found: str | None, answer: str) -> float | tuple[float, str]:
    if found is None or (value := _number(found)) is None:
        return 0.0, UNPARSABLE
    gold = _number(answer.strip())
    return 1.0 if gold is not None and value == gold else 0.0


def gsm8k_strict(response_text: str, answer: str) -> float | tuple[float, str]:
    """1.0 when the last `#### N` of the response equals the gold number; no `#### N`: 0 flagged unparsable."""
    found = GSM8K_ANSWER.findall(response_text)
    return _compare(found[-1] if found else None, answer)


def gsm8k_flexible(response_text: str, answer: str) -> float | tuple[float, str]:
    """1.0 when the last number in the response equals the gold number; no number: 0 flagged unparsable."""
    found = _NUMBER.findall(response_text)
    return _compare(found[-1] if found else None, answer)
