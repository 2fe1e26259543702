"""Row formats of the datasets users already have: each turns one row (a dict, as pyarrow gives it) into a `Record`.

- `guru`: the verl / Reasoning360 layout of Guru (LLM360/guru-RL-92k): `prompt` a list of chat messages
  `{role, content}`, `reward_model.ground_truth` the gold answer, `data_source`, optional `extra_info`;
  `reward_model` / `extra_info` may also be JSON strings of those objects.
- `gsm8k`: openai/gsm8k: `question`, `answer` whose last `#### N` line is the gold (N with `,` removed).
- `math`: MATH (hendrycks) and MATH-500: `problem`, and `answer` when present, else the content of the last
  `\\boxed{...}` of `solution` (nested braces kept).

A row that does not fit raises `DataFormatError` naming the file, the row (0-based), the field and what the format
expects there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megarl.rewards.extract import last_boxed

FORMATS = ("guru", "gsm8k", "math")
EXPECTED = {
    "guru": "`prompt`: a list of {role, content} chat messages; `reward_model`: {ground_truth: str} (or its JSON "
            "string); `data_source`: str; optional `extra_info`: an object (or its JSON string)",
    "gsm8k": "`question`: str; `answer`: str whose last line is `#### N`",
    "math": "`problem`: str; `answer`: str, or `solution`: str holding a final \\boxed{...}",
}


class DataFormatError(ValueError):
    """A dataset row does not have the layout its format expects."""


@dataclass(frozen=True)
class Record:
    prompt: list[dict[str, str]] | str  # chat messages, or plain text (rendered later by megarl.data.prompts)
    answer: str  # gold answer
    data_source: str
    row: int  # row index within its file


class _Row:
    """A row plus where it came from, so every error names the file, the row and the field."""

    def __init__(self, row: dict[str, Any], fmt: str, file: str, index: int) -> None:
        self.row, self.fmt, self.file, self.index = row, fmt, file, index

    def error(self, field: str, problem: str) -> DataFormatError:
        return DataFormatError(f"{self.file}: row {self.index}: field {field!r} {problem}; the {self.fmt!r} format "
                               f"expects {EXPECTED[self.fmt]}")

    def get(self, field: str, types: type | tuple[type, ...], required: bool = True) -> Any:
        value = self.row.get(field)
        if value is None:
            if required:
                raise self.error(field, "is missing or null")
            return None
        if not isinstance(value, types) or isinstance(value, bool):
            raise self.error(field, f"has type {type(value).__name__}")
        return value

    def text(self, field: str, required: bool = True) -> str | None:
        value = self.get(field, str, required)
        if value is not None and not value.strip():
            raise self.error(field, "is empty")
        return value

    def obj(self, field: str, required: bool) -> dict[str, Any] | None:
        """A struct field, or the JSON string of one."""
        value = self.get(field, (dict, str), required)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise self.error(field, f"is a string but not JSON ({exc})") from None
            if not isinstance(value, dict):
                raise self.error(field, f"is a JSON {type(value).__name__}, not an object")
        return value


def _guru(r: _Row) -> Record:
    messages = r.get("prompt", (list, tuple))
    if not messages:
        raise r.error("prompt", "is an empty list")
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise r.error("prompt", f"message {k} is {repr(message)[:80]}, not {{role: str, content: str}}")
    reward_model = r.obj("reward_model", required=True)
    truth = reward_model.get("ground_truth")
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not (isinstance(truth, str) and truth.strip()):
        raise r.error("reward_model.ground_truth", "is missing, empty or not a string"
                      if truth is None or isinstance(truth, str) else f"has type {type(truth).__name__}")
    r.obj("extra_info", required=False)  # checked, unused
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    return Record(chat, truth.strip(), r.text("data_source"), r.index)


def _gsm8k(r: _Row) -> Record:
    question, solution = r.text("question"), r.text("answer")
    if "####" not in solution:
        raise r.error("answer", "has no `#### N` line")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise r.error("answer", "has nothing after its `####`")
    return Record(question, gold, str(r.row.get("data_source") or "gsm8k"), r.index)


def _math(r: _Row) -> Record:
    problem, answer = r.text("problem"), r.get("answer", str, required=False)
    if answer is None or not answer.strip():
        boxed = last_boxed(r.text("solution"))
        if boxed is None or not boxed.strip():
            raise r.error("solution", "has no closed, non-empty \\boxed{...} (and the row has no `answer`)")
        answer = boxed
    return Record(problem, answer.strip(), str(r.row.get("data_source") or "math"), r.index)


_PARSERS = {"guru": _guru, "gsm8k": _gsm8k, "math": _math}


def to_record(row: dict[str, Any], fmt: str, file: str, index: int) -> Record:
    """Row `index` of `file` in format `fmt` as a Record, or DataFormatError naming file, row and field."""
    return _PARSERS[fmt](_Row(row, fmt, file, index))
