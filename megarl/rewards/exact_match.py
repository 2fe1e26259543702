"""Exact-match reward for verifiable answers."""

from __future__ import annotations


def exact_match(response_text: str, answer: str) -> float:
    """1.0 when the response (special tokens removed, surrounding space stripped) equals the answer."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0
