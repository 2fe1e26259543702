"""Prompt text from dataset rows: the tokenizer's own chat template, or the raw text, plus an instruction suffix.

`data.prompt_template`:
- `auto` (default): the chat template when the tokenizer has one, else `raw`;
- `chat`: `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`, plain-text rows as
  a single user message; an error when the tokenizer has no chat template;
- `raw`: plain-text rows as they are; chat rows as their messages' contents joined by a blank line.

`data.instruction` (e.g. "Please reason step by step, and put your final answer within \\boxed{}.") is appended to
the last user message (or to the plain text) on a new line, before the template is applied.

Paper templates: none of the papers this project's recipes follow (the group-relative REINFORCE / REC paper, the
off-policy GRPO paper and the OAPL paper in /work/shared/papers) states a prompt template or system prompt for GSM8K,
MATH, Guru or DeepScaleR (REC trains with Trinity-RFT, off-policy GRPO with TRL, both without quoting a prompt), so
no paper-specific template is provided: chat-format rows (Guru) carry their own instruction in the prompt, and the
GSM8K / MATH recipes choose one with `data.instruction`.
"""

from __future__ import annotations

from typing import Any

INSTRUCTION_SEPARATOR = "\n"


class PromptError(ValueError):
    """A prompt cannot be rendered as configured."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _with_instruction(prompt: list[dict[str, str]] | str, instruction: str) -> list[dict[str, str]] | str:
    if not instruction:
        return prompt
    if isinstance(prompt, str):
        return prompt + INSTRUCTION_SEPARATOR + instruction
    users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
    if not users:
        raise PromptError("data.instruction is set but the chat prompt has no user message to append it to")
    messages = [dict(m) for m in prompt]
    messages[users[-1]]["content"] += INSTRUCTION_SEPARATOR + instruction
    return messages


def render_prompt(prompt: list[dict[str, str]] | str, tokenizer: Any, template: str = "auto",
                  instruction: str = "") -> str:
    """The exact prompt text the engine gets for one row (see the module docstring)."""
    prompt = _with_instruction(prompt, instruction)
    if template == "auto":
        template = "chat" if has_chat_template(tokenizer) else "raw"
    if template == "raw":
        return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    if template != "chat":
        raise PromptError(f"unknown data.prompt_template {template!r} (expected auto, chat or raw)")
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "")
        raise PromptError(f"data.prompt_template is 'chat' but the tokenizer {name!r} has no chat template: use "
                          "data.prompt_template: auto or raw, or a tokenizer that has one")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_tokens(texts: list[str], tokenizer: Any) -> list[int]:
    """Token counts of rendered prompts, tokenized as the rollout engine gets them (no special tokens added: the
    chat template already wrote its own)."""
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def describe_prompts(texts: list[str], answers: list[str]) -> str:
    """The exact text of some prompts with their gold answers, for the run log (once per run)."""
    parts = [f"--- prompt {i} (gold answer {answer!r}) ---\n{text}" for i, (text, answer) in
             enumerate(zip(texts, answers, strict=True))]
    return "\n".join(parts)
