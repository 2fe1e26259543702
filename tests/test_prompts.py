"""Prompt rendering: the tokenizer's own chat template (transformers' apply_chat_template with a hand-written
template), raw text, the instruction suffix, and the errors; expected strings written out by hand."""

from __future__ import annotations

import pytest

from megarl.data.prompts import PromptError, describe_prompts, prompt_tokens, render_prompt
from tests.data_fixtures import word_tokenizer

CHAT = [{"role": "system", "content": "Be careful."}, {"role": "user", "content": "What is 2 + 3?"}]
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def test_chat_rows_through_the_tokenizers_template():
    tokenizer = word_tokenizer(chat=True)
    expected = "<|system|>\nBe careful.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    assert render_prompt(CHAT, tokenizer, "chat") == expected
    assert render_prompt(CHAT, tokenizer, "auto") == expected


def test_instruction_goes_to_the_last_user_message_before_the_template():
    tokenizer = word_tokenizer(chat=True)
    chat = [*CHAT, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 4?"}]
    expected = (f"<|system|>\nBe careful.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n5\n<|user|>\nAnd 3 + 4?\n"
                f"{INSTRUCTION}\n<|assistant|>\n")
    assert render_prompt(chat, tokenizer, "chat", INSTRUCTION) == expected
    assert chat[-1]["content"] == "And 3 + 4?"  # the row itself is not modified


def test_plain_text_rows_as_one_user_message_or_raw():
    with_template, without = word_tokenizer(chat=True), word_tokenizer(chat=False)
    assert render_prompt("Add 2 and 3.", with_template, "auto", "Answer briefly.") == \
        "<|user|>\nAdd 2 and 3.\nAnswer briefly.\n<|assistant|>\n"
    assert render_prompt("Add 2 and 3.", without, "auto", "Answer briefly.") == "Add 2 and 3.\nAnswer briefly."
    assert render_prompt("Add 2 and 3.", with_template, "raw") == "Add 2 and 3."
    assert render_prompt(CHAT, without, "raw") == "Be careful.\n\nWhat is 2 + 3?"


def test_errors_name_the_setting_and_the_fix():
    with pytest.raises(PromptError, match="no chat template: use data.prompt_template: auto or raw"):
        render_prompt(CHAT, word_tokenizer(chat=False), "chat")
    with pytest.raises(PromptError, match="no user message"):
        render_prompt([{"role": "system", "content": "x"}], word_tokenizer(chat=True), "chat", INSTRUCTION)
    with pytest.raises(PromptError, match="unknown data.prompt_template 'jinja'"):
        render_prompt("x", word_tokenizer(chat=True), "jinja")


def test_token_counts_and_the_logged_text():
    tokenizer = word_tokenizer(chat=False)
    assert prompt_tokens(["1 + 2 =", "3 + 4 + 5 =", ""], tokenizer) == [4, 6, 0]  # one token per word, no specials
    text = describe_prompts(["first\nprompt", "second"], ["1", "2"])
    assert text == "--- prompt 0 (gold answer '1') ---\nfirst\nprompt\n--- prompt 1 (gold answer '2') ---\nsecond"
