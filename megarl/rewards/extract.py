"""Answer extraction shared by the rewards and the dataset loaders (no heavy imports: used in the data path too)."""

from __future__ import annotations

import re

UNPARSABLE = "unparsable"  # reward flag: no answer could be extracted from the response
GOLD_UNPARSABLE = "gold_unparsable"  # reward flag: the gold answer itself could not be parsed (a data problem)
GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")  # GSM8K's final-answer line `#### N`


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included; None if there
    is none or its braces never close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer_text(response_text: str) -> str | None:
    """The part of a response that holds its answer: the text after the last `</think>`; None when a `<think>`
    was opened and never closed (the response ended while thinking); the whole text when there is no think tag."""
    if "</think>" in response_text:
        return response_text.rsplit("</think>", 1)[1]
    if "<think>" in response_text:
        return None
    return response_text
