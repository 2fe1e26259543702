"""Math reward on `math-verify` (Hugging Face): the gold answer and the response's final answer are parsed to
sympy and compared with `verify(gold, pred)` (gold first: verify is not symmetric, e.g. for set/interval relations).

Answer extraction, in order: the text after the last `</think>` (a response that opened `<think>` and never closed
it has no answer), then its last `\\boxed{...}` (balanced braces), else GSM8K's last `#### N`, else - for
`math_verify` only - math-verify's own extraction over the whole remaining text (last LaTeX or plain expression);
`math_verify_boxed` requires a boxed answer. The gold string is parsed as LaTeX math (`$gold$`), falling back to
math-verify's default extraction.

math-verify's own timeouts use SIGALRM, which fails outside the main thread (math-verify issues #50, #55), so they are
disabled here (`parsing_timeout=None`, `timeout_seconds=None`): these functions run in a `RewardPool` worker
process, which the pool kills when an item passes `reward.timeout_s` (e.g. `\\boxed{9^{9^{9^{9}}}}`, whose
comparison never ends). Returns 1.0 / 0.0, or `(0.0, "unparsable")` when no answer could be extracted and
`(0.0, "gold_unparsable")` when the gold answer cannot be parsed.
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from megarl.rewards.extract import GOLD_UNPARSABLE, GSM8K_ANSWER, UNPARSABLE, final_answer_text, last_boxed

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: the pool enforces one

_LATEX = [LatexExtractionConfig(), ExprExtractionConfig()]


def _parse_pred(text: str, boxed_only: bool) -> list:
    boxed = last_boxed(text)
    if boxed is not None:
        return parse(f"\\boxed{{{boxed}}}", extraction_config=_LATEX, parsing_timeout=None)
    gsm8k = GSM8K_ANSWER.findall(text)
    if gsm8k:
        return parse(gsm8k[-1].replace(",", ""), extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
    if boxed_only or not text.strip():
        return []
    return parse(text, parsing_timeout=None)


def _parse_gold(answer: str) -> list:
    gold = parse(f"${answer}$", extraction_config=_LATEX, parsing_timeout=None)
    return gold or parse(answer, parsing_timeout=None)


def _score(response_text: str, answer: str, boxed_only: bool) -> float | tuple[float, str]:
    gold = _parse_gold(answer)
    if not gold:
        return 0.0, GOLD_UNPARSABLE
    text = final_answer_text(response_text)
    pred = [] if text is None else _parse_pred(text, boxed_only)
    if not pred:
        return 0.0, UNPARSABLE
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def math_verify(response_text: str, answer: str) -> float | tuple[float, str]:
    """1.0 if the response's final answer is mathematically equal to `answer` (see the module docstring)."""
    return _score(response_text, answer, boxed_only=False)


def math_verify_boxed(response_text: str, answer: str) -> float | tuple[float, str]:
    """As `math_verify`, but only a `\\boxed{}` or `#### N` answer counts (no free-text extraction)."""
    return _score(response_text, answer, boxed_only=True)
